"""``ftrun top``: the interactive view of a running job (textual, imported only once the view opens)."""

from __future__ import annotations

import sys

import click

from ftrun.cli.status import _finite, job_options
from ftrun.errors import ExitCode, RendezvousError, UsageError

TOP_HELP = """Watch a running job and act on it: select a rank, read its output and stack, restart it as a drill.

\b
  ftrun top --rdzv-endpoint head:29400
  ftrun top --rdzv-endpoint head:29400 --run-id train7 --token-file ~/.ftrun-token

The controller's own terminal shows the same view (--status live).
Keys: j/k or arrows move, Enter opens a rank, s its stack, e the event log (/ filters), ? help, q leaves
(the job goes on). r (restart the rank, a drill), d (drain its node) and x (stop the job) need the job's
token and ask first. Exits 0, 2 on bad input, 3 when the store
cannot be reached or holds no ftrun job.
"""
#: textual is one of ftrun's dependencies: only an install that lost it, or holds a broken one, meets this
INSTALL = "ftrun top needs the textual package, a dependency of ftrun missing here: pip install 'textual>=8.0'"


@click.command(help=TOP_HELP, context_settings={"max_content_width": 110})
@job_options(backend_detail=", and again when it moves")
@click.option("--token-file", default="", metavar="FILE",
              help="The job's token: needed for r, d and x, and for stacks when the job has a token.")
@click.option("--timeout", type=click.FloatRange(0.1, 3600), default=10.0, show_default=True, callback=_finite,
              help="Seconds to wait for the store to answer.")
def top_command(endpoint: str, run_id: str, backend: str, rdzv_conf: str, token_file: str, timeout: float) -> int:
    from ftrun.auth import Signer, read_token
    from ftrun.cli.status import FOLLOW_DEADLINE, StatusReader, leave_without_teardown, store_finder
    from ftrun.store import ControlStore, StoreUnavailable

    find = store_finder(backend, endpoint, run_id, rdzv_conf, timeout)
    token = read_token(token_file) if token_file else b""
    try:
        from ftrun.top_view.app import TopApp
    except ImportError:
        raise UsageError(INSTALL) from None
    try:
        reader = StatusReader(find, run_id, timeout)
        reader.read()  # the job is there and has a status
    except StoreUnavailable as e:
        raise RendezvousError(str(e)) from None
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise UsageError("ftrun top needs a terminal; in a pipe use ftrun status --watch --json")
    from ftrun.top_view.source import JobSource

    reader.store.signer = Signer(token)  # the reader's next stores keep it

    def relocate() -> tuple[ControlStore, str] | None:
        """--rdzv-backend etcd: the controller's store now, found through etcd as the agents find it."""
        host = reader.follow(FOLLOW_DEADLINE)
        return (reader.store, host) if host else None

    TopApp(JobSource(reader.store, reader.keys, relocate if find.moves else None)).run()
    if find.moves:
        leave_without_teardown(ExitCode.OK)  # a look for the controller may sit in a store client's call
    return ExitCode.OK
