"""The event schema (``trainer.events.Event``): emits are checked against it, every reader and emitter of the
project names events through it, and docs/training.md lists exactly its events and fields."""

import ast
import re
from pathlib import Path

import pytest

from trainer.events import Event, EventLog, read_events

ROOT = Path(__file__).resolve().parent.parent
# Strings equal to an event's name that name something else: the registry's baseline named after the setting.
NOT_EVENTS = {("components/train/settings.py", "init_from"), ("components/stage/model.py", "init_from"),
              ("components/train/parameters.py", "init_from")}


def test_an_emit_is_written_as_before_and_read_back_equal_to_its_definition(tmp_path):
    log = EventLog(tmp_path / "events.jsonl", rank=3)
    log.emit(Event.CKPT_COMMITTED, step=7, commit_s=0.5)
    log.emit(Event.RESTART, layer="job")
    log.close()
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    assert '"rank": 3, "event": "ckpt_committed", "step": 7, "commit_s": 0.5}' in lines[0]
    events = read_events(tmp_path / "events.jsonl")
    assert [e["event"] for e in events] == [Event.CKPT_COMMITTED, Event.RESTART]
    assert events[1]["event"] in {Event.RESTART} and type(events[1]["event"]) is str


@pytest.mark.parametrize("event, fields, message", [
    (Event.CKPT_COMMITTED, {"step": 7}, r"'ckpt_committed': missing field\(s\) \['commit_s'\]"),
    (Event.CKPT_COMMITTED, {"step": 7, "commit_s": 0.5, "comit_s": 0.5}, r"unknown field\(s\) \['comit_s'\]"),
    (Event.STEP, {"step": 1}, r"missing field\(s\) \['loss', 'lr', 'step_s', 'tokens', 'tokens_per_s'\]"),
    ("ckpt_committed", {"step": 7, "commit_s": 0.5}, r"takes an Event .* not 'ckpt_committed'"),
    ("ckpt_comitted", {"step": 7, "commit_s": 0.5}, r"takes an Event"),
])
def test_an_emit_that_does_not_match_the_schema_raises_and_writes_nothing(tmp_path, event, fields, message):
    log = EventLog(tmp_path / "events.jsonl", rank=0)
    with pytest.raises(TypeError, match=message):
        log.emit(event, **fields)
    assert read_events(tmp_path / "events.jsonl") == []


def test_optional_fields_may_be_given_or_left_out(tmp_path):
    log = EventLog(tmp_path / "events.jsonl", rank=0)
    log.emit(Event.RESTART, layer="injob", restart_count=0, membership_change=True)
    log.emit(Event.RESTART, layer="inprocess", iteration=2)
    assert [e["layer"] for e in read_events(tmp_path / "events.jsonl")] == ["injob", "inprocess"]


def _is_event_field(node: ast.AST) -> bool:
    """``x["event"]`` or ``x.get("event")``."""
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value == "event"
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
            and bool(node.args) and isinstance(node.args[0], ast.Constant) and node.args[0].value == "event")


def _strings(node: ast.AST) -> list[ast.Constant]:
    return [c for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str)]


def bare_event_names(source: str, rel: str) -> list[str]:
    """Where ``source`` names an event by a string rather than by its ``Event``: the event of an ``emit``, a
    string compared with (or prefix-matched against) a line's ``event``, and an event's name anywhere else but
    as a key (``x["init_from"]``; only names with an underscore: ``step``, ``exit`` and such are field names
    and words too)."""
    tree = ast.parse(source)
    flagged: dict[int, tuple[ast.Constant, str]] = {}
    keys = set()

    def flag(node: ast.AST, how) -> None:
        for c in _strings(node):
            flagged.setdefault(id(c), (c, how(c.value)))

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "emit":
            for a in node.args[:1]:
                flag(a, lambda v: f"emit({v!r})")
        elif isinstance(node, ast.Compare) and any(_is_event_field(o) for o in [node.left, *node.comparators]):
            for o in [node.left, *node.comparators]:
                if not _is_event_field(o):
                    flag(o, lambda v: f"compared with {v!r}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _is_event_field(node.func.value)
              and node.func.attr in ("startswith", "endswith")):
            for a in node.args:
                flag(a, lambda v, how=node.func.attr: f"{how}({v!r})")
        elif isinstance(node, ast.Subscript):
            keys.add(id(node.slice))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            keys.update(id(a) for a in node.args[:1])
    names = {e.value for e in Event if "_" in e.value} - {name for path, name in NOT_EVENTS if path == rel}
    for c in _strings(tree):
        if c.value in names and id(c) not in keys:
            flagged.setdefault(id(c), (c, repr(c.value)))
    ordered = sorted(flagged.values(), key=lambda f: (f[0].lineno, f[0].col_offset))
    return [f"{rel}:{c.lineno}: {how}" for c, how in ordered]


def project_sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for p in sorted(ROOT.rglob("*.py"))
            if p.relative_to(ROOT).parts[0] not in ("tests", ".git") and p != ROOT / "trainer" / "events.py"}


def test_no_event_is_named_by_a_bare_string_outside_the_schema():
    found = [f for rel, source in project_sources().items() for f in bare_event_names(source, rel)]
    assert not found, "name these events by trainer.events.Event:\n" + "\n".join(found)


def test_the_scan_finds_each_kind_of_bare_name():
    source = '''
log.emit("ckpt_committed", step=1, commit_s=0.1)
log.emit("resumed" if x else "fresh_start", step=1, source="peer")
steps = [e for e in events if e["event"] == "step"]
blocks = [e for e in events if e.get("event") in ("ckpt_snapshot", "memory_snapshot")]
mirror = any(e["event"].startswith("mirror_") for e in events)
KINDS = ("checksum_mismatch", "peer_refused")
fine = [e["step"] for e in events if e["event"] == Event.STEP and e.get("init_from")]
'''
    assert [f.split(": ", 1)[1] for f in bare_event_names(source, "x.py")] == [
        "emit('ckpt_committed')", "emit('resumed')", "emit('fresh_start')", "compared with 'step'",
        "compared with 'ckpt_snapshot'", "compared with 'memory_snapshot'", "startswith('mirror_')",
        "'checksum_mismatch'", "'peer_refused'"]


def documented_events() -> dict[str, tuple[set[str], set[str]]]:
    """The table of docs/training.md's section on the event log: name -> (fields, optional fields)."""
    docs = (ROOT / "docs" / "training.md").read_text()
    section = docs.split("### The event log (`events.jsonl`)\n", 1)[1].split("\n#", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \|([^|]*)\|", section, re.M)
    table = {}
    for name, cell in rows:
        fields = [f.strip() for f in cell.split(",") if f.strip()]
        table[name] = ({f.strip("`") for f in fields if not f.startswith("[")},
                       {f.strip("[]`") for f in fields if f.startswith("[")})
    return table


def test_the_docs_list_every_event_with_its_fields_and_no_other():
    schema = {e.value: (set(e.fields), set(e.optional)) for e in Event}
    documented = documented_events()
    assert documented.keys() == schema.keys(), (
        f"not in docs/training.md: {sorted(schema.keys() - documented.keys())}; "
        f"not events: {sorted(documented.keys() - schema.keys())}")
    assert {n: f for n, f in documented.items() if f != schema[n]} == {}, "fields differ from trainer.events.Event"


def test_every_emit_in_the_project_gives_its_event_s_fields():
    """Checked where it is written, so that an emit on a rare path (a spot notice, a hung helper) cannot fail the
    run the first time it happens."""
    wrong = []
    for rel, source in project_sources().items():
        for node in ast.walk(ast.parse(source)):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "emit"):
                continue
            events = [a.attr for a in ast.walk(node.args[0]) if isinstance(a, ast.Attribute)
                      and isinstance(a.value, ast.Name) and a.value.id == "Event"]
            given = {k.arg for k in node.keywords if k.arg is not None}
            spread = any(k.arg is None for k in node.keywords)    # **fields: checked when emitted
            for event in (Event[name] for name in events):
                missing = set() if spread else event.fields - given
                unknown = given - event.fields - event.optional
                if missing or unknown:
                    wrong.append(f"{rel}:{node.lineno}: {event.value}: missing {sorted(missing)}, "
                                 f"unknown {sorted(unknown)}")
    assert not wrong, "\n".join(wrong)
