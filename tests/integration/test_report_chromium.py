"""The HTML job report as a browser sees it: headless Chromium draws it to a PNG and parses its DOM."""

from __future__ import annotations

import os
import shutil
import signal
import struct
import subprocess
import zlib
from pathlib import Path

import pytest

from ftrun.report import html_report
from tests.parts import unavailable
from tests.unit.test_report import HOSTILE, Page, job_events

pytestmark = pytest.mark.integration
CHROMIUM_DEADLINE = 60
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
WINDOW = (1200, 900)
#: a blank 1200x900 page compresses to about 5 KB; the report to about 100 KB
MIN_PNG_BYTES = 20_000
#: a flat page decodes to a handful of byte values; text, lines and bands to most of 0..255
MIN_DISTINCT_BYTES = 64


def chromium() -> str:
    found = shutil.which("chromium") or ("/usr/bin/chromium" if os.access("/usr/bin/chromium", os.X_OK) else "")
    if not found:
        unavailable("the HTML report test renders in Debian's chromium, which is not installed (apt-get install chromium)")
    return found


def run_chromium(tmp_path: Path, *args: str) -> str:
    """Run headless Chromium to completion with a deadline; its stdout. Nothing it starts outlives the call."""
    command = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               f"--user-data-dir={tmp_path / 'profile'}", f"--window-size={WINDOW[0]},{WINDOW[1]}", *args]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=dict(os.environ, HOME=str(tmp_path)))
    try:
        out, err = proc.communicate(timeout=CHROMIUM_DEADLINE)
    except subprocess.TimeoutExpired:
        pytest.fail(f"chromium did not finish within {CHROMIUM_DEADLINE}s: {' '.join(command)}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # helpers (crashpad, zygote) left in its process group
        except ProcessLookupError:
            pass
        proc.wait()
    assert proc.returncode == 0, f"chromium failed ({proc.returncode}):\n{err[-3000:]}"
    return out


def png_image_bytes(png: bytes) -> tuple[int, int, bytes]:
    """Width, height and the decompressed IDAT data (filter bytes left in) of a PNG."""
    width, height = struct.unpack(">II", png[16:24])
    chunks, position = [], len(PNG_SIGNATURE)
    while position < len(png):
        length, kind = struct.unpack(">I4s", png[position:position + 8])
        if kind == b"IDAT":
            chunks.append(png[position + 8:position + 8 + length])
        position += length + 12  # length, type, data, CRC
    return width, height, zlib.decompress(b"".join(chunks))


@pytest.fixture
def report_file(tmp_path) -> Path:
    path = tmp_path / "report.html"
    path.write_text(html_report(job_events(detail=HOSTILE, failed=True)), encoding="utf-8")
    return path


def test_chromium_draws_the_report(tmp_path, report_file):
    screenshot = tmp_path / "report.png"
    run_chromium(tmp_path, f"--screenshot={screenshot}", report_file.as_uri())
    png = screenshot.read_bytes()
    assert png.startswith(PNG_SIGNATURE)
    assert len(png) > MIN_PNG_BYTES
    width, height, image = png_image_bytes(png)
    assert (width, height) == WINDOW
    assert len(set(image)) > MIN_DISTINCT_BYTES, "the screenshot is (nearly) one flat colour"


def test_chromium_parses_the_fault_markers_and_runs_no_script(tmp_path, report_file):
    dom = Page(run_chromium(tmp_path, "--dump-dom", report_file.as_uri()))
    markers = dom.with_class("fault-marker")
    assert [(m["data-kind"], m["data-rank"]) for m in markers] == [("fault", "3"), ("node_lost", "")]
    assert len(dom.with_class("repair-band")) == 2
    assert not [tag for tag, _ in dom.tags if tag == "script"]
    assert HOSTILE in dom.text
