"""What the real-hardware self-checks share (scripts/gpu/check.py, scripts/npu/check.py): the table's rows,
a command run with a deadline and its log, the table printed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class Checks:
    """The table's rows: part, what was checked, whether it held (None: a figure only), the figure."""

    def __init__(self):
        self.rows: list[dict] = []

    def add(self, part: str, what: str, ok: bool | None, figure: str = "") -> bool:
        self.rows.append({"part": part, "check": what, "ok": ok, "figure": figure})
        mark = {True: "ok", False: "FAILED", None: "info"}[ok]
        print(f"[{part}] {mark}: {what} {figure}", file=sys.stderr, flush=True)
        return bool(ok)

    @property
    def failed(self) -> bool:
        return any(row["ok"] is False for row in self.rows)


def run(args: list[str], log: Path, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """A command with its output in ``log``; a timeout is a failed run (exit code 124), never a hang."""
    with open(log, "w") as out:
        try:
            return subprocess.run(args, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, cwd=ROOT,
                                  env={**os.environ, **(env or {})}, text=True)
        except subprocess.TimeoutExpired:
            return subprocess.CompletedProcess(args, 124)


def tail(log: Path, lines: int = 6) -> str:
    return " | ".join(log.read_text(errors="replace").strip().splitlines()[-lines:])[-600:]


def print_table(checks: Checks, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for header in ("part", "check", "result", "figure"):
        table.add_column(header)
    for row in checks.rows:
        table.add_row(row["part"], row["check"], {True: "ok", False: "FAILED", None: ""}[row["ok"]], row["figure"])
    Console(width=200).print(table)
