"""Schedule validation: KFP's scheduler (robfig/cron v1) reads 6 fields; five are a silent trap."""

from datetime import datetime, timezone

import pytest

from pipelines.cron import ScheduleError, parse_interval, parse_time, validate_cron


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
    ("@every week", "unknown descriptor"),
    ("@reboot", "unknown descriptor"),
    ("", "empty cron expression"),
])
def test_invalid_cron_says_why(expr, message):
    with pytest.raises(ScheduleError) as e:
        validate_cron(expr)
    assert message in str(e.value)


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
