"""Worker output: to the console (prefixed when teed), to per-rank files, and a tail for the summary.

The files get every line. On the console and in the tail a C++ stack trace of torch's is left out (one line
on the console says so, and which file has it): after a lost store or a cut gloo link each rank prints one
of 20 to 30 lines, which buried the Python exception that says what failed.
"""

from __future__ import annotations

import collections
import io
import os
import string
import sys
import threading
import time
from typing import IO

from ftrun.detection.exits import is_cpp_trace_line
from ftrun.detection.output_steps import OutputSteps
from ftrun.folders import private_dirs

STDOUT, STDERR = 1, 2
TAIL_LINES = 20
#: a rank's last lines, stdout and stderr together, that ``ftrun top`` shows (and that its agent publishes)
RECENT_LINES = 50
#: characters kept of each of those lines
RECENT_WIDTH = 240

_console_lock = threading.Lock()


class StreamPump:
    """Copies one worker pipe line by line, in a named thread, until the pipe closes."""

    def __init__(self, pipe: IO[bytes], name: str, console: IO[bytes] | ConsoleStream | None, prefix: bytes,
                 file_path: str | None, console_only: bytes = b"", filtered: FilteredCopy | None = None,
                 file_prefix: bytes = b"", recent: collections.deque[str] | None = None,
                 capture: list[str] | None = None, steps: OutputSteps | None = None):
        self._pipe = pipe
        #: shared by the rank's two pumps: the last step its output said (a plain script's, from outside)
        self.steps = steps
        #: shared by the rank's two pumps: its last lines of both streams, in the order they came
        self.recent = recent
        #: --duplicate-*-filters: lines holding a filter word are copied there too, prefixed
        self._filtered = filtered
        self._file_prefix = file_prefix
        self._console = console
        self._prefix = prefix
        #: only lines that start with this reach the console (all of them reach the file)
        self._console_only = console_only
        self._file = open(file_path, "wb") if file_path else None
        #: the last lines, less C++ stack traces: the summary's "last stderr lines" and the exit's evidence
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        #: what the console shows for a C++ stack trace: said at its first line, when it happens (a rank
        #: that survives the error may print nothing more for a while)
        where = f"; it is in {file_path}" if file_path else ""
        self._trace_note = prefix + f"(C++ stack trace left out{where})\n".encode()
        self._in_trace = False
        #: lines seen so far: output is a sign of life for the hang check
        self.lines = 0
        #: while a list, every line is also appended to it (a stack dump being read back, a host's probe result)
        self.capture: list[str] | None = capture
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for line in iter(self._pipe.readline, b""):
                text = line.decode("utf-8", "replace").rstrip("\n")
                trace = is_cpp_trace_line(text)
                if not trace:
                    self.tail.append(text)
                if self.recent is not None:
                    self.recent.append(text[:RECENT_WIDTH])
                if self.capture is not None:
                    self.capture.append(text)
                if self.steps is not None and not trace:
                    self.steps.read(text, time.monotonic())
                self.lines += 1
                if self._file:
                    self._file.write(line)
                    self._file.flush()
                if self._filtered is not None:
                    self._filtered.offer(self._file_prefix + line)
                if self._console is not None and line.startswith(self._console_only) and not (trace and self._in_trace):
                    with _console_lock:
                        self._console.write(self._trace_note if trace else self._prefix + line)
                        self._console.flush()
                self._in_trace = trace
        except (OSError, ValueError):
            pass  # the console or file went away; the worker's exit still gets reported
        finally:
            self._pipe.close()
            if self._file:
                self._file.close()

    def drain(self, timeout: float) -> None:
        """Wait for the rest of the output after the worker exited (bounded: grandchildren may hold the pipe)."""
        self._thread.join(timeout)


class FilteredCopy:
    """One file that the lines of several ranks' streams holding any of ``words`` are copied to
    (torchrun's ``--duplicate-stdout-filters``: ``attempt_<n>/filtered_stdout.log``)."""

    def __init__(self, path: str, words: tuple[str, ...]):
        self.path = path
        self._words = tuple(word.encode() for word in words)
        self._lock = threading.Lock()
        self._file: IO[bytes] | None = None

    def offer(self, line: bytes) -> None:
        if not any(word in line for word in self._words):
            return
        with self._lock:
            if self._file is None:
                self._file = open(self.path, "ab")
            self._file.write(line)
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def line_prefix(layout: str, template: str, role: str, rank: int, local_rank: int) -> str:
    """What a teed line starts with: TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE's ``template`` when set (as torchrun:
    ``${role_name}``, ``${rank}``, ``${local_rank}``), else the layout's own (``[rank 3]: ``, or torchrun's
    ``[default0]:``)."""
    if template:
        return string.Template(template).safe_substitute(role_name=role, rank=rank, local_rank=local_rank)
    if layout == "torchrun":
        return f"[{role}{local_rank}]:"
    return f"[rank {rank}]: "


class ConsoleStream:
    """The process's stdout or stderr, looked up at each write: while the live status view runs,
    ``sys.stdout`` is its proxy, which prints each line above the view rather than through it."""

    def __init__(self, which: int):
        self.which = which

    def write(self, data: bytes) -> None:
        stream = sys.stdout if self.which == STDOUT else sys.stderr
        if isinstance(stream, io.TextIOWrapper):
            stream.buffer.write(data)
        else:
            stream.write(data.decode("utf-8", "replace"))

    def flush(self) -> None:
        (sys.stdout if self.which == STDOUT else sys.stderr).flush()


def rank_log_paths(log_dir: str, generation: int, rank: int | str) -> dict[str, str]:
    """A rank's stdout.log, stderr.log and error.json: ``attempt_<generation>/<rank>/`` under the node's log
    folder (``rank`` is the global rank in ftrun's layout, the local rank in torchrun's; "scheduler" for a
    MindSpore job's scheduler)."""
    folder = os.path.join(log_dir, f"attempt_{generation}", str(rank))
    private_dirs(folder)
    return {name: os.path.join(folder, f"{name}.log") for name in ("stdout", "stderr")} | {
        "error": os.path.join(folder, "error.json")
    }
