"""Schedule validation: KFP's scheduler (robfig/cron v1) reads 6 fields; five are a silent trap."""

import re
from datetime import datetime, timezone

import pytest

from pipelines.cron import ScheduleError, next_fire, parse_interval, parse_time, validate_cron


@pytest.mark.parametrize("expr", [
    "0 0 3 * * MON", "0 0 3 * * 1", "0 */15 * * * *", "30 0 0 1,15 * ?", "0 0 9 ? * 2-6", "0 0 0 1 JAN-MAR *",
    "0 0 12 * * SUN-SAT/2", "5/10 * * * * *", "@weekly", "@daily", "@every 168h", "@every 1h30m",
    "  0   0 3 * *  MON ",
])
def test_valid_kfp_cron(expr):
    assert validate_cron(expr) == " ".join(expr.split())


@pytest.mark.parametrize("expr, message", [
    ("0 3 * * 1", "has 5 fields"),
    ("0 3 * * 1", "did you mean '0 0 3 * * 1'?"),
    ("* * * *", "has 4 fields"),
    ("0 0 0 0 1 * * *", "has 8 fields"),
    ("60 * * * * *", "second: 60 is outside 0-59"),
    ("0 0 24 * * *", "hour: 24 is outside 0-23"),
    ("0 0 0 0 * *", "day-of-month: 0 is outside 1-31"),
    ("0 0 0 * 13 *", "month: 13 is outside 1-12"),
    ("0 0 0 * * 7", "day-of-week: 7 is outside 0-6"),
    ("0 0 0 * * MONDAY", "day-of-week: 'MONDAY' is not a number"),
    ("0 0 5-2 * * *", "runs backwards"),
    ("0 */0 * * * *", "step '0'"),
    ("0 0 ? * * *", "'?' is only allowed"),
    ("0 0 1,,2 * * *", "empty element"),
    ("@every week", "'week' is not a Go duration"),
    ("@reboot", "unknown descriptor"),
    ("", "empty cron expression"),
])
def test_invalid_cron_says_why(expr, message):
    with pytest.raises(ScheduleError) as e:
        validate_cron(expr)
    assert message in str(e.value)


NOW = datetime(2026, 12, 1, 9, 30, tzinfo=timezone.utc)     # a Tuesday


@pytest.mark.parametrize("expr", ["0 0 0 30 2 *", "0 0 0 31 4 *", "0 0 0 31 2,4,6,9,11 *", "0 0 0 30-31 FEB ?"])
def test_a_cron_that_never_fires_is_refused(expr):
    with pytest.raises(ScheduleError, match="never fires"):
        validate_cron(expr, NOW)


@pytest.mark.parametrize("expr, first", [
    ("0 0 3 * * MON", datetime(2026, 12, 7, 3)),
    ("0 0 0 29 2 *", datetime(2028, 2, 29)),                   # rare, but it fires: accepted
    ("0 0 0 30 2 MON", datetime(2027, 2, 1)),                  # day-of-month OR day-of-week (robfig)
    ("0 0 0 30 * MON", datetime(2026, 12, 7)),
    ("0 0 0 30 * *", datetime(2026, 12, 30)),
    ("0/20 30 9 * * *", datetime(2026, 12, 1, 9, 30, 20)),     # "N/step" means N-max/step
    ("0 30 9 1 12 *", datetime(2027, 12, 1, 9, 30)),           # strictly after now
])
def test_next_fire_follows_robfig(expr, first):
    assert validate_cron(expr, NOW) == expr
    assert next_fire(expr, NOW) == first.replace(tzinfo=timezone.utc)


@pytest.mark.parametrize("expr", ["@every 0h", "@every 0s", "@every 500ms", "@every 1.5s", "@every 1h0.5s"])
def test_every_under_a_second_or_fractional_is_refused(expr):
    # robfig/cron would silently run these every second (or drop the fraction).
    with pytest.raises(ScheduleError, match="whole number of seconds"):
        validate_cron(expr)


@pytest.mark.parametrize("line", ["0 3 * * 1", "61 * * * *", "0 25 * * *", "0 0 30 2 *", "*/5 * * * *",
                                  "0 0 * * 7"])
def test_a_five_field_hint_is_only_a_schedule_that_validates(line):
    with pytest.raises(ScheduleError, match="has 5 fields") as e:
        validate_cron(line, NOW)
    suggested = re.search(r"did you mean '([^']*)'\?", str(e.value))
    if suggested:
        assert validate_cron(suggested.group(1), NOW) == suggested.group(1)
    else:
        assert "as a crontab line it is invalid too" in str(e.value)


def test_an_invalid_crontab_line_says_why_instead_of_suggesting():
    with pytest.raises(ScheduleError) as e:
        validate_cron("61 * * * *")
    assert "did you mean" not in str(e.value) and "minute: 61 is outside 0-59" in str(e.value)


@pytest.mark.parametrize("text, seconds", [("90", 90), ("90s", 90), ("15m", 900), ("6h", 21600), ("7d", 604800),
                                           ("1w", 604800)])
def test_interval(text, seconds):
    assert parse_interval(text) == seconds


@pytest.mark.parametrize("text", ["0", "0d", "-1h", "1.5h", "7 days", "d", ""])
def test_bad_interval(text):
    with pytest.raises(ScheduleError):
        parse_interval(text)


def test_times_default_to_utc():
    assert parse_time("2026-01-05T03:00:00Z") == datetime(2026, 1, 5, 3, tzinfo=timezone.utc)
    assert parse_time("2026-01-05") == datetime(2026, 1, 5, tzinfo=timezone.utc)
    assert parse_time("2026-01-05T03:00:00+02:00").utcoffset().total_seconds() == 7200
    with pytest.raises(ScheduleError, match="not an ISO 8601 time"):
        parse_time("next monday")
