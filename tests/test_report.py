"""``components.evaluate.report``: report.html tells a real run's story: a 2-rank ``goodput train`` run with a rank
killed
at step 8 (recovered by an in-job restart), evaluated by ``components.evaluate.evaluate``. The plots are read back as
SVG and checked against the run's own files (events.jsonl, summary.json, the evaluation)."""

from __future__ import annotations

import copy
import html
import json
import math
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from components.evaluate.report import fmt_s, render_report
from trainer.events import read_events

SVG = "{http://www.w3.org/2000/svg}"
TINY = ["--n-layer", "2", "--n-embd", "64", "--n-head", "2", "--seq-len", "64", "--batch-size", "8",
        "--eval-windows", "16", "--log-every", "5"]


def real_run(tmp_path_factory) -> tuple[Path, dict]:
    """(run dir, evaluation dict) of one real faulted run, made once per session (the browser test shares it)."""
    root = tmp_path_factory.getbasetemp() / "report-run"
    run, saved = root / "runs" / "faulted", root / "evaluation.json"
    if not saved.is_file():
        from components.evaluate.evaluate import evaluate_run
        from trainer.data import ensure_default_dataset

        data = ensure_default_dataset(root / "fsx")
        cmd = [sys.executable, "-c", "from pipelines.cli import main; main()", "train", "--nproc", "2",
               "--fsx-root", str(root / "fsx"), "--data", str(data), "--out", str(run), "--max-steps", "24",
               "--ckpt-every", "6", "--inject-fault", "kill@8:1", *TINY]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        evaluation = evaluate_run(run, data, root / "evaluation").to_dict()
        saved.write_text(json.dumps(evaluation))
    return run, json.loads(saved.read_text())


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    run, evaluation = real_run(tmp_path_factory)
    summary = evaluation["summary"]
    assert summary["restarts_injob"] == 1 and summary["faults"][0]["layer"] == "injob"   # the story to tell
    return run, evaluation, render_report(evaluation, run)


def svgs(page: str) -> dict[str, ET.Element]:
    """The page's SVG elements by their aria-label."""
    out = {}
    for m in re.finditer(r"<svg\b.*?</svg>", page, re.S):
        el = ET.fromstring(m.group(0))
        out[el.get("aria-label")] = el
    return out


def title(el: ET.Element) -> str:
    t = el.find(f"{SVG}title")
    return t.text if t is not None else ""


def x_axis(plot: ET.Element):
    """Data -> x pixel, from the plot's own tick labels (a least-squares line through them)."""
    ticks = [(float(t.text), float(t.get("x"))) for t in plot.iter(f"{SVG}text")
             if t.get("text-anchor") == "middle" and re.fullmatch(r"[\d.]+", t.text or "")]
    assert len(ticks) >= 3, ticks
    n, sv, sx = len(ticks), sum(v for v, _ in ticks), sum(x for _, x in ticks)
    b = (n * sum(v * x for v, x in ticks) - sv * sx) / (n * sum(v * v for v, _ in ticks) - sv ** 2)
    return lambda v: (sx - b * sv) / n + b * v, b


def visible_text(page: str) -> str:
    page = re.sub(r"<style>.*?</style>|<title>.*?</title>", " ", page, flags=re.S)
    return html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", page)))


def test_the_timeline_marks_fault_restart_recovery_stalls_and_commits_where_they_happened(case):
    run, evaluation, page = case
    events = read_events(run / "events.jsonl")
    t0 = min(e["t"] for e in events if e["event"] == "run_start")
    plot = svgs(page)["step rate over wall time"]
    px, scale = x_axis(plot)
    marks = {title(g): g for g in plot.iter(f"{SVG}g")}

    fault = next(e for e in events if e["event"] == "fault_injected")
    (fault_mark,) = [g for t, g in marks.items() if t.startswith("fault injected: kill at step 8 on rank 1")]
    assert float(fault_mark.find(f"{SVG}line").get("x1")) == pytest.approx(px(fault["t"] - t0), abs=1.0)
    restart = next(e for e in events if e["event"] == "restart")
    (restart_mark,) = [g for t, g in marks.items() if t.startswith("in-job restart (ft_launcher)")]
    assert float(restart_mark.find(f"{SVG}line").get("x1")) == pytest.approx(px(restart["t"] - t0), abs=1.0)
    assert restart_mark.find(f"{SVG}text").text == "↻ in-job restart"

    # A list, not a dict by title: a save redone after the restart (step 6 when its first save had not
    # committed) has the same title as the first, at another place.
    rects = [(title(r), r) for r in plot.iter(f"{SVG}rect") if title(r)]
    # The recovery band says what summary.json says the fault cost.
    recovered = evaluation["summary"]["faults"][0]["recovered_s"]
    (shown,) = [float(m.group(1)) for t, _ in rects if (m := re.fullmatch(
        r"recovery after kill@8:1: ([\d.]+) s from the fault to the next step", t))]
    assert shown == pytest.approx(recovered, abs=0.051)
    snapshots = [e for e in events if e["event"] == "ckpt_snapshot" and e["rank"] == 0]
    assert len(snapshots) >= 4
    for e in snapshots:
        what = "final checkpoint (synchronous)" if e["sync"] else "checkpoint"
        (band,) = [r for t, r in rects if t.startswith(f"{what} of step {e['step']}: training blocked "
                                                       f"{fmt_s(e['block_s'])}") and r.get("x") is not None
                   and float(r.get("x")) == pytest.approx(px(e["t"] - t0 - e["block_s"]), abs=1.0)]
        assert float(band.get("width")) == pytest.approx(max(1.5, scale * e["block_s"]), abs=1.0)
    commits = [p for p in plot.iter(f"{SVG}path") if title(p).startswith("checkpoint of step")]
    assert len(commits) == sum(e["event"] == "ckpt_committed" and e["rank"] == 0 for e in events)


def test_kept_and_redone_steps_are_told_apart(case):
    _, evaluation, page = case
    plot = svgs(page)["step rate over wall time"]
    spans = {"kept": set(), "redone": set()}
    for line in plot.iter(f"{SVG}polyline"):
        m = re.fullmatch(r"steps (kept|redone)\b.*?steps (\d+)-(\d+)", title(line))
        assert m, title(line)
        spans[m.group(1)] |= set(range(int(m.group(2)), int(m.group(3)) + 1))
    assert spans["kept"] == set(range(1, evaluation["summary"]["steps"] + 1))
    # How many steps the kill cost depends on whether the save of step 6 had committed: at least step 7.
    assert len(spans["redone"]) == evaluation["summary"]["lost_steps"] >= 1


def test_the_goodput_bar_is_the_summarys_breakdown(case):
    _, evaluation, page = case
    summary = evaluation["summary"]
    bar = svgs(page)["where the wall time went"]
    parts = {title(r).split(":")[0]: r for r in bar.iter(f"{SVG}rect")}
    b = summary["goodput_breakdown"]
    total = sum(max(0.0, b[k]) for k in ("productive_s", "ckpt_block_s", "restart_s", "redone_s", "startup_s",
                                         "other_s"))
    for label, key in (("productive steps", "productive_s"), ("checkpoint stalls", "ckpt_block_s"),
                       ("recovery", "restart_s"), ("redone steps", "redone_s")):
        assert float(parts[label].get("width")) == pytest.approx(1000 * b[key] / total, abs=0.2)
    assert title(parts["productive steps"]) == (f"productive steps: {fmt_s(b['productive_s'])} "
                                                f"({summary['goodput']:.1%} of the wall time)")


def test_checkpoints_table_and_skip_reasons_in_one_line(case):
    run, evaluation, page = case
    events = read_events(run / "events.jsonl")
    committed = sorted({e["step"] for e in events if e["event"] == "ckpt_committed"})
    table = page[page.index("<h2>Checkpoints</h2>"):page.index("<h2>Loss")]
    assert [int(s.replace(",", "")) for s in re.findall(r"<tr[^>]*><td>([\d,]+)</td>", table)] == committed
    best = evaluation["best"]
    assert re.search(rf"<tr class=best><td>{best['step']}</td>.*?<td>{best['val_loss']:.4f}</td>", table)

    broken = copy.deepcopy(evaluation)
    reason = "cannot be loaded: CheckpointException:\n   rank 1 shard missing\n"
    broken["checkpoints"] = [c for c in broken["checkpoints"] if c["step"] != best["step"]]
    broken["skipped"] = [{"step": best["step"], "path": "x", "reason": reason}]
    page = render_report(broken, run)
    assert f"<li>step {best['step']}: cannot be loaded: CheckpointException: rank 1 shard missing</li>" in page
    assert "skipped: cannot be loaded: CheckpointException: rank 1 shard missing" in page


def test_the_summary_reads_as_text_not_json(case):
    run, evaluation, page = case
    summary, text = evaluation["summary"], visible_text(page)
    # Keys the page has no row for (a run with an S3 mirror, a newer trainer) are written out readably too.
    extended = copy.deepcopy(evaluation)
    extended["summary"].update(mirror={"checkpoints_mirrored": 3, "bytes_mirrored": 123456789,
                                       "lag_s_last": 0.123456789}, data_wait_ratio=0.0123456789)
    more = visible_text(render_report(extended, run))
    assert "mirror checkpoints mirrored 3, bytes mirrored 123,456,789, lag s last 0.1235" in more
    assert "data wait ratio 0.01235" in more
    for shown in (text, more):
        assert "{" not in shown and '":' not in shown and "[" not in shown
        # Rounded: no number with more than 4 significant digits after the point.
        assert not re.search(r"\d\.0*[1-9]\d{4,}", shown), re.findall(r"\S*\d\.0*[1-9]\d{4,}\S*", shown)
    for shown in (f"{summary['tokens']:,}", f"{summary['final_val_loss']:.4f} nats/byte", fmt_s(summary["wall_s"]),
                  f"{summary['goodput']:.1%}", "in-job restart (ft_launcher)", summary["params_sha256"][:16]):
        assert shown in text, shown
    assert ("PROMOTED" if evaluation["promoted"] else "not promoted") in text and evaluation["gate"]["reason"] in text


def cards(page: str) -> dict[str, tuple[str, str]]:
    """The headline cards: label -> (value, the line under it)."""
    return {html.unescape(k): (html.unescape(v), html.unescape(sub)) for k, v, sub in re.findall(
        r'<div class="card"><div class="label">(.*?)</div><div class="value">(.*?)</div>'
        r'<div class="sub">(.*?)</div></div>', page)}


def test_throughput_and_mfu_are_shown_with_the_mesh_they_were_measured_on(case):
    run, evaluation, page = case
    summary = evaluation["summary"]
    assert summary["mesh"] == {"dp_replicate": 1, "dp_shard": 2, "tp": 1}     # 2 ranks: one shard group
    assert cards(page)["tokens/s"] == (f"{summary['tokens_per_s_p50']:,.0f}", "median step on mesh 1x2x1 "
                                       "(replicate x shard x tp), no MFU (no known device peak)")
    # A GPU run on 2 nodes of 8 as HSDP x TP: its MFU, and the mesh in the summary as RxSxT.
    gpu = copy.deepcopy(evaluation)
    gpu["summary"].update(mesh={"dp_replicate": 2, "dp_shard": 2, "tp": 4}, tokens_per_s_p50=123456.7, mfu_p50=0.4321)
    page = render_report(gpu, run)
    assert cards(page)["tokens/s"] == ("123,457", "median step on mesh 2x2x4 (replicate x shard x tp), MFU 43.2%")
    text = visible_text(page)
    for row in ("device mesh (replicate x shard x tp) 2x2x4", "tokens per second (median step, on the mesh) 123,457",
                "model FLOPs utilisation (median step, on the mesh) 43.2%"):
        assert row in text, row


def test_the_page_is_self_contained(case):
    page = case[2]
    assert not re.search(r"<script|<link|<img|<iframe|@import|url\(|src=|href=", page, re.I)
    assert set(re.findall(r"https?://[^\s\"'<>]+", page)) == {"http://www.w3.org/2000/svg"}


def test_missing_or_partial_files_give_one_line_notes(tmp_path, case):
    page = render_report({}, tmp_path)
    text = visible_text(page)
    for note in ("No events.jsonl in the run directory: nothing to plot.", "summary.json not found",
                 "No goodput breakdown in summary.json", "No checkpoint was committed."):
        assert note in text, note
    # A run still going: events so far (the last line torn by a writer mid-line), no summary yet.
    run = case[0]
    lines = (run / "events.jsonl").read_text().splitlines()
    (tmp_path / "events.jsonl").write_text("\n".join(lines[:len(lines) // 2]) + '\n{"t": 1, "rank"')
    page = render_report({"run_dir": str(tmp_path)}, tmp_path)
    assert "step rate over wall time" in svgs(page) and "summary.json not found" in page


def test_a_long_run_is_drawn_with_a_bounded_number_of_points(tmp_path):
    events = [{"t": 1000.0, "rank": 0, "event": "run_start"}]
    for step in range(1, 50001):
        events.append({"t": 1000.0 + step * 0.1, "rank": 0, "event": "step", "step": step,
                       "loss": 5.0 / math.sqrt(step), "step_s": 0.1})
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    plots = svgs(render_report({}, tmp_path))
    for label in ("step rate over wall time", "loss against step"):
        points = sum(len(p.get("points").split()) for p in plots[label].iter(f"{SVG}polyline"))
        assert 100 < points <= 1200, (label, points)


def test_tick_labels_say_the_value_they_stand_at():
    from components.evaluate.report import _nice_ticks, _tick_label

    for lo, hi in ((0, 19), (0, 95), (0.3, 1.6), (0, 0.9), (0, 1234)):
        for v in _nice_ticks(lo, hi, 8):
            assert float(_tick_label(v)) == pytest.approx(v, rel=1e-9), (lo, hi, v)
