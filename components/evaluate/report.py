"""``report.html``: a run's story, from the files of its run directory and its evaluation.

    from components.evaluate.report import render_report
    html = render_report(evaluation.to_dict(), Path("fsx/runs/demo"))

What the page shows, top to bottom: the outcome (promoted or not, and why) with the headline figures
(tokens/s and MFU with the device mesh they were measured on among them);
a timeline of step rate over wall time with faults, restarts (and the layer that recovered), recovery
gaps and checkpoint stalls marked; where the wall time went (the goodput breakdown as one bar); the
checkpoints with their blocking and write times, losses, and skip reasons as one line each; the loss
curve; faults and how each was recovered; a readable summary of ``summary.json``. The page is one
self-contained HTML file with inline SVG and CSS, no script and no network access, so the KFP UI (which
renders HTML artifacts in a sandboxed frame) and a browser from a file both show it as is.

Inputs are the contracts of the run directory: ``events.jsonl`` (``trainer.events``), ``summary.json``
(``trainer.summary``), and the evaluation result dict (``components.evaluate.evaluate.EvaluationResult.to_dict``).
Any of them may be missing or partial (a run that is still going, or failed); the page says so in a line.
"""

from __future__ import annotations

import html
import json
import math
from datetime import datetime, timezone
from pathlib import Path

from trainer.events import Event, read_events
from trainer.layout import events_path, summary_path
from trainer.mesh import MeshShape

_E = html.escape
# One colour per meaning, used by the plots and their legends alike.
COLORS = {
    "rate": "#1f6fb2", "redone": "#9aa5b1", "fault": "#d1382f", "recovery": "#f6d5d2", "stall": "#f0a030",
    "memory": "#f7d9a3", "commit": "#2e8b57", "signal": "#6b4fa0", "val": "#d1382f", "train": "#1f6fb2",
}
LAYERS = {"inprocess": "in-process restart (NVRx Wrapper)", "injob": "in-job restart (ft_launcher)",
          "job": "job restart (new pods)"}
SHORT = {"inprocess": "in-process", "injob": "in-job", "job": "job"}
BREAKDOWN = (  # goodput_breakdown key, label, colour
    ("productive_s", "productive steps", "#2e8b57"), ("ckpt_block_s", "checkpoint stalls", "#f0a030"),
    ("restart_s", "recovery", "#d1382f"), ("redone_s", "redone steps", "#9aa5b1"),
    ("startup_s", "startup", "#6c8ebf"), ("other_s", "other", "#d5dbe1"))
_MAX_POINTS = 600     # per plotted line: a 100k-step run still renders in a blink


# ------------------------------------------------------------------------------------------- formatting
def fmt_s(s: float | None) -> str:
    """Seconds for people: 0.041 s, 3.8 s, 2 min 05 s, 3 h 07 min."""
    if s is None or not isinstance(s, (int, float)) or not math.isfinite(s):
        return "-"
    if abs(s) < 1:
        return f"{s:.3f} s"
    if abs(s) < 60:
        return f"{s:.1f} s"
    if abs(s) < 3600:
        return f"{int(s // 60)} min {int(s % 60):02d} s"
    return f"{int(s // 3600)} h {int(s % 3600 // 60):02d} min"


def fmt_num(v) -> str:
    """A value for people: integers with separators, floats to 4 significant digits, no JSON."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 1e5 else f"{v:.4g}"
    if isinstance(v, dict):
        return ", ".join(f"{k.replace('_', ' ')} {fmt_num(x)}" for k, x in v.items()) or "-"
    if isinstance(v, (list, tuple)):
        return ", ".join(fmt_num(x) for x in v) or "none"
    return str(v)


def one_line(text) -> str:
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return " ".join(lines) if lines else ""


def _nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _tick_label(v: float) -> str:
    # Every digit a nice tick has ("12.5", "0.25"), none of the float noise of first + i * step.
    return f"{v:.6g}"


class _Plot:
    """An SVG plot area: data -> pixels, axes with ticks and labels. Coordinates are in viewBox units, the
    SVG scales to the page width."""

    def __init__(self, width: int, height: int, x: tuple[float, float], y: tuple[float, float],
                 xlabel: str, ylabel: str, pad=(58, 18, 34, 42)):
        self.w, self.h, (self.l, self.r, self.t, self.b) = width, height, pad
        self.x0, self.x1 = x[0], (x[1] if x[1] > x[0] else x[0] + 1)
        self.y0, self.y1 = y[0], (y[1] if y[1] > y[0] else y[0] + 1)
        self.xlabel, self.ylabel = xlabel, ylabel
        self.parts: list[str] = []

    def px(self, x: float) -> float:
        return self.l + (x - self.x0) / (self.x1 - self.x0) * (self.w - self.l - self.r)

    def py(self, y: float) -> float:
        return self.t + (self.y1 - y) / (self.y1 - self.y0) * (self.h - self.t - self.b)

    def add(self, svg: str) -> None:
        self.parts.append(svg)

    def svg(self, title: str) -> str:
        bottom, right = self.h - self.b, self.w - self.r
        axes = [f'<rect x="{self.l}" y="{self.t}" width="{right - self.l}" height="{bottom - self.t}" '
                f'fill="#fbfcfd" stroke="#e3e7ec"/>']
        for v in _nice_ticks(self.y0, self.y1):
            y = self.py(v)
            axes.append(f'<line x1="{self.l}" y1="{y:.1f}" x2="{right}" y2="{y:.1f}" stroke="#e9edf1"/>'
                        f'<text x="{self.l - 6}" y="{y + 4:.1f}" text-anchor="end">{_tick_label(v)}</text>')
        for v in _nice_ticks(self.x0, self.x1, 8):
            x = self.px(v)
            axes.append(f'<line x1="{x:.1f}" y1="{bottom}" x2="{x:.1f}" y2="{bottom + 4}" stroke="#8a96a3"/>'
                        f'<text x="{x:.1f}" y="{bottom + 17}" text-anchor="middle">{_tick_label(v)}</text>')
        axes.append(f'<text x="{(self.l + right) / 2:.0f}" y="{self.h - 6}" text-anchor="middle" '
                    f'class="axis-label">{_E(self.xlabel)}</text>'
                    f'<text x="{self.l}" y="{self.t - 10}" class="axis-label">{_E(self.ylabel)}</text>')
        return (f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {self.w} {self.h}" role="img" '
                f'aria-label="{_E(title)}" class="plot"><title>{_E(title)}</title>'
                + "".join(axes) + "".join(self.parts) + "</svg>")


def _polyline(points: list[tuple[float, float]], color: str, width: float = 1.8, title: str = "") -> str:
    path = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
    tip = f"<title>{_E(title)}</title>" if title else ""
    return (f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="{width}" '
            f'stroke-linejoin="round">{tip}</polyline>')


def _thin(points: list, limit: int = _MAX_POINTS) -> list:
    stride = max(1, math.ceil(len(points) / limit))
    return points[::stride] if stride > 1 else points


# ----------------------------------------------------------------------------------------------- story
def _attempts(events: list[dict]) -> list[list[dict]]:
    """Rank 0's step events, split where the processes started again (a restart of any layer)."""
    attempts: list[list[dict]] = [[]]
    for e in events:
        if e.get("event") in (Event.RUN_START, Event.RESTART) and attempts[-1]:
            attempts.append([])
        elif e.get("event") == Event.STEP and e.get("rank", 0) == 0 and isinstance(e.get("step_s"), (int, float)):
            attempts[-1].append(e)
    return [a for a in attempts if a]


def _rate_intervals(attempt: list[dict], kept: dict, t0: float, min_s: float) -> list[tuple]:
    """(start s, end s, steps per second, kept?, first step, last step) over one attempt: consecutive
    steps merged until an interval spans ``min_s`` of wall time, never a kept step with a redone one.
    Wall time, not step time: what the loop spent between steps (a checkpoint stall) lowers the rate."""
    out: list[list] = []
    prev = attempt[0]["t"] - attempt[0]["step_s"]
    for s in attempt:
        is_kept = kept[s["step"]] is s
        if not out or out[-1][3] != is_kept or out[-1][1] - out[-1][0] >= min_s:
            out.append([prev, s["t"], 0, is_kept, s["step"], s["step"]])
        cur = out[-1]
        cur[1], cur[2], cur[5] = s["t"], cur[2] + 1, s["step"]
        prev = s["t"]
    return [(a - t0, b - t0, n / (b - a) if b > a else 0.0, k, first, last) for a, b, n, k, first, last in out]


def timeline_svg(events: list[dict], t0: float, width: int = 960, height: int = 330) -> str:
    """Step rate (steps per second of wall time, so stalls show as dips) against seconds since the run
    started; faults, restarts by layer, recovery gaps, checkpoint stalls and commits marked."""
    attempts = _attempts(events)
    if not attempts:
        return '<p class="note">No training steps recorded in events.jsonl yet: nothing to plot.</p>'
    kept = {}
    for a in attempts:
        for s in a:
            kept[s["step"]] = s
    t_end = max(e["t"] for e in events) - t0
    lines = [_rate_intervals(a, kept, t0, t_end / 250) for a in attempts]
    rates = sorted(r for line in lines for _, _, r, _, _, _ in line)
    # The 98th percentile as the top: one near-instant step must not flatten the rest of the plot.
    top = rates[min(len(rates) - 1, int(len(rates) * 0.98))] * 1.25 if rates else 1.0
    p = _Plot(width, height, (0.0, t_end), (0.0, top), "wall time since the run started (s)", "steps per second")
    bottom = height - p.b

    faults = [e for e in events if e.get("event") == Event.FAULT_INJECTED]
    restarts = [e for e in events if e.get("event") == Event.RESTART]
    steps_after = sorted(s["t"] for a in attempts for s in a)
    # Recovery: from each fault to the first step completed after the restart that followed it.
    for f in faults:
        r = next((r for r in restarts if r["t"] >= f["t"]), None)
        back = next((t for t in steps_after if r is not None and t > r["t"]), None)
        if back is not None:
            x0, x1 = p.px(f["t"] - t0), p.px(back - t0)
            p.add(f'<rect x="{x0:.1f}" y="{p.t}" width="{max(1.0, x1 - x0):.1f}" height="{bottom - p.t}" '
                  f'fill="{COLORS["recovery"]}" opacity="0.8"><title>recovery after {_E(f.get("fault", "fault"))}: '
                  f'{fmt_s(back - f["t"])} from the fault to the next step</title></rect>')
    for e in events:
        if e.get("event") in (Event.CKPT_SNAPSHOT, Event.MEMORY_SNAPSHOT) and e.get("rank", 0) == 0:
            block = float(e.get("block_s") or 0.0)
            x1, x0 = p.px(e["t"] - t0), p.px(e["t"] - t0 - block)
            memory = e["event"] == Event.MEMORY_SNAPSHOT
            what = ("memory snapshot" if memory else "final checkpoint (synchronous)" if e.get("sync")
                    else "checkpoint")
            wait = f", {fmt_s(e['wait_s'])} of it waiting for the previous write" if e.get("wait_s") else ""
            p.add(f'<rect x="{x0:.1f}" y="{p.t}" width="{max(1.5, x1 - x0):.1f}" height="{bottom - p.t}" '
                  f'fill="{COLORS["memory" if memory else "stall"]}" opacity="0.55"><title>{what} of step '
                  f'{e.get("step")}: training blocked {fmt_s(block)}{wait}</title></rect>')
            label = f'{"final save" if e.get("sync") else "save"} {e.get("step")}: {fmt_s(block)}'
            if x1 - x0 > 7.5 * len(label):       # a stall this long gets a label inside it, not only a tooltip
                p.add(f'<text x="{(x0 + x1) / 2:.1f}" y="{bottom - 40}" text-anchor="middle" class="stall">'
                      f'{_E(label)}</text>')
    for line in lines:
        start = 0
        for i in range(1, len(line) + 1):
            if i < len(line) and line[i][3] == line[start][3]:
                continue
            seg = line[start:i]
            is_kept = seg[0][3]
            # Each interval is drawn flat at its rate: a stall is a low step as long as the stall.
            pts = [(p.px(x), p.py(min(r, top))) for a, b, r, _, _, _ in seg for x in (a, b)]
            label = "steps kept" if is_kept else "steps redone later (after a restart)"
            p.add(_polyline(pts, COLORS["rate"] if is_kept else COLORS["redone"],
                            title=f"{label}: steps {seg[0][4]}-{seg[-1][5]}"))
            start = i
    for e in events:
        if e.get("event") == Event.CKPT_COMMITTED and e.get("rank", 0) == 0:
            x = p.px(e["t"] - t0)
            p.add(f'<path d="M{x:.1f},{bottom - 11} l-5,10 h10 z" fill="{COLORS["commit"]}"><title>checkpoint of '
                  f'step {e.get("step")} committed (write took {fmt_s(e.get("commit_s"))})</title></path>')
    marks = [(f["t"], COLORS["fault"], f"✕ {f.get('fault') or f.get('kind')}",
              f"fault injected: {f.get('kind')} at step {f.get('step')} on rank {f.get('rank')}", "") for f in faults]
    marks += [(r["t"], COLORS["signal"], f"↻ {SHORT.get(r.get('layer'), r.get('layer', '?'))} restart",
               LAYERS.get(r.get("layer"), "restart"), "4 3") for r in restarts]
    marks += [(e["t"], COLORS["signal"], e["event"].replace("_", " "),
               f"{e['event'].replace('_', ' ')} at step {e.get('step', '?')}", "2 3")
              for e in events if e.get("event") in (Event.SIGTERM, Event.SPOT_NOTICE) and e.get("rank", 0) == 0]
    for i, (t, color, label, tip, dash) in enumerate(sorted(marks)):
        x = p.px(t - t0)
        y = p.t + 13 + 13 * (i % 3)          # staggered, so labels of marks close together stay readable
        anchor = "end" if x > width - 120 else "start"
        dx = -4 if anchor == "end" else 4
        p.add(f'<g><title>{_E(tip)} at {fmt_s(t - t0)}</title>'
              f'<line x1="{x:.1f}" y1="{p.t}" x2="{x:.1f}" y2="{bottom}" stroke="{color}" stroke-width="1.6"'
              + (f' stroke-dasharray="{dash}"' if dash else "") + '/>'
              f'<text x="{x + dx:.1f}" y="{y}" fill="{color}" text-anchor="{anchor}" class="mark">{_E(label)}'
              f'</text></g>')
    return p.svg("step rate over wall time")


def timeline_legend() -> str:
    items = [("line", COLORS["rate"], "step rate (steps kept)"), ("line", COLORS["redone"], "steps redone later"),
             ("box", COLORS["stall"], "checkpoint stall (training blocked)"), ("box", COLORS["memory"],
             "memory snapshot"), ("box", COLORS["recovery"], "recovery: fault → next step"),
             ("vline", COLORS["fault"], "fault"), ("dash", COLORS["signal"], "restart (layer)"),
             ("tri", COLORS["commit"], "checkpoint committed")]
    return '<div class="legend">' + "".join(
        f'<span><i class="key {kind}" style="--c:{color}"></i>{_E(text)}</span>' for kind, color, text in items) \
        + "</div>"


def breakdown_bar(summary: dict) -> str:
    b = summary.get("goodput_breakdown") or {}
    wall = b.get("wall_s") or summary.get("wall_s")
    if not b or not wall:
        return '<p class="note">No goodput breakdown in summary.json (the run has not finished).</p>'
    parts = [(key, label, color, max(0.0, float(b.get(key) or 0.0))) for key, label, color in BREAKDOWN]
    total = sum(v for *_, v in parts) or 1.0
    x, rects, legend = 0.0, [], []
    for key, label, color, v in parts:
        w = 1000 * v / total
        # The kept steps' share is the run's goodput: the summary's figure, not a second rounding of it.
        share = summary["goodput"] if key == "productive_s" and "goodput" in summary else v / wall
        if w > 0:
            rects.append(f'<rect x="{x:.1f}" y="0" width="{w:.1f}" height="36" fill="{color}"><title>{label}: '
                         f'{fmt_s(v)} ({share:.1%} of the wall time)</title></rect>')
            if w > 60:
                rects.append(f'<text x="{x + w / 2:.1f}" y="23" text-anchor="middle" class="bar-label">'
                             f'{share:.0%}</text>')
        x += w
        legend.append(f'<span><i class="key box" style="--c:{color}"></i>{label} <b>{fmt_s(v)}</b> '
                      f'<small>{share:.1%}</small></span>')
    return (f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 1000 36" preserveAspectRatio="none" '
            f'class="bar" role="img" aria-label="where the wall time went"><title>where the wall time went'
            f'</title>{"".join(rects)}</svg><div class="legend">{"".join(legend)}</div>')


def loss_svg(train: list[tuple[int, float]], val: list[tuple[int, float]], best_step: int | None,
             width: int = 960, height: int = 300) -> str:
    """Training loss against step (a line) and the checkpoints' validation losses (points, best ringed)."""
    points = train + val
    if not points:
        return '<p class="note">No losses recorded yet: nothing to plot.</p>'
    ys = [v for _, v in points]
    pad = (max(ys) - min(ys)) * 0.06 or 0.01
    p = _Plot(width, height, (min(s for s, _ in points), max(s for s, _ in points)),
              (min(ys) - pad, max(ys) + pad), "step", "loss (nats per byte)")
    if train:
        p.add(_polyline([(p.px(s), p.py(v)) for s, v in _thin(train)], COLORS["train"], title="training loss"))
    for s, v in val:
        x, y = p.px(s), p.py(v)
        p.add(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="5" fill="{COLORS["val"]}"><title>step {s}: validation '
              f'loss {v:.4f}</title></circle>')
        if s == best_step:
            p.add(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="10" fill="none" stroke="{COLORS["val"]}" '
                  f'stroke-width="2"><title>best checkpoint: step {s}</title></circle>')
    return p.svg("loss against step")


TASK_COLORS = ("#1f6fb2", "#d1382f", "#2e8b57", "#f0a030", "#6b4fa0", "#9aa5b1")


def task_metrics(evaluation: dict) -> dict[str, list[str]]:
    """task -> its metrics, over the evaluated checkpoints (``components.evaluate.tasks``), in a stable order."""
    out: dict[str, list[str]] = {}
    for c in evaluation.get("checkpoints") or []:
        for task, values in sorted((c.get("tasks") or {}).items()):
            out.setdefault(task, [])
            out[task] += [m for m in sorted(values) if m not in out[task]]
    return out


def tasks_table(evaluation: dict) -> str:
    """One row per evaluated checkpoint, one column per task metric; the best checkpoint's row highlighted."""
    metrics = task_metrics(evaluation)
    best = (evaluation.get("best") or {}).get("step")
    promote_on = (evaluation.get("gate") or {}).get("promote_on") or ""
    head = "".join(f'<th{" class=promote" if promote_on == f"task:{t}/{m}" else ""}>{_E(t)}<br><small>{_E(m)}'
                   f'</small></th>' for t, ms in metrics.items() for m in ms)
    rows = []
    for c in evaluation.get("checkpoints") or []:
        cells = "".join(f'<td>{_loss((c.get("tasks") or {}).get(t), m)}</td>' for t, ms in metrics.items() for m in ms)
        rows.append(f'<tr{" class=best" if c["step"] == best else ""}><td>{c["step"]:,}</td>{cells}'
                    f'<td>{fmt_s(c.get("tasks_s"))}</td></tr>')
    return (f'<table><thead><tr><th>step</th>{head}<th>harness took</th></tr></thead><tbody>{"".join(rows)}'
            f'</tbody></table>')


def task_svg(evaluation: dict, task: str, metrics: list[str], width: int = 960, height: int = 240) -> str:
    """A task's metrics against step: one line (with points) per metric."""
    series = {m: [(c["step"], c["tasks"][task][m]) for c in evaluation.get("checkpoints") or []
                  if isinstance(((c.get("tasks") or {}).get(task) or {}).get(m), (int, float))] for m in metrics}
    points = [p for line in series.values() for p in line]
    if not points:
        return f'<p class="note">No scores of {_E(task)} recorded.</p>'
    ys = [v for _, v in points]
    pad = (max(ys) - min(ys)) * 0.06 or 0.01
    p = _Plot(width, height, (min(s for s, _ in points), max(s for s, _ in points)),
              (min(ys) - pad, max(ys) + pad), "step", task)
    for i, (metric, line) in enumerate(series.items()):
        color = TASK_COLORS[i % len(TASK_COLORS)]
        if len(line) > 1:
            p.add(_polyline([(p.px(s), p.py(v)) for s, v in line], color, title=f"{task} {metric}"))
        for s, v in line:
            p.add(f'<circle cx="{p.px(s):.1f}" cy="{p.py(v):.1f}" r="4" fill="{color}"><title>step {s}: {_E(task)} '
                  f'{_E(metric)} {v:.4f}</title></circle>')
    legend = "".join(f'<span><i class="key line" style="--c:{TASK_COLORS[i % len(TASK_COLORS)]}"></i>{_E(m)}</span>'
                     for i, m in enumerate(series))
    return p.svg(f"{task} against step") + f'<div class="legend">{legend}</div>'


def tasks_section(evaluation: dict) -> str:
    """The benchmark tasks (lm-evaluation-harness) of each checkpoint: a table, and a plot per task; empty
    when no task was evaluated."""
    metrics = task_metrics(evaluation)
    if not metrics:
        return ""
    plots = "".join(f"<h3>{_E(task)}</h3>{task_svg(evaluation, task, ms)}" for task, ms in metrics.items())
    return (f'<section><h2>Benchmark tasks <small>lm-evaluation-harness, higher is better except perplexity'
            f'</small></h2>{tasks_table(evaluation)}{plots}</section>')


def train_curve(events: list[dict]) -> list[tuple[int, float]]:
    """The training loss of each step as kept (a step redone after a restart counts once, its last run)."""
    curve = {e["step"]: e["loss"] for e in events if e.get("event") == Event.STEP and e.get("rank", 0) == 0
             and isinstance(e.get("loss"), (int, float)) and math.isfinite(e["loss"])}
    return sorted(curve.items())


# ---------------------------------------------------------------------------------------------- tables
def _loss(entry: dict | None, key: str) -> str:
    return f"{entry[key]:.4f}" if entry and isinstance(entry.get(key), (int, float)) else "-"


def checkpoints_table(evaluation: dict, events: list[dict], t0: float | None) -> str:
    scored = {c["step"]: c for c in evaluation.get("checkpoints") or []}
    skipped = {s["step"]: s for s in evaluation.get("skipped") or []}
    best = (evaluation.get("best") or {}).get("step")
    snap = {e["step"]: e for e in events if e.get("event") == Event.CKPT_SNAPSHOT and e.get("rank", 0) == 0}
    committed = {e["step"]: e for e in events if e.get("event") == Event.CKPT_COMMITTED and e.get("rank", 0) == 0}
    steps = sorted(set(scored) | set(skipped) | set(committed))
    if not steps:
        return '<p class="note">No checkpoint was committed.</p>'
    rows = []
    for step in steps:
        c, s, sn, cm = scored.get(step), skipped.get(step), snap.get(step), committed.get(step)
        if s is not None:
            note = f'<span class="bad">skipped: {_E(one_line(s.get("reason", "")))}</span>'
        elif c is not None:
            note = '<span class="good">best</span>' if step == best else "evaluated"
        else:
            note = '<span class="muted">not evaluated (removed by --ckpt-keep, or outside --last)</span>'
        rows.append(
            f'<tr{" class=best" if step == best else ""}><td>{step:,}</td>'
            f'<td>{fmt_s(cm["t"] - t0) if cm and t0 is not None else "-"}</td>'
            f'<td>{fmt_s(sn.get("block_s")) if sn else "-"}{" (sync)" if sn and sn.get("sync") else ""}</td>'
            f'<td>{fmt_s(cm.get("commit_s")) if cm else "-"}</td>'
            f'<td>{_loss(c, "val_loss")}</td><td>{_loss(c, "bpb")}</td>'
            f'<td class="left">{note}</td></tr>')
    return ('<table><thead><tr><th>step</th><th>committed at</th><th>training blocked</th><th>write took</th>'
            '<th>val loss</th><th>bits/byte</th><th class="left"></th></tr></thead><tbody>'
            + "".join(rows) + "</tbody></table>")


def mesh_tag(mesh) -> str:
    """The summary's ``mesh`` as ``RxSxT`` (replicate x shard x tensor-parallel), "-" where it has none."""
    try:
        return MeshShape(**mesh).tag
    except TypeError:
        return "-"


def throughput_line(summary: dict) -> str:
    """What the tokens/s and MFU were measured on: the mesh, and the MFU where the device has a known peak."""
    mfu = summary.get("mfu_p50")
    mfu_text = f"MFU {mfu:.1%}" if isinstance(mfu, (int, float)) else "no MFU (no known device peak)"
    tag = mesh_tag(summary.get("mesh"))
    on = f" on mesh {tag} (replicate x shard x tp)" if tag != "-" else ""
    return f"median step{on}, {mfu_text}"


def _layer(layer: str | None) -> str:
    return "not recovered" if layer is None else LAYERS.get(layer, str(layer))


def faults_table(summary: dict, events: list[dict]) -> str:
    faults = summary.get("faults")
    if faults is None:
        injected = [e for e in events if e.get("event") == Event.FAULT_INJECTED]
        faults = [{"kind": e.get("kind"), "step": e.get("step"), "rank": e.get("rank")} for e in injected]
    if not faults:
        return '<p class="note">No faults: the run went through without a restart.</p>'
    rows = "".join(
        f'<tr><td class="left">{_E(str(f.get("kind")))} at step {f.get("step")} on rank {f.get("rank")}</td>'
        f'<td>{fmt_s(f.get("detected_s"))}</td><td>{fmt_s(f.get("recovered_s"))}</td>'
        f'<td class="left">{_E(_layer(f.get("layer")))}</td></tr>' for f in faults)
    return ('<table><thead><tr><th class="left">fault</th><th>detected after</th><th>training again after</th>'
            '<th class="left">recovered by</th></tr></thead><tbody>' + rows + "</tbody></table>")


_SUMMARY_ROWS = (  # key, label, how to show it
    ("steps", "steps", fmt_num), ("tokens", "tokens", fmt_num), ("n_params", "parameters", fmt_num),
    ("mesh", "device mesh (replicate x shard x tp)", mesh_tag),
    ("tokens_per_s_p50", "tokens per second (median step, on the mesh)", lambda v: f"{v:,.0f}"),
    ("mfu_p50", "model FLOPs utilisation (median step, on the mesh)", lambda v: f"{v:.1%}"),
    ("final_train_loss", "final training loss", lambda v: f"{v:.4f}"),
    ("final_val_loss", "final validation loss", lambda v: f"{v:.4f} nats/byte ({v / math.log(2):.3f} bits/byte)"),
    ("wall_s", "wall time", fmt_s), ("goodput", "goodput", lambda v: f"{v:.1%}"),
    ("checkpoints_committed", "checkpoints committed", fmt_num),
    ("ckpt_block_s_p50", "training blocked per checkpoint (median)", fmt_s),
    ("ckpt_block_s_max", "training blocked per checkpoint (max)", fmt_s),
    ("ckpt_block_s_total", "training blocked by saves in all", fmt_s),
    ("restarts", "restarts", fmt_num),
    ("lost_steps", "steps redone", fmt_num),
    ("params_sha256", "final weights (sha256)", lambda v: f'<code title="{_E(str(v))}">{_E(str(v)[:16])}…</code>'),
)
_SHOWN_ELSEWHERE = {"faults", "goodput_breakdown", "restarts_inprocess", "restarts_injob", "restarts_job"}


def summary_table(summary: dict) -> str:
    if not summary:
        return '<p class="note">summary.json not found: the run has not finished.</p>'
    rows = []
    known = {k for k, *_ in _SUMMARY_ROWS}
    for key, label, show in _SUMMARY_ROWS:
        if key in summary and summary[key] is not None:
            try:
                value = show(summary[key])
            except (TypeError, ValueError):
                value = _E(fmt_num(summary[key]))
            if key == "restarts":
                by = [f"{summary[f'restarts_{k}']} {SHORT[k]}" for k in LAYERS if f"restarts_{k}" in summary]
                value += f" ({', '.join(by)})" if by else ""
            rows.append(f"<tr><th>{_E(label)}</th><td>{value if key == 'params_sha256' else _E(value)}</td></tr>")
    for key, value in summary.items():
        if key in known or key in _SHOWN_ELSEWHERE:
            continue
        text = "off" if key == "mirror" and value is None else fmt_num(value)
        rows.append(f"<tr><th>{_E(key.replace('_', ' '))}</th><td>{_E(text)}</td></tr>")
    return '<table class="kv"><tbody>' + "".join(rows) + "</tbody></table>"


# ------------------------------------------------------------------------------------------------ page
def _cards(evaluation: dict, summary: dict) -> str:
    best = evaluation.get("best") or {}
    faults = summary.get("faults")
    layers = [f.get("layer") for f in faults or []]
    rate = summary.get("tokens_per_s_p50")
    cards = [
        ("goodput", f"{summary['goodput']:.1%}" if isinstance(summary.get("goodput"), (int, float)) else "-",
         "of the wall time went into steps that were kept"),
        ("steps", fmt_num(summary.get("steps")), f"in {fmt_s(summary.get('wall_s'))}"),
        ("faults", fmt_num(len(faults)) if faults is not None else "-",
         ", ".join(f"{layers.count(k)} recovered {SHORT[k]}" for k in LAYERS if k in layers) or "no restarts"),
        ("best val loss", f"{best['val_loss']:.4f}" if best.get("val_loss") is not None else "-",
         f"step {best['step']:,}, {best['bpb']:.3f} bits/byte" if best.get("bpb") is not None else "no checkpoint"),
        ("tokens/s", f"{rate:,.0f}" if isinstance(rate, (int, float)) else "-", throughput_line(summary)),
        ("checkpoint stall", fmt_s(summary.get("ckpt_block_s_p50")),
         f"median, max {fmt_s(summary.get('ckpt_block_s_max'))}"),
    ]
    return '<div class="cards">' + "".join(
        f'<div class="card"><div class="label">{_E(k)}</div><div class="value">{_E(v)}</div>'
        f'<div class="sub">{_E(s)}</div></div>' for k, v, s in cards) + "</div>"


def _gate(evaluation: dict) -> str:
    gate = evaluation.get("gate") or {}
    prod = gate.get("production")
    registered = evaluation.get("registered")
    items = [f"threshold {gate['threshold']:.4f} nats/byte" if isinstance(gate.get("threshold"), (int, float))
             else "", f"tolerance {gate['tolerance']:.4f}" if isinstance(gate.get("tolerance"), (int, float)) else "",
             f"production {prod['version']} at {prod['val_loss']:.4f}" if prod else "no production model yet"]
    if gate.get("promote_on"):
        items.insert(0, f"promoted on {gate['promote_on']}")
    text = f"<p>{_E(one_line(gate.get('reason', 'not decided')))}</p>"
    text += f'<p class="muted">{_E(" · ".join(i for i in items if i))}</p>'
    if registered:
        text += f'<p>registered as <code>{_E(str(registered.get("model_uri", "")))}</code></p>'
    return text


_CSS = """
:root{--fg:#1d2733;--muted:#5f6b7a;--line:#e3e7ec;--bg:#f4f6f8;font-family:system-ui,-apple-system,"Segoe UI",
Roboto,"Helvetica Neue",Arial,sans-serif;color:var(--fg);background:var(--bg)}
body{margin:0}main{max-width:1060px;margin:0 auto;padding:24px 28px 48px}
header{display:flex;align-items:center;gap:14px;flex-wrap:wrap}h1{font-size:22px;margin:0;font-weight:650}
.badge{padding:4px 10px;border-radius:999px;font-size:13px;font-weight:600;letter-spacing:.02em}
.badge.yes{background:#dff3e6;color:#1e6b3f}.badge.no{background:#fbe3e1;color:#9b2a22}
.where{color:var(--muted);font-size:13px;margin:6px 0 18px}.where code{font-size:12px}
section p{font-size:14px;margin:4px 0}
section{background:#fff;border:1px solid var(--line);border-radius:10px;padding:16px 18px;margin:14px 0}
h2{font-size:15px;margin:0 0 10px;font-weight:650}h2 small{font-weight:400;color:var(--muted);margin-left:6px}
h3{font-size:14px;margin:14px 0 4px;font-weight:600}th.promote{color:#1e6b3f}
.cards{display:grid;grid-template-columns:repeat(6,1fr);gap:10px;margin:0 0 4px}
.card{background:#fff;border:1px solid var(--line);border-radius:10px;padding:12px 14px}
.card .label{font-size:12px;color:var(--muted);text-transform:uppercase;letter-spacing:.05em}
.card .value{font-size:24px;font-weight:650;margin:4px 0 2px}.card .sub{font-size:12px;color:var(--muted)}
svg.plot{width:100%;height:auto;display:block;font-size:11px;fill:#44505e}
svg.plot .axis-label{font-size:12px;fill:#5f6b7a}
svg.plot .stall{font-size:12px;fill:#8a5a00;font-weight:600}svg.plot .mark{font-size:11px;font-weight:600}
svg.bar{width:100%;height:36px;display:block;border-radius:6px;overflow:hidden}
.bar-label{font-size:13px;fill:#fff;font-weight:600}
.legend{display:flex;flex-wrap:wrap;gap:6px 18px;font-size:12px;color:var(--muted);margin-top:10px}
.legend b{color:var(--fg);font-weight:600}.legend span{display:inline-flex;align-items:center;gap:6px}
.key{display:inline-block;width:14px;height:10px;background:var(--c)}.key.line{height:3px}
.key.vline{width:2px;height:12px}.key.dash{width:2px;height:12px;background:repeating-linear-gradient(var(--c) 0 3px,
transparent 3px 5px)}.key.tri{width:0;height:0;background:none;border:6px solid transparent;
border-bottom:10px solid var(--c);border-top:0}
table{border-collapse:collapse;width:100%;font-size:13px}th,td{padding:6px 10px;text-align:right;
border-bottom:1px solid var(--line);font-variant-numeric:tabular-nums}thead th{color:var(--muted);font-weight:600}
.left{text-align:left}tr.best td{background:#f0f8f3;font-weight:600}
table.kv{display:grid;grid-template-columns:1fr 1fr;column-gap:28px}table.kv tbody{display:contents}
table.kv tr{display:flex;border-bottom:1px solid var(--line)}table.kv th,table.kv td{border:0;text-align:left}
table.kv th{font-weight:500;color:var(--muted);flex:0 0 50%}
.good{color:#1e6b3f}.bad{color:#9b2a22}.muted,.note{color:var(--muted)}.note{font-size:13px;margin:4px 0}
code{font-family:ui-monospace,SFMono-Regular,Menlo,monospace}
@media (max-width:820px){.cards{grid-template-columns:repeat(2,1fr)}table.kv{grid-template-columns:1fr}}
"""


def _utc(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def render_report(evaluation: dict, run_dir: Path) -> str:
    """The report page of a run: ``evaluation`` is ``EvaluationResult.to_dict()`` (its ``summary`` is the
    run's summary.json; read from ``run_dir`` when absent), ``run_dir`` holds ``events.jsonl``."""
    run_dir = Path(run_dir)
    events = sorted((e for e in read_events(events_path(run_dir)) if isinstance(e.get("t"), (int, float))),
                    key=lambda e: e["t"])
    summary = evaluation.get("summary")
    if summary is None and summary_path(run_dir).is_file():
        try:
            summary = json.loads(summary_path(run_dir).read_text())
        except ValueError:
            summary = None
    summary = summary or {}
    starts = [e["t"] for e in events if e.get("event") == Event.RUN_START]
    t0 = starts[0] if starts else (events[0]["t"] if events else None)
    best = evaluation.get("best") or {}
    promoted = bool(evaluation.get("promoted"))
    name = Path(evaluation.get("run_dir") or run_dir).name
    skipped = evaluation.get("skipped") or []
    skip_lines = "".join(f'<li>step {s.get("step")}: {_E(one_line(s.get("reason", "")))}</li>' for s in skipped)
    data = evaluation.get("data_dir")
    body = f"""
<header><h1>Run {_E(name)}</h1><span class="badge {"yes" if promoted else "no"}">
{"PROMOTED" if promoted else "not promoted"}</span></header>
<p class="where">{f"started {_utc(t0)} · " if t0 is not None else ""}
run <code>{_E(str(evaluation.get("run_dir") or run_dir))}</code>
{f' · validation data <code>{_E(str(data))}</code>' if data else ""}</p>
{_cards(evaluation, summary)}
<section><h2>Promotion</h2>{_gate(evaluation)}</section>
<section><h2>Timeline <small>step rate over wall time; hover a mark for details</small></h2>
{timeline_svg(events, t0) if t0 is not None else '<p class="note">No events.jsonl in the run directory: '
                                                  'nothing to plot.</p>'}
{timeline_legend() if t0 is not None else ""}</section>
<section><h2>Faults and recovery</h2>{faults_table(summary, events)}</section>
<section><h2>Where the wall time went <small>goodput = productive steps / wall time</small></h2>
{breakdown_bar(summary)}</section>
<section><h2>Checkpoints</h2>{checkpoints_table(evaluation, events, t0)}
{f'<ul class="note">{skip_lines}</ul>' if skip_lines else ""}</section>
<section><h2>Loss <small>training loss per step; validation loss of each evaluated checkpoint</small></h2>
{loss_svg(train_curve(events), [(c["step"], c["val_loss"]) for c in evaluation.get("checkpoints") or []],
          best.get("step"))}</section>
{tasks_section(evaluation)}
<section><h2>Summary <small>summary.json</small></h2>{summary_table(summary)}</section>"""
    return (f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width,initial-scale=1">'
            f'<title>Run {_E(name)}: {"promoted" if promoted else "not promoted"}</title><style>{_CSS}</style>'
            f'</head><body><main>{body}\n</main></body></html>\n')
