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
from datetime import datetime, timezone

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


def _check_field(text: str, field: str, low: int, high: int, names: dict | None) -> None:
    for part in text.split(","):
        if not part:
            raise ScheduleError(f"{field}: empty element in {text!r}")
        rng, _, step = part.partition("/")
        if step and (not step.isdigit() or int(step) == 0):
            raise ScheduleError(f"{field}: step {step!r} must be a positive number")
        if rng in ("*", "?"):
            if rng == "?" and field not in ("day-of-month", "day-of-week"):
                raise ScheduleError(f"{field}: '?' is only allowed in day-of-month and day-of-week")
            continue
        lo_text, dash, hi_text = rng.partition("-")
        lo = _value(lo_text, low, high, names, field)
        if dash:
            hi = _value(hi_text, low, high, names, field)
            if hi < lo:
                raise ScheduleError(f"{field}: range {rng!r} runs backwards")


def validate_cron(expr: str) -> str:
    """Return ``expr`` stripped if KFP's scheduler reads it as intended, else raise ScheduleError."""
    text = " ".join(expr.split())
    if not text:
        raise ScheduleError("empty cron expression")
    if text.startswith("@"):
        if text in _DESCRIPTORS:
            return text
        head, _, dur = text.partition(" ")
        if head == "@every" and _GO_DURATION.match(dur):
            return text
        raise ScheduleError(f"unknown descriptor {text!r}; use one of {', '.join(_DESCRIPTORS)} "
                            "or '@every <duration>' such as '@every 168h'")
    fields = text.split(" ")
    if len(fields) == 5:
        raise ScheduleError(
            f"{text!r} has 5 fields, but KFP cron has 6 (second minute hour day-of-month month day-of-week) "
            f"and would read these as 'second minute hour day-of-month month'; did you mean '0 {text}'?")
    if len(fields) != 6:
        raise ScheduleError(f"{text!r} has {len(fields)} fields; KFP cron has 6: "
                            "second minute hour day-of-month month day-of-week (e.g. '0 0 3 * * MON')")
    for value, (field, low, high, names) in zip(fields, _FIELDS):
        try:
            _check_field(value, field, low, high, names)
        except ScheduleError as e:
            raise ScheduleError(f"{text!r}: {e}") from None
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
