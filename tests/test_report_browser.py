"""report.html in a real browser: headless Chromium (Debian's ``chromium``; ``.ci/run`` installs it) loads the
report of a real faulted run without a console message or a network request, lays out its plots inside the
page width, and paints them: the screenshot has the plots' colours inside their boxes."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from PIL import Image

from components.evaluate.report import BREAKDOWN, COLORS, render_report

try:                                  # tests/ is a package when run from the repository root
    from tests.test_report import real_run
except ImportError:                   # pragma: no cover - tests/ on sys.path
    from test_report import real_run

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
WIDTH = 1200
# After load, the page's layout as the browser made it: the plots' boxes in page pixels, errors, requests.
PROBE = """<script>
window.__errors = [];
addEventListener("error", e => __errors.push(String(e.message)));
addEventListener("load", () => {
  const boxes = [...document.querySelectorAll("svg.plot, svg.bar")].map(s => {
    const r = s.getBoundingClientRect();
    return {label: s.getAttribute("aria-label"), x: r.left, y: r.top + scrollY, w: r.width, h: r.height};
  });
  const pre = document.createElement("pre");
  pre.id = "probe";
  pre.textContent = JSON.stringify({boxes, errors: __errors, innerWidth,
    scrollWidth: document.documentElement.scrollWidth, height: document.documentElement.scrollHeight,
    resources: performance.getEntriesByType("resource").length});
  document.body.appendChild(pre);
});
</script>"""


def chromium(tmp_path: Path, page: Path, *args: str) -> subprocess.CompletedProcess:
    assert Path(CHROMIUM).exists(), "headless Chromium is needed: apt-get install -y chromium (as .ci/run does)"
    profile = tmp_path / f"profile-{len(list(tmp_path.glob('profile-*')))}"
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={profile}", "--host-resolver-rules=MAP * ~NOTFOUND",   # nothing may be fetched
           "--enable-logging=stderr", "--v=0", "--hide-scrollbars", "--run-all-compositor-stages-before-draw",
           "--virtual-time-budget=5000", *args, page.as_uri()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def console_messages(stderr: str) -> list[str]:
    """What the page logged or threw: Chromium writes each console message as an INFO:CONSOLE line."""
    return [line for line in stderr.splitlines() if ":CONSOLE" in line or "Uncaught" in line]


def layout(tmp_path: Path, page_html: str) -> dict:
    probed = tmp_path / "probed.html"
    probed.write_text(page_html.replace("<head>", "<head>" + PROBE, 1))
    dom = chromium(tmp_path, probed, f"--window-size={WIDTH},1000", "--dump-dom").stdout
    m = re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S)
    assert m, dom[-2000:]
    return json.loads(m.group(1).replace("&quot;", '"').replace("&amp;", "&"))


def colour_pixels(img: Image.Image, box: dict, colour: str, tolerance: int = 40) -> int:
    """Pixels inside ``box`` within ``tolerance`` (per channel) of ``colour``."""
    want = tuple(int(colour[i:i + 2], 16) for i in (1, 3, 5))
    crop = img.crop((int(box["x"]), int(box["y"]), int(box["x"] + box["w"]), int(box["y"] + box["h"])))
    return sum(n for n, px in crop.getcolors(maxcolors=1 << 20)
               if all(abs(a - b) <= tolerance for a, b in zip(px, want)))


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> str:
    run, evaluation = real_run(tmp_path_factory)
    return render_report(evaluation, run)


def test_the_report_loads_without_errors_or_requests_and_paints_its_plots(tmp_path, report):
    page = tmp_path / "report.html"
    page.write_text(report)
    assert console_messages(chromium(tmp_path, page, "--dump-dom").stderr) == []

    probe = layout(tmp_path, report)
    assert probe["errors"] == [] and probe["resources"] == 0
    assert probe["scrollWidth"] <= probe["innerWidth"] == WIDTH        # nothing sticks out sideways
    boxes = {b["label"]: b for b in probe["boxes"]}
    assert set(boxes) == {"step rate over wall time", "where the wall time went", "loss against step"}
    for b in boxes.values():
        assert b["w"] > 600 and b["h"] >= 30 and b["x"] >= 0 and b["x"] + b["w"] <= WIDTH, b
    assert boxes["step rate over wall time"]["h"] > 250 and boxes["loss against step"]["h"] > 250

    shot = tmp_path / "report.png"
    chromium(tmp_path, page, f"--window-size={WIDTH},{int(probe['height']) + 10}", f"--screenshot={shot}")
    img = Image.open(shot).convert("RGB")
    assert img.size[0] == WIDTH and img.size[1] >= probe["height"]
    timeline, bar, loss = (boxes[k] for k in ("step rate over wall time", "where the wall time went",
                                              "loss against step"))
    # Each plot shows its marks: the step-rate line, the fault, the stall bands; the bar's segments; the
    # training curve and the validation points.
    assert colour_pixels(img, timeline, COLORS["rate"], 30) > 300
    assert colour_pixels(img, timeline, COLORS["fault"], 30) > 40
    assert colour_pixels(img, timeline, "#f5c88a", 25) > 400                   # stall bands (orange at 55%)
    productive, stalls = (next(c for k, _, c in BREAKDOWN if k == key) for key in ("productive_s", "ckpt_block_s"))
    assert colour_pixels(img, bar, productive, 10) > 1500 and colour_pixels(img, bar, stalls, 10) > 1500
    assert colour_pixels(img, loss, COLORS["train"], 30) > 300 and colour_pixels(img, loss, COLORS["val"], 30) > 100


def test_the_checks_catch_a_broken_page(tmp_path):
    # The same checks on a page with a script error, a remote image and an empty plot must fail: a browser
    # check that cannot fail would prove nothing.
    broken = ('<!doctype html><html><head><meta charset="utf-8"></head><body>'
              '<svg class="plot" aria-label="empty" viewBox="0 0 960 300" style="width:100%"></svg>'
              '<img src="http://example.invalid/x.png"><script>not_defined()</script></body></html>')
    page = tmp_path / "broken.html"
    page.write_text(broken)
    logged = console_messages(chromium(tmp_path, page, "--dump-dom").stderr)
    assert any("not_defined is not defined" in m for m in logged)
    probe = layout(tmp_path, broken)
    assert any("not_defined" in e for e in probe["errors"]) and probe["resources"] >= 1
    shot = tmp_path / "broken.png"
    chromium(tmp_path, page, f"--window-size={WIDTH},600", f"--screenshot={shot}")
    assert colour_pixels(Image.open(shot).convert("RGB"), probe["boxes"][0], COLORS["rate"], 30) == 0
