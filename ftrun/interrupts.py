"""SIGINT and SIGTERM (and --signals-to-handle's others) for a long-running ftrun process (an agent,
a head node).

The first asks for a clean stop, which the process's loop notices; a second one stops waiting for
anyone (KeyboardInterrupt) and leaves at once.
"""

from __future__ import annotations

import signal
import threading

from ftrun.errors import ExitCode


class Interrupts:
    def __init__(self):
        #: the first stop signal received, or None
        self.signal: int | None = None
        #: set with it, for waits that should end early
        self.event = threading.Event()

    def install(self, also: tuple[int, ...] = ()) -> None:
        """Catch SIGINT, SIGTERM and the signals in ``also`` (--signals-to-handle)."""
        for sig in dict.fromkeys((signal.SIGINT, signal.SIGTERM, *also)):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if self.signal is not None:
            raise KeyboardInterrupt
        self.request(signum)

    def request(self, signum: int) -> None:
        """Stop as if ``signum`` had arrived (unless a signal came first)."""
        if self.signal is None:
            self.signal = signum
        self.event.set()

    @property
    def requested(self) -> bool:
        return self.signal is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signal).name if self.signal is not None else ""

    @property
    def worker_signal(self) -> int:
        """What the workers get first when this stop ends them: the signal itself when it is one the
        user asked to forward (SIGUSR1 before a Slurm pre-emption), else SIGTERM as always."""
        if self.signal is None or self.signal in (signal.SIGINT, signal.SIGTERM):
            return signal.SIGTERM
        return self.signal

    @property
    def exit_code(self) -> int:
        return ExitCode.INTERRUPTED if self.signal == signal.SIGINT else ExitCode.TERMINATED
