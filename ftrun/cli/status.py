"""``ftrun status``: a running job's state, from any machine that reaches its store (read-only);
``ftrun report``: the summary of a finished job again, from its event log, and its HTML page."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

import click

from ftrun.cli.console import out, say
from ftrun.contract import Endpoint
from ftrun.errors import ExitCode, FtrunError, RendezvousError, UsageError

if TYPE_CHECKING:
    from ftrun.etcd import EtcdClient
    from ftrun.store import ControlStore

STATUS_HELP = """Show a running job's state: its nodes, ranks, recovery phase and last events.

\b
  ftrun status --rdzv-endpoint head:29400
  ftrun status --rdzv-endpoint head:29400 --run-id train7 --watch
  ftrun status --rdzv-endpoint head:29400 --json | jq .phase

Reads the job's control store and changes nothing. Exits 0, 2 on bad input, 3 when the store cannot
be reached or holds no ftrun job.
"""

REPORT_HELP = """Print the end-of-job summary again from an event log (--log-dir DIR writes DIR/RUN_ID/events.jsonl;
--log-layout torchrun, DIR/RUN_ID_XXXXXXXX/events.jsonl).

\b
  ftrun report logs/train7/events.jsonl
  ftrun report logs/train7/events.jsonl --html train7.html
"""


def _finite(ctx: click.Context, param: click.Parameter, value: float) -> float:
    if not math.isfinite(value):  # FloatRange lets nan through: every comparison with it is false
        raise click.BadParameter(f"must be a number of seconds, got '{value}'", ctx, param)
    return value


def job_options(backend_detail: str = "", conf_detail: str = ""):
    """The options that say where a running job is, shared by ``ftrun status`` and ``ftrun top`` (what
    :func:`store_finder` takes): ``endpoint``, ``run_id``, ``backend``, ``rdzv_conf``. ``*_detail`` ends that
    option's help in the command's own words."""
    def decorate(command):
        for option in reversed((  # click adds the nearest decorator's option first: this keeps the order read
            click.option("--rdzv-endpoint", "--rdzv_endpoint", "endpoint", required=True, metavar="HOST:PORT",
                         help="The job's store (its --rdzv-endpoint, or the head node's address and port)."),
            click.option("--run-id", "--run_id", "run_id", default="",
                         help="The job's run id (needed when the store has several)."),
            click.option("--rdzv-backend", "--rdzv_backend", "backend", default="c10d", show_default=True,
                         help="The job's --rdzv-backend: with etcd, --rdzv-endpoint names the etcd members and the "
                              f"job is found wherever its controller is now{backend_detail}."),
            click.option("--rdzv-conf", "--rdzv_conf", "rdzv_conf", default="",
                         help=f"With etcd: the job's TLS and auth{conf_detail}."),
        )):
            command = option(command)
        return command
    return decorate


@click.command(help=STATUS_HELP, context_settings={"max_content_width": 110})
@job_options(conf_detail=" (cacert, cert, key, user, password)")
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON (one object per line with --watch).")
@click.option("--watch", is_flag=True, help="Keep showing it, redrawn in place, until the job ends or Ctrl-C.")
@click.option("--interval", type=click.FloatRange(0.1, 3600), default=1.0, show_default=True, callback=_finite,
              help="Seconds between reads with --watch.")
@click.option("--timeout", type=click.FloatRange(0.1, 3600), default=10.0, show_default=True, callback=_finite,
              help="Seconds to wait for the store to answer.")
def status_command(endpoint: str, run_id: str, backend: str, rdzv_conf: str, as_json: bool, watch: bool,
                   interval: float, timeout: float) -> int:
    from ftrun.store import StoreUnavailable

    find = store_finder(backend, endpoint, run_id, rdzv_conf, timeout)
    try:
        reader = StatusReader(find, run_id, timeout)
        snapshot = reader.read()
        if watch:
            code = watch_status(reader, snapshot, as_json, interval)
        else:
            show(snapshot, as_json)
            code = ExitCode.OK
    except StoreUnavailable as e:
        raise RendezvousError(str(e)) from None
    if find.moves:
        leave_without_teardown(code)
    return code


def leave_without_teardown(code: int) -> NoReturn:
    """Leave a view of an etcd-backed job without the interpreter's teardown, its terminal restored.

    A store client of a controller that moved may still sit in a call in a thread of its own, and a thread
    that comes out of one while the interpreter tears down aborts the process: ``ftrun top`` exited 134 on a
    loaded CI run, and ``ftrun status --watch`` (and once ``ftrun status --json``) died of "terminate called
    without an active exception"."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


#: how long a view (``ftrun status --watch``, ``ftrun top``) of an etcd-backed job looks for the controller when
#: its store stops answering: the old controller's lease lapses after the job's --node-timeout (30 s by default),
#: and its successor publishes its store a moment later
FOLLOW_DEADLINE = 60.0
#: the longest one wait for a change of the job's keys in etcd lasts before the store record is read again
LOOK_AGAIN = 1.0


@dataclass(frozen=True)
class Location:
    """Where the job's control store listens (``endpoint``), and the host of the controller there."""

    endpoint: Endpoint
    host: str


class StoreFinder:
    """Where the job's control store is: the endpoint given (c10d, static), or where etcd says the
    controller in office hosts it (``moves``: found again after the controller moved)."""

    def __init__(self, endpoint: Endpoint | None = None, etcd: EtcdClient | None = None, run_id: str = ""):
        self._endpoint, self._etcd, self._run_id = endpoint, etcd, run_id
        self.moves = etcd is not None

    def __call__(self) -> Location:
        if self._etcd is None:
            assert self._endpoint is not None
            return Location(self._endpoint, self._endpoint.host)
        from ftrun.config import parse_endpoint
        from ftrun.controller.leadership import current_store_record
        from ftrun.etcd import EtcdError
        from ftrun.keys import EtcdKeys

        try:
            record = current_store_record(self._etcd, EtcdKeys(self._run_id))
        except EtcdError as e:
            raise RendezvousError(str(e)) from None
        if record is None:
            raise RendezvousError(f"job '{self._run_id}' has no controller in etcd at {self._etcd.options.describe()} "
                                  "(a wrong --run-id, or the job has ended or not started)")
        return Location(parse_endpoint(record.endpoint, 0, "the job's store record in etcd"), record.host)

    def revision(self) -> int:
        """etcd's revision now (0 when it does not answer): :meth:`wait` waits for a change after it."""
        from ftrun.etcd import EtcdError

        try:
            return self._etcd.revision() if self._etcd is not None else 0
        except EtcdError:
            return 0

    def wait(self, after_revision: int, timeout: float) -> None:
        """Until one of the job's keys in etcd changes after ``after_revision`` (a lease lapsed, a successor
        published its store), or ``timeout``: a watch, as the agents wait, rather than reads in a loop."""
        from ftrun.etcd import EtcdError
        from ftrun.keys import EtcdKeys

        if self._etcd is not None and after_revision:
            try:
                if not self._etcd.wait_change(EtcdKeys(self._run_id).root, after_revision, timeout, prefix=True):
                    time.sleep(min(timeout, 0.05))  # a member that went ends the watch early: not a busy loop
                return
            except EtcdError:
                pass
        time.sleep(min(timeout, 0.2))


def store_finder(backend: str, endpoint: str, run_id: str, rdzv_conf: str, timeout: float) -> StoreFinder:
    from ftrun.config import DEFAULT_RDZV_PORT, ETCD_SPELLINGS, etcd_options, parse_endpoint, parse_rdzv_conf

    if backend not in ETCD_SPELLINGS:
        return StoreFinder(parse_endpoint(endpoint, DEFAULT_RDZV_PORT))
    from ftrun.etcd import EtcdClient

    if not run_id:
        raise UsageError("--rdzv-backend etcd needs --run-id: one etcd holds many jobs")
    options = etcd_options({"rdzv_endpoint": endpoint}, parse_rdzv_conf(rdzv_conf), standalone=False)
    return StoreFinder(etcd=EtcdClient(options, timeout), run_id=run_id)


class StatusReader:
    """The job's status snapshot from its store: gets and checks only, never a write."""

    def __init__(self, find: StoreFinder, run_id: str, timeout: float):
        from ftrun.keys import JobKeys

        self.find, self.timeout = find, timeout
        self.store: ControlStore | None = None
        self.location = find()
        self.store = self._open(self.location.endpoint, timeout)
        self.keys = JobKeys(run_id or self._only_run_id())

    @property
    def endpoint(self) -> Endpoint:
        """Where the store read from listens (a static rendezvous's control store, not its --master-port)."""
        return self.store.endpoint

    def _open(self, endpoint: Endpoint, timeout: float) -> ControlStore:
        from ftrun.keys import CONTROL_STORE
        from ftrun.store import ControlStore, connect_store

        # a store that moves (etcd) is given up within --timeout when its host stops answering without closing
        # the connection (stopped, cut off: a TCPStore call waits for good), so that the view looks for the next;
        # its first read too (at a controller stopped as the view connected, a bare TCPStore check waited for good)
        call_timeout = self.timeout if self.find.moves else 0.0
        signer = self.store.signer if self.store else None
        raw = connect_store(endpoint, timeout, refused_is_final=True)  # a host that does not answer is waited for
        store = ControlStore(raw, endpoint, is_host=False, signer=signer, call_timeout=call_timeout)
        control = store.try_text(CONTROL_STORE)
        if control:  # a static rendezvous's --master-port: the control store is elsewhere
            endpoint = Endpoint(endpoint.host, int(control))
            raw = connect_store(endpoint, timeout, refused_is_final=True)
            store = ControlStore(raw, endpoint, is_host=False, signer=signer, call_timeout=call_timeout)
        return store

    def follow(self, deadline: float) -> str:
        """--rdzv-backend etcd: the store stopped answering. Look in etcd, as the agents do, until it names a
        controller whose store is not the one that went, that store answers and holds the job's status, then
        read from it. The new controller's host; "" when none came within ``deadline`` seconds (at once with
        c10d, whose store never moves)."""
        from ftrun.store import StoreUnavailable

        if not self.find.moves:
            return ""
        end = time.monotonic() + deadline
        while True:
            revision = self.find.revision()  # before the look: a change between the two wakes the wait
            left = end - time.monotonic()
            try:
                found = self.find()
                if found.endpoint != self.location.endpoint:
                    store = self._open(found.endpoint, max(0.1, min(self.timeout, left)))
                    # its controller publishes the status once it took over from the journal
                    if store.wait_for(self.keys.status, max(0.1, min(self.timeout, left))):
                        self.store, self.location = store, found
                        return found.host
            except (RendezvousError, StoreUnavailable, RuntimeError):  # none in office yet, or its store went too
                pass
            left = end - time.monotonic()
            if left <= 0:
                return ""
            self.find.wait(revision, min(LOOK_AGAIN, left))

    def _only_run_id(self) -> str:
        from ftrun.keys import JOBS_COUNT, job_entry

        count = int(self.store.try_text(JOBS_COUNT) or 0)
        run_ids = [self.store.try_text(job_entry(index)) for index in range(count)]
        run_ids = [r for r in run_ids if r]
        if not run_ids:
            raise RendezvousError(f"no ftrun job has started on the store at {self.endpoint} (yet)")
        if len(set(run_ids)) > 1:
            raise UsageError(f"the store at {self.endpoint} has several jobs: {', '.join(run_ids)}; choose one with --run-id")
        return run_ids[0]

    def read(self) -> dict:
        text = self.store.try_text(self.keys.status)
        if not text:
            raise RendezvousError(f"job '{self.keys.run_id}' has no status on the store at {self.endpoint} "
                                  "(a wrong --run-id, or its nodes are still gathering)")
        return json.loads(text)

    def pause(self, seconds: float) -> bool:
        """Wait ``seconds`` before the next read, or less if the job ends meanwhile; whether it has ended
        (the status then holds its last state)."""
        return self.store.wait_for(self.keys.status_final, seconds)


def show(snapshot: dict, as_json: bool) -> None:
    from ftrun.live_view import render

    if as_json and out.is_terminal:
        out.print_json(json.dumps(snapshot))
    elif as_json:
        print(json.dumps(snapshot), flush=True)
    else:
        out.print(render(snapshot, out.width, out.height))


def watch_status(reader: StatusReader, snapshot: dict, as_json: bool, interval: float, lines: bool = False) -> int:
    """Redraw (or print a JSON line) every ``interval`` until the job ends, its store goes, or Ctrl-C. Under
    --rdzv-backend etcd a store that goes is looked for again (``StatusReader.follow``): the controller moved.
    ``lines``: a line when the phase or the controller changes, and every PLAIN_EVERY seconds (as --status
    plain), for a log, where a view redrawn in place shows nothing."""
    from rich.live import Live

    from ftrun.live_view import PLAIN_EVERY, moved_line, plain_line, render
    from ftrun.store import StoreUnavailable

    live = None if as_json or lines else Live(render(snapshot, out.width, out.height), console=out, auto_refresh=False)
    if live is not None:
        live.start()
    ended, fresh = False, True
    said, said_at = None, 0.0  # with lines: the phase and the controller's host last said, and when
    try:
        while True:
            if fresh and as_json:
                print(json.dumps(snapshot), flush=True)
            elif fresh and lines:
                shown = (snapshot["phase"], reader.location.host)
                if shown != said or time.monotonic() - said_at > PLAIN_EVERY:
                    say(f"ftrun: {plain_line(snapshot)}")
                    said, said_at = shown, time.monotonic()
            elif fresh:
                live.update(render(snapshot, out.width, out.height), refresh=True)
            if ended or snapshot["phase"] == "done":
                return ExitCode.OK
            try:
                ended = reader.pause(interval)
                snapshot, fresh = reader.read(), True
            except StoreUnavailable:
                if ended or snapshot["phase"] in ("exiting", "done"):
                    return ExitCode.OK  # the job ended and its store with it
                went = reader.endpoint
                host = reader.follow(FOLLOW_DEADLINE)
                if not host:
                    looked = f"; etcd named no other controller within {FOLLOW_DEADLINE:g}s" if reader.find.moves else ""
                    raise RendezvousError(f"the job's store at {went} went away (the job ended, or its host is "
                                          f"gone){looked}; last seen: {plain_line(snapshot)}") from None
                say(f"ftrun: {moved_line(host)}")  # above the live view, or on stderr beside the JSON lines
                fresh = False  # what was last read is the old controller's: the next read is the new one's
    except KeyboardInterrupt:
        return ExitCode.OK
    finally:
        if live is not None:
            live.stop()


@click.command(help=REPORT_HELP, context_settings={"max_content_width": 110})
@click.argument("events_file", metavar="EVENTS.jsonl")
@click.option("--html", "html_path", default="", metavar="FILE", help="Also write a self-contained HTML page with a timeline.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary's figures as JSON instead.")
def report_command(events_file: str, html_path: str, as_json: bool) -> int:
    from ftrun.events import read_events
    from ftrun.summary import figures, job_summary

    try:
        events = read_events(events_file)
    except (OSError, UnicodeError) as e:
        raise UsageError(f"cannot read {events_file}: {getattr(e, 'strerror', None) or e}") from None
    except ValueError as e:
        raise UsageError(str(e)) from None
    if not events:
        raise UsageError(f"{events_file} holds no events")
    if as_json:
        print(json.dumps(figures(events), indent=2))
    else:
        print("\n".join(job_summary(events)))  # the command's output: `ftrun report F > summary.txt` keeps it
    if html_path:
        write_html(events, html_path)
        say(f"wrote {html_path}")
    return ExitCode.OK


def write_html(events: list[dict], path: str) -> None:
    from ftrun.report import html_report

    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(html_report(events))
    except OSError as e:
        raise FtrunError(f"cannot write {path}: {e.strerror}", ExitCode.USAGE) from None
