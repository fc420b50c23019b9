"""``ftrun top``'s view on the controller's own terminal (``--status live``, or auto on a terminal).

The view runs in a child process (``python -m ftrun.top_view.attached``): textual wants the main thread and
the terminal's signals of its process, and the controller's process keeps both for its own loop and its
Ctrl-C. The child reads the job's store as ``ftrun top`` does, and signs the operator's actions with the
job's token, which the controller hands it on a pipe (never on a command line or in the environment).
That pipe is also its lifeline: when the controller closes it (the job ended) or dies, the view leaves
and gives the terminal back.

While the view owns the terminal, nothing else may write there: the controller's descriptors 1 and 2
(its own lines, the workers' output it copies, torch's C++ warnings) are a pipe into a hold of the last
lines, written out when the view leaves. ``q`` leaves the view and never the job: the terminal then gets
the plain log lines and a progress line now and then, as ``--status plain``. Ctrl-C in the view stops
the job as it does outside it.
"""

from __future__ import annotations

import collections
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import termios
import threading
from typing import Callable

from ftrun.errors import ExitCode
from ftrun.live_view import StatusView, status_view

log = logging.getLogger(__name__)

#: lines of the controller's own output kept while the view is up, written out when it leaves
HELD_LINES = 200
#: how long the view gets to leave once its lifeline is closed, before it is ended
LEAVE_DEADLINE = 10.0
#: the view's exit status after Ctrl-C: the controller then stops the job as on its own Ctrl-C
INTERRUPTED = int(ExitCode.INTERRUPTED)
#: what a view that was killed may have left on: mouse reports, bracketed paste, focus events, a hidden
#: cursor, the alternate screen
TERMINAL_RESET = b"\x1b[?1000l\x1b[?1002l\x1b[?1003l\x1b[?1006l\x1b[?1015l\x1b[?2004l\x1b[?1004l\x1b[?25h\x1b[?1049l"
INSTALL_HINT = ("ftrun: the interactive view needs textual, a dependency of ftrun missing here "
                "(pip install 'textual>=8.0'); showing the live view that takes no keys")


def interactive_wanted(mode: str, terminals: tuple[bool, bool, bool] | None = None) -> bool:
    """The interactive view: where the live view is wanted and stdin, stdout and stderr are all the
    terminal (``ftrun ... < /dev/null`` keeps the live view that takes no keys)."""
    if terminals is None:
        terminals = (sys.stdin.isatty(), sys.stdout.isatty(), sys.stderr.isatty())
    return all(terminals) and mode in ("auto", "live")


def textual_installed() -> bool:
    return importlib.util.find_spec("textual") is not None


def controller_view(controller, mode: str, token: bytes) -> StatusView | AttachedTop:
    """Start the view of ``controller`` (a ``Controller``) on this terminal, as ``--status`` asks:
    the interactive one where textual is installed, else :func:`ftrun.live_view.status_view`'s."""
    from ftrun.cli.console import console

    if interactive_wanted(mode):
        if textual_installed():
            view = AttachedTop(controller.store.endpoint, controller.keys.run_id, token, lambda: controller.status)
            view.start()
            return view
        console.print(INSTALL_HINT, markup=False, highlight=False)
    return status_view(controller, mode)


class HeldOutput:
    """Descriptors 1 and 2 turned into a pipe, read in a named thread that keeps the last ``HELD_LINES``
    lines; :meth:`release` points them back at the terminal, writes what it kept there, and passes on
    whatever still comes through the pipe (a child that inherited it)."""

    def __init__(self):
        sys.stdout.flush()
        sys.stderr.flush()
        #: the terminal, as descriptors 1 and 2 were
        self.terminal = (os.dup(1), os.dup(2))
        self._read, write = os.pipe()
        os.dup2(write, 1)
        os.dup2(write, 2)
        os.close(write)
        self._lines: collections.deque[bytes] = collections.deque(maxlen=HELD_LINES)
        self.dropped = 0
        self._lock = threading.Lock()
        self._released = False
        self._thread = threading.Thread(target=self._pump, name="ftrun-top-held", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        try:
            while data := os.read(self._read, 65536):
                with self._lock:
                    if self._released:
                        _write_all(1, data)
                        continue
                    for line in data.splitlines(keepends=True):
                        if self._lines and not self._lines[-1].endswith(b"\n"):
                            line = self._lines.pop() + line  # the rest of a line that came in two reads
                        elif len(self._lines) == HELD_LINES:
                            self.dropped += 1
                        self._lines.append(line)
        except OSError:
            pass
        finally:
            os.close(self._read)

    def release(self) -> None:
        """The terminal back on 1 and 2, and the lines kept written there (once)."""
        if self._released:
            return
        try:  # what Python still buffers goes into the pipe first, in its order
            sys.stdout.flush()
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        with self._lock:
            os.dup2(self.terminal[0], 1)
            os.dup2(self.terminal[1], 2)
            for fd in self.terminal:
                os.close(fd)
            if self.dropped:
                _write_all(1, f"ftrun: ({self.dropped} earlier lines of output came while the view was open; "
                              f"--log-dir keeps them all)\n".encode())
            _write_all(1, b"".join(self._lines))
            self._lines.clear()
            self._released = True


def _write_all(fd: int, data: bytes) -> None:
    while data:
        try:
            data = data[os.write(fd, data):]
        except InterruptedError:
            continue
        except OSError:
            return  # the terminal is gone: nothing to show it on


class AttachedTop:
    """The interactive view of this controller's job, on this terminal, in a child process."""

    def __init__(self, endpoint, run_id: str, token: bytes, source: Callable[[], dict]):
        self.endpoint = endpoint
        self.run_id = run_id
        self.token = token
        #: the latest status snapshot, for the progress lines once the view has left
        self.source = source
        self.proc: subprocess.Popen | None = None
        self.held: HeldOutput | None = None
        #: set once the job is ending: the view leaves because the controller closed it, not the user
        self._closing = threading.Event()
        #: the write end of the view's lifeline (-1 once closed; the lock: stop() and _wait() both close it)
        self._lifeline = -1
        self._lifeline_lock = threading.Lock()
        self._tty: list | None = None
        self._waiter: threading.Thread | None = None
        #: the progress lines once the user left with q
        self._plain: StatusView | None = None

    def start(self) -> None:
        try:
            self._tty = termios.tcgetattr(0)
        except termios.error:
            self._tty = None
        read, self._lifeline = os.pipe()
        self.held = HeldOutput()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ftrun.top_view.attached", str(self.endpoint), self.run_id, str(read)],
                stdout=self.held.terminal[0], stderr=self.held.terminal[1], pass_fds=(read,),
            )
        except OSError as e:
            self._close_lifeline()
            self.held.release()
            log.warning("cannot start the interactive view (%s); plain log lines instead", e)
            self._plain = StatusView(self.source, "plain", _console())
            self._plain.start()
            return
        finally:
            os.close(read)
        try:
            os.write(self._lifeline, self.token + b"\n")
        except OSError:
            pass  # the view is gone already: _wait gives the terminal back
        self._waiter = threading.Thread(target=self._wait, name="ftrun-top-view", daemon=True)
        self._waiter.start()

    def stop(self) -> None:
        """The job is ending: the view leaves (it is ended if it does not), the terminal is given back."""
        self._closing.set()
        self._close_lifeline()
        if self._waiter is not None:
            self._waiter.join(LEAVE_DEADLINE)
            if self._waiter.is_alive() and self.proc is not None:
                log.warning("the interactive view did not leave in %gs; ending it", LEAVE_DEADLINE)
                self.proc.kill()
                self._waiter.join(5.0)
        if self._plain is not None:
            self._plain.stop()

    def _wait(self) -> None:
        proc = self.proc
        assert proc is not None and self.held is not None
        code = proc.wait()
        self._close_lifeline()
        self._restore_terminal(killed=code < 0)
        self.held.release()
        if self._closing.is_set():
            return
        if code == INTERRUPTED:  # Ctrl-C in the view: this process's own Ctrl-C, handled as always
            os.kill(os.getpid(), signal.SIGINT)
            return
        console = _console()
        if code == 0:
            console.print("ftrun: left the view; the job goes on (Ctrl-C stops it)", markup=False, highlight=False)
        else:
            console.print(f"ftrun: the interactive view ended with exit status {code}; the job goes on",
                          style="yellow", markup=False, highlight=False)
        self._plain = StatusView(self.source, "plain", console)
        self._plain.start()

    def _close_lifeline(self) -> None:
        with self._lifeline_lock:
            fd, self._lifeline = self._lifeline, -1
        if fd >= 0:
            os.close(fd)

    def _restore_terminal(self, killed: bool) -> None:
        """The terminal's modes as they were before the view (textual restores them when it leaves; a
        view that was killed could not)."""
        if killed and self.held is not None:
            _write_all(self.held.terminal[1], TERMINAL_RESET)
        if self._tty is not None:
            try:
                termios.tcsetattr(0, termios.TCSADRAIN, self._tty)
            except termios.error:
                pass


def _console():
    from ftrun.cli.console import console

    return console


# --- the child: the view itself ------------------------------------------------------------------------------

def main(argv: list[str]) -> int:
    """``python -m ftrun.top_view.attached HOST:PORT RUN_ID FD``: the token is the first line on FD, whose
    end tells the view to leave."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the controller answers Ctrl-C; in the view it is a key
    endpoint_text, run_id, fd_text = argv
    lifeline = int(fd_text)
    token = b""
    while not token.endswith(b"\n"):
        chunk = os.read(lifeline, 1)
        if not chunk:
            return 0  # the controller ended before the view started
        token += chunk

    from ftrun.auth import Signer
    from ftrun.config import parse_endpoint
    from ftrun.errors import FtrunError
    from ftrun.keys import JobKeys
    from ftrun.store import ControlStore, connect_store
    from ftrun.top_view.source import JobSource

    try:
        from ftrun.top_view.app import ControllerTopApp

        endpoint = parse_endpoint(endpoint_text, 0)
        store = ControlStore(connect_store(endpoint, 10.0), endpoint, is_host=False, signer=Signer(token.strip()))
    except (ImportError, FtrunError) as e:  # a textual too old or broken; the store gone already
        print(f"ftrun: the interactive view cannot start: {e}", file=sys.stderr)
        return 1
    app = ControllerTopApp(JobSource(store, JobKeys(run_id)), lifeline)
    app.run()
    return app.return_code or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
