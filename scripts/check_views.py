"""Check the HTML report in headless Chromium: screenshots at 1280 and 420 px wide, and nothing wider than the page.

Needs Debian's ``chromium`` package. With no argument it renders the quickstart's report (a CPU run of
``examples/quickstart.py``); with one, that HTML file. Headless Chromium's window is at least 500 px wide, so the page
is shown in an iframe of each width; a copy of the page, with a small script added, posts its ``scrollWidth`` and the
elements sticking out past its viewport to the frame's page, which writes them into its ``<title>``, read back with
``--dump-dom``. A table wider than a narrow screen scrolls inside its own box and does not count.

    python scripts/check_views.py                       # quickstart; screenshots in a new temporary folder
    python scripts/check_views.py runs/x/vram_report.html --out docs/images   # the README's pictures, replaced
"""

from __future__ import annotations

import argparse
import html
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
WIDTHS = (1280, 420)
"""A desktop window and a phone held upright."""
SCREEN_HEIGHT = 1400
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--hide-scrollbars",
    "--virtual-time-budget=5000",
)
MEASURE = """<script>
window.addEventListener("load", () => {
  const width = window.innerWidth;
  const outside = [...document.body.querySelectorAll("*")]
    .filter((element) => !element.closest(".scroll") && element.getBoundingClientRect().right > width + 0.5)
    .map((element) => element.tagName.toLowerCase() + (element.id ? "#" + element.id : ""));
  parent.postMessage(JSON.stringify({scroll: document.documentElement.scrollWidth, width, outside}), "*");
});
</script>"""
"""Added before ``</body>``: what the page measures of itself once laid out, posted to the frame's page."""
FRAME = """<!DOCTYPE html><html><head><title>waiting</title></head><body style="margin: 0">
<iframe src="{page}" style="width: {width}px; height: {height}px; border: 0; display: block"></iframe>
<script>window.addEventListener("message", (event) => {{ document.title = event.data; }});</script></body></html>"""
"""A page showing the report in a frame ``width`` px wide (narrower than Chromium's narrowest window)."""
MIN_WINDOW = 500
"""Headless Chromium's narrowest window, in px."""


def chromium(binary: str, profile: Path, width: int, *action: str) -> str:
    """Run headless Chromium ``width`` px wide with ``action`` (``--screenshot`` or ``--dump-dom``, a URL): stdout."""
    size = f"--window-size={max(width, MIN_WINDOW)},{SCREEN_HEIGHT}"
    command = [binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", size]
    done = subprocess.run([*command, *action], check=True, capture_output=True, text=True, timeout=180)
    return done.stdout


def framed(page: Path, width: int) -> Path:
    """A page beside ``page`` that shows it in a frame ``width`` px wide."""
    frame = page.with_name(f"frame_{page.stem}_{width}.html")
    frame.write_text(FRAME.format(page=html.escape(page.name), width=width, height=SCREEN_HEIGHT))
    return frame


def measured(binary: str, profile: Path, page: Path, width: int) -> dict[str, object]:
    """The page's measurements in a frame ``width`` px wide: ``scroll`` (its scrollWidth), ``width``, ``outside``."""
    probe = page.with_name(f"measure_{width}.html")
    probe.write_text(page.read_text().replace("</body>", f"{MEASURE}</body>"))
    dom = chromium(binary, profile, width, "--dump-dom", framed(probe, width).as_uri())
    title = re.search(r"<title>(.*?)</title>", dom, re.DOTALL)
    if title is None:
        raise RuntimeError(f"no title in the page at {width} px")
    found: dict[str, object] = json.loads(html.unescape(title.group(1)))
    return found


def shrunk(shot: Path, width: int) -> None:
    """The screenshot ``shot`` cut to the frame's ``width`` (the window is wider below 500 px), in 256 colours."""
    with Image.open(shot) as picture:
        picture.load()
    picture = picture.convert("RGB").crop((0, 0, min(width, picture.width), picture.height))
    picture.quantize(256).save(shot, optimize=True)


def quickstart_report(scratch: Path) -> Path:
    """The HTML report of a quickstart run on the CPU, written under ``scratch``."""
    runs = scratch / "runs"
    subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py"), "--root-dir", str(runs)],
        check=True,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)},
    )
    (log_dir,) = (runs / "quickstart").iterdir()
    return log_dir / "vram_report.html"


def check(binary: str, page: Path, out: Path, scratch: Path) -> list[str]:
    """Screenshot ``page`` at each width into ``out``; the widths at which something is wider than the viewport."""
    problems = []
    for width in WIDTHS:
        shot = out / f"html_report_{width}.png"
        chromium(binary, scratch / "profile", width, f"--screenshot={shot}", framed(page, width).as_uri())
        shrunk(shot, width)
        found = measured(binary, scratch / "profile", page, width)
        print(f"{width} px: scrollWidth {found['scroll']}, viewport {found['width']}; wrote {shot}")
        if int(str(found["scroll"])) > width or found["outside"]:
            problems.append(f"{width} px: page {found['scroll']} px wide, sticking out: {found['outside']}")
    return problems


def arguments_of(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line read; without ``--out``, ``out`` is a new temporary folder (the tracked pictures stay)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("page", nargs="?", type=Path, help="an HTML report (default: the quickstart's)")
    parser.add_argument(
        "--out", type=Path, default=None, help="where the screenshots go (default: a new temporary folder)"
    )
    arguments = parser.parse_args(argv)
    if arguments.out is None:
        arguments.out = Path(tempfile.mkdtemp(prefix="check_views-"))
    return arguments


def main() -> None:
    """Check the page given (or the quickstart's) at every width; exit 1 naming what is too wide."""
    arguments = arguments_of()
    binary = shutil.which("chromium")
    if binary is None:
        sys.exit("check_views: needs headless Chromium (apt-get install chromium)")
    arguments.out.mkdir(parents=True, exist_ok=True)
    print(f"check_views: screenshots in {arguments.out}")
    with tempfile.TemporaryDirectory() as directory:
        scratch = Path(directory)
        page = arguments.page.resolve() if arguments.page else quickstart_report(scratch)
        copy = scratch / "page" / "vram_report.html"
        copy.parent.mkdir()
        copy.write_text(page.read_text())
        problems = check(binary, copy, arguments.out, scratch)
    if problems:
        sys.exit("check_views: wider than the viewport\n" + "\n".join(problems))
    print("check_views: nothing wider than the viewport")


if __name__ == "__main__":
    main()
