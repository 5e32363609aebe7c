"""Make the README's pictures from a quickstart run: the HTML report and the TensorBoard dashboard.

Needs headless Chromium (Debian's ``chromium`` package). Starts TensorBoard on the loopback interface only.

    python scripts/readme_images.py          # writes docs/images/*.png
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IMAGES = ROOT / "docs" / "images"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def screenshot(chromium: str, url: str, output: Path, size: str, profile: Path, wait_ms: int = 0) -> None:
    command = [
        chromium,
        *CHROMIUM_FLAGS,
        f"--user-data-dir={profile}",
        f"--window-size={size}",
        f"--screenshot={output}",
    ]
    if wait_ms:
        command.append(f"--virtual-time-budget={wait_ms}")
    subprocess.run([*command, url], check=True, capture_output=True, timeout=180)
    print(f"wrote {output.relative_to(ROOT)}")


def wait_for(url: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer within {seconds} s")


def main() -> None:
    chromium = shutil.which("chromium")
    if chromium is None:
        sys.exit("readme_images: needs headless Chromium (apt-get install chromium)")
    IMAGES.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        runs, profile = Path(scratch) / "runs", Path(scratch) / "profile"
        subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart.py"), "--root-dir", str(runs)], check=True)
        (log_dir,) = (runs / "quickstart").iterdir()
        screenshot(chromium, (log_dir / "vram_report.html").as_uri(), IMAGES / "html_report.png", "1000,1900", profile)
        port = free_port()
        board = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tensorboard.main",
                "--logdir",
                str(runs),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            base = f"http://127.0.0.1:{port}/"
            wait_for(base)
            for tab, name in (
                ("custom_scalars", "tensorboard_custom_scalars.png"),
                ("images", "tensorboard_images.png"),
            ):
                screenshot(chromium, f"{base}#{tab}", IMAGES / name, "1400,1000", profile, wait_ms=15000)
        finally:
            board.terminate()
            board.wait(timeout=30)


if __name__ == "__main__":
    main()
