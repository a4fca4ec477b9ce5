"""Schedule validation for KFP recurring runs, done here so a bad schedule fails before any request.

KFP's scheduled-workflow controller parses cron with ``github.com/robfig/cron`` (v1) ``cron.Parse``:
six fields ``second minute hour day-of-month month day-of-week``, or a descriptor (``@weekly``,
``@every 1h30m``). That parser also accepts FIVE fields, but reads them as ``second minute hour dom
month`` (no day of week), so a crontab line such as ``0 3 * * 1`` silently means "03 seconds past
every minute of every hour in January" there. Five fields are therefore rejected with the
six-field spelling as the hint.

    >>> validate_cron("0 0 3 * * MON")
    '0 0 3 * * MON'
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone

# (name, low, high, names) per field, in order.
_MONTHS = ["JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC"]
_DAYS = ["SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT"]
_FIELDS = (
    ("second", 0, 59, None),
    ("minute", 0, 59, None),
    ("hour", 0, 23, None),
    ("day-of-month", 1, 31, None),
    ("month", 1, 12, {n: i + 1 for i, n in enumerate(_MONTHS)}),
    ("day-of-week", 0, 6, {n: i for i, n in enumerate(_DAYS)}),
)
_DESCRIPTORS = ("@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly")
# A Go time.Duration as robfig's @every takes it: e.g. 90s, 1h30m, 1.5h.
_GO_DURATION = re.compile(r"^(?:\d+(?:\.\d+)?(?:ns|us|µs|ms|s|m|h))+$")
_GO_PART = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_GO_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_INTERVAL = re.compile(r"^(\d+)([smhdw]?)$")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


class ScheduleError(ValueError):
    """A schedule the KFP scheduler would reject or misread."""


def _value(text: str, low: int, high: int, names: dict | None, field: str) -> int:
    key = text.upper()
    if names and key in names:
        return names[key]
    if not text.isdigit():
        raise ScheduleError(f"{field}: {text!r} is not a number" + (f" or one of {', '.join(names)}" if names else ""))
    v = int(text)
    if not low <= v <= high:
        raise ScheduleError(f"{field}: {v} is outside {low}-{high}")
    return v


def _parse_field(text: str, field: str, low: int, high: int, names: dict | None) -> tuple[set[int], bool]:
    """(the values the field matches, whether it is a '*'/'?' field) as robfig/cron reads it."""
    values: set[int] = set()
    star = False
    for part in text.split(","):
        if not part:
            raise ScheduleError(f"{field}: empty element in {text!r}")
        rng, slash, step_text = part.partition("/")
        if slash and (not step_text.isdigit() or int(step_text) == 0):
            raise ScheduleError(f"{field}: step {step_text!r} must be a positive number")
        step = int(step_text) if slash else 1
        if rng in ("*", "?"):
            if rng == "?" and field not in ("day-of-month", "day-of-week"):
                raise ScheduleError(f"{field}: '?' is only allowed in day-of-month and day-of-week")
            lo, hi, star = low, high, True
        else:
            lo_text, dash, hi_text = rng.partition("-")
            lo = _value(lo_text, low, high, names, field)
            hi = _value(hi_text, low, high, names, field) if dash else (high if slash else lo)   # "N/step" = N-max
            if hi < lo:
                raise ScheduleError(f"{field}: range {rng!r} runs backwards")
        values.update(range(lo, hi + 1, step))
    return values, star


def _parse(text: str) -> list[tuple[set[int], bool]]:
    fields = text.split(" ")
    if len(fields) != 6:
        raise ScheduleError(f"{text!r} has {len(fields)} fields; KFP cron has 6: "
                            "second minute hour day-of-month month day-of-week (e.g. '0 0 3 * * MON')")
    parsed = []
    for value, (field, low, high, names) in zip(fields, _FIELDS):
        try:
            parsed.append(_parse_field(value, field, low, high, names))
        except ScheduleError as e:
            raise ScheduleError(f"{text!r}: {e}") from None
    return parsed


def next_fire(expr: str, after: datetime) -> datetime | None:
    """The first time after ``after`` (UTC) that a 6-field cron expression fires, or None if it does not
    fire within 5 years: robfig/cron's ``Next`` gives up there, so such a schedule never runs."""
    (sec, _), (mins, _), (hours, _), (dom, dom_star), (months, _), (dow, dow_star) = _parse(" ".join(expr.split()))
    after = after.astimezone(timezone.utc).replace(microsecond=0) + timedelta(seconds=1)
    day = after.replace(hour=0, minute=0, second=0)
    while day.year <= after.year + 5:
        # robfig: with a '*' day-of-month or day-of-week both must match, else either one.
        dom_ok, dow_ok = day.day in dom, (day.weekday() + 1) % 7 in dow
        if day.month in months and ((dom_ok and dow_ok) if dom_star or dow_star else (dom_ok or dow_ok)):
            for t in (day.replace(hour=h, minute=m, second=s) for h in sorted(hours) for m in sorted(mins)
                      for s in sorted(sec)):
                if t >= after:
                    return t
        day += timedelta(days=1)
    return None


def _every_seconds(duration: str) -> float:
    """A Go ``time.Duration`` string in seconds; ScheduleError if it is not one."""
    if not _GO_DURATION.match(duration):
        raise ScheduleError(f"'@every {duration}': {duration!r} is not a Go duration such as 90s, 1h30m or 168h")
    return sum(float(n) * _GO_UNIT_S[u] for n, u in _GO_PART.findall(duration))


def validate_cron(expr: str, now: datetime | None = None) -> str:
    """Return ``expr`` stripped if KFP's scheduler reads it as intended and it ever fires, else raise
    ScheduleError. ``now``: where "ever" starts (default: the current time)."""
    text = " ".join(expr.split())
    if not text:
        raise ScheduleError("empty cron expression")
    if text.startswith("@"):
        if text in _DESCRIPTORS:
            return text
        head, _, dur = text.partition(" ")
        if head != "@every":
            raise ScheduleError(f"unknown descriptor {text!r}; use one of {', '.join(_DESCRIPTORS)} "
                                "or '@every <duration>' such as '@every 168h'")
        seconds = _every_seconds(dur)
        # robfig/cron runs '@every' under a second every second, and drops fractions of a second.
        if seconds < 1 or seconds != int(seconds):
            raise ScheduleError(f"{text!r} would run every {max(1, int(seconds))} s: KFP's scheduler rounds an "
                                "interval down to whole seconds (and up to at least 1 s); give a whole number "
                                "of seconds of at least 1, e.g. '@every 168h'")
        return text
    fields = text.split(" ")
    if len(fields) == 5:
        message = (f"{text!r} has 5 fields, but KFP cron has 6 (second minute hour day-of-month month day-of-week) "
                   f"and would read these as 'second minute hour day-of-month month'")
        suggestion = "0 " + text
        try:
            validate_cron(suggestion, now)
        except ScheduleError as e:
            # Never suggest a schedule that is itself invalid: say what is wrong with the crontab line.
            why = str(e).removeprefix(f"{suggestion!r}: ")
            raise ScheduleError(f"{message}; as a crontab line it is invalid too: {why}") from None
        raise ScheduleError(f"{message}; did you mean {suggestion!r}?")
    now = now or datetime.now(timezone.utc)
    if next_fire(text, now) is None:
        dom, month, dow = fields[3:]
        on = "" if dow in ("*", "?") else f" or day-of-week {dow!r}" if dom not in ("*", "?") else f" on {dow!r}"
        raise ScheduleError(f"{text!r} never fires: no day in the 5 years after {now:%Y-%m-%d} is day-of-month "
                            f"{dom!r}{on} in month {month!r}")
    return text


def parse_interval(text: str) -> int:
    """``90``, ``90s``, ``15m``, ``6h``, ``7d``, ``1w`` -> seconds (at least 1)."""
    m = _INTERVAL.match(text.strip())
    if not m or int(m.group(1)) == 0:
        raise ScheduleError(f"interval {text!r} must be a positive whole number with an optional unit s|m|h|d|w "
                            "(e.g. 7d)")
    return int(m.group(1)) * _UNIT_S[m.group(2)]


def parse_time(text: str) -> datetime:
    """An RFC 3339 / ISO 8601 time; a time without a zone is taken as UTC."""
    try:
        t = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ScheduleError(f"{text!r} is not an ISO 8601 time such as 2026-01-05T03:00:00Z") from None
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)
