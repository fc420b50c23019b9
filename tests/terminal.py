"""A real terminal for the views: ``ftrun ARGS`` in a tmux pane, read and typed into as a user would."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest


class Pane:
    """``ftrun ARGS`` in a tmux pane of its own; the pane stays after it exits, with its exit code in a file
    and the terminal's modes (``stty -a``) as it left them in another."""

    def __init__(self, tmp: Path, name: str, args: list[str], env: dict[str, str], size: tuple[int, int] = (130, 45)):
        self.socket = f"ftrun-top-{os.getpid()}-{name}"
        self.exit_file = tmp / f"{name}.exit"
        self.stty_file = tmp / f"{name}.stty"
        env = {**env, "COLUMNS": str(size[0]), "LINES": str(size[1])}
        assigned = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items() if k.isidentifier())
        command = (f"env {assigned} {shlex.quote(sys.executable)} -m ftrun {shlex.join(args)}; "
                   f"code=$?; stty -a > {self.stty_file}; echo $code > {self.exit_file}.tmp; "
                   f"mv {self.exit_file}.tmp {self.exit_file}; sleep 600")  # the exit file appears whole
        self._tmux("new-session", "-d", "-x", str(size[0]), "-y", str(size[1]), command)

    def _tmux(self, *args: str) -> str:
        return subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True, text=True, timeout=10).stdout

    def screen(self) -> str:
        return self._tmux("capture-pane", "-p")

    def everything(self) -> str:
        """All the pane showed outside the view, scrollback included."""
        return self._tmux("capture-pane", "-p", "-J", "-S", "-")

    def given_back(self) -> None:
        """The terminal as a shell wants it: the normal screen, no mouse reports, a cursor, lines edited
        and echoed, Ctrl-C a signal."""
        modes = self._tmux("display", "-p", "#{alternate_on} #{mouse_any_flag} #{cursor_flag}").split()
        assert modes == ["0", "0", "1"], modes
        stty = self.stty_file.read_text().split()
        assert {"icanon", "echo", "isig"} <= set(stty), stty

    def keys(self, *keys: str) -> None:
        for key in keys:
            self._tmux("send-keys", key)
            time.sleep(0.15)

    def wait_for(self, *words: str, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        screen = ""
        while time.monotonic() < deadline:
            screen = self.screen()
            if all(word in screen for word in words):
                return screen
            time.sleep(0.2)
        pytest.fail(f"the view never showed {words}:\n{screen}")

    def exit_code(self, timeout: float = 15) -> int:
        deadline = time.monotonic() + timeout
        while not self.exit_file.exists():
            assert time.monotonic() < deadline, f"ftrun top did not leave:\n{self.screen()}"
            time.sleep(0.1)
        return int(self.exit_file.read_text())

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True, timeout=10)
