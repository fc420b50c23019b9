"""Where the control store is, and store connections that follow it when it moves.

With a highly available controller (``--rdzv-backend etcd``) the control store lives on the controller's
node, and when that node is lost a successor agent hosts a new, empty one elsewhere. Each agent then
writes the new store's ``host:port`` into a node-local file (``FTRUN_CONTROL_STORE_FILE``, replaced
atomically). The ranks on the surviving nodes keep running: their collectives go peer to peer once a
group formed, so only their store calls notice. A store call that fails because the store's host is gone
waits for the file to name another store (up to ``FTRUN_STORE_TIMEOUT``), connects there and runs again.
The successor announces its repair in the new store; the heartbeat rewrites the rank's keys there.

:class:`StoreLocation` is the one object of the rank that knows where the store is. Every connection the
rank holds (the link's, which the process groups connect through too, the heartbeat's and the repair
watch's) is a :class:`MovableStore` it made. Without the file the store never moves, and the connections
are plain TCPStore clients, as before.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
import threading
import time
from typing import Callable, NoReturn

import torch.distributed as dist

from ftrun.contract import STORE_TIMEOUT, Endpoint, EndpointError, parse_endpoint
from ftrun.elastic.groups import first_line
from ftrun.store import HANDSHAKE_DEADLINE, OPERATION_TIMEOUT, connect_store

log = logging.getLogger("ftrun.elastic")
#: how often a rank whose store is gone reads the file for a new address (a read of a few bytes)
FILE_POLL = 0.05
#: what a rank exits with when its store is gone for good (as a script's SystemExit with a message)
EXIT_STORE_GONE = 1
#: how long one try to reach a store lasts before the file is read again (a TCPStore handshake takes
#: up to HANDSHAKE_DEADLINE)
CONNECT_ATTEMPT = HANDSHAKE_DEADLINE + 2.0
#: store calls that wait for keys: their timing out is no sign that the store is gone
KEY_WAITS = frozenset({"get", "wait", "multi_get"})
#: how often a rank whose store connection broke, while the file still names that store, tries it again
PROBE_AGAIN = 1.0
#: how often a wait for keys reads the file (a store whose host stopped answering holds the wait)
WAIT_POLL = 0.1
#: how long a wait for keys lasts, unless it says (a store client's, as elsewhere)
KEY_WAIT_TIMEOUT = OPERATION_TIMEOUT.total_seconds()


class StoreGone(dist.DistNetworkError):
    """The store is gone and no other came in time; raised by every store call after the rank said so
    (a DistNetworkError, as a store that is gone raises without the file)."""


class StoreLocation:
    """The control store's current endpoint: ``FTRUN_CONTROL_STORE`` at the start, then what ``file`` names.

    Thread-safe: the main thread, the heartbeat and the repair watch each find the store gone on their own
    connection. The first one starts the clock (``timeout`` seconds, until a connection reaches a store
    again); whichever reads the new address first moves the location, and the others follow it at once.
    """

    def __init__(self, endpoint: Endpoint, file: str = "", timeout: float = STORE_TIMEOUT, rank: int = 0,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep):
        self.file = file
        #: what the give-up deadline and the probes are timed by, and how a wait for the file pauses (tests
        #: pass a fake clock, whose sleep moves it)
        self.clock, self.sleep = clock, sleep
        self.timeout = timeout
        self.rank = rank
        self._endpoint = (self.named() if file else None) or endpoint
        self._lock = threading.Lock()
        #: when a connection first found the store gone; None while the store answers
        self._gone_since: float | None = None
        self._gave_up = False
        #: clock() when a connection last reached the store after it was gone; 0.0: never
        self.back_at = 0.0
        #: the rank is ending (``ControlLink.let_go``): a store that is gone is not waited for any more
        self.closing = False

    @property
    def endpoint(self) -> Endpoint:
        return self._endpoint

    def connect(self, timeout: float):
        """A connection to the store: a plain TCPStore client, trying for ``timeout`` seconds, or, when the
        store may move, one that follows it, trying (and following the file) for the location's ``timeout``."""
        if not self.file:
            return connect_store(self._endpoint, timeout=timeout)
        return MovableStore(self)

    def named(self) -> Endpoint | None:
        """The endpoint the file names now; None while it names none (absent, empty, unreadable)."""
        try:
            with open(self.file) as f:
                return parse_endpoint(f.read(), 0, self.file)
        except (OSError, EndpointError):
            return None

    def successor(self, gone: Endpoint) -> Endpoint:
        """The store at ``gone`` is gone: the endpoint to go to instead, once the file names another (or
        ``gone`` itself, if it answers again while the file still names it: only this connection broke).
        Gives up ``timeout`` seconds after the rank first found the store gone."""
        probed = self.clock()
        while True:
            if self.closing:
                raise StoreGone(f"the control store at {gone} is gone, and this rank is ending")
            deadline = self._deadline(gone)
            if deadline is None:
                return self._endpoint  # another connection moved already
            named = self.named()
            if named is not None and named != gone:
                return self._move(gone, named)
            if named == gone and self.clock() - probed > PROBE_AGAIN:
                if _answers(gone):
                    return gone
                probed = self.clock()
            if self.clock() >= deadline:
                self._give_up(gone)
            self.sleep(FILE_POLL)

    def try_again(self, unreachable: Endpoint) -> Endpoint:
        """A connection could not reach ``unreachable`` (a store not yet listening, or gone already): the
        endpoint to try next, the same one while the file names it and time is left."""
        if self.closing:
            raise StoreGone(f"the control store at {unreachable} is gone, and this rank is ending")
        deadline = self._deadline(unreachable)
        if deadline is None:
            return self._endpoint
        named = self.named()
        if named is not None and named != unreachable:
            return self._move(unreachable, named)
        if self.clock() >= deadline:
            self._give_up(unreachable)
        return unreachable

    def reached(self, endpoint: Endpoint) -> None:
        """A connection reached the store at ``endpoint``: if it was away, it is back."""
        with self._lock:
            if self._endpoint == endpoint and self._gone_since is not None:
                self._gone_since, self.back_at = None, self.clock()

    def _deadline(self, gone: Endpoint) -> float | None:
        """The give-up deadline, the clock started if the store was taken for present; None when the
        location is no longer at ``gone``."""
        with self._lock:
            if self._endpoint != gone:
                return None
            if self._gave_up:
                raise StoreGone(f"the control store at {gone} is gone")
            if self._gone_since is None:
                self._gone_since = self.clock()
                log.warning("rank %d: the control store at %s is gone; waiting up to %gs for %s to name its "
                            "successor", self.rank, gone, self.timeout, self.file)
            return self._gone_since + self.timeout

    def _move(self, gone: Endpoint, named: Endpoint) -> Endpoint:
        with self._lock:
            if self._endpoint == gone:
                self._endpoint = named
                log.warning("rank %d: the control store moved from %s to %s", self.rank, gone, named)
            return self._endpoint

    def _give_up(self, gone: Endpoint) -> NoReturn:
        """No store came back: the rank ends with one line. In the main thread as a script's SystemExit; in
        the heartbeat or the repair watch, whose end nothing else would notice while the main thread trains
        peer to peer, by ending the process. Any later store call fails at once (StoreGone), so that
        nothing waits again as the process ends."""
        with self._lock:
            first, self._gave_up = not self._gave_up, True
        if not first:
            raise StoreGone(f"the control store at {gone} is gone")
        message = (f"ftrun.elastic: rank {self.rank}: the control store at {gone} is gone, and {self.file} named no "
                   f"other within {self.timeout:g}s (FTRUN_STORE_TIMEOUT)")
        if threading.current_thread() is threading.main_thread():
            raise SystemExit(message)
        # straight to stderr: the script's logging may go to a file, and this is the rank's last word
        print(message, file=sys.stderr, flush=True)
        os._exit(EXIT_STORE_GONE)


def _answers(endpoint: Endpoint) -> bool:
    """Whether a store answers at ``endpoint`` now (a refused connection says no at once)."""
    try:
        connect_store(endpoint, timeout=HANDSHAKE_DEADLINE, refused_is_final=True)
        return True
    except Exception:
        return False


class MovableStore(dist.Store):
    """A store connection that follows the control store to its new address (see the module's text).

    Every call goes to the current connection; one that fails because the store is gone waits for the
    location to move, reconnects and runs again in the new store. A call finds a move that another
    connection saw first before it runs, so it never waits on the old store's silent host.
    """

    def __init__(self, location: StoreLocation):
        super().__init__()
        self._location = location
        self._lock = threading.Lock()
        self._endpoint, self._client = self._connect(location.endpoint)

    @property
    def endpoint(self) -> Endpoint:
        """Where this connection's store is."""
        return self._endpoint

    def _call(self, op: str, *args):
        while True:
            if self._endpoint != self._location.endpoint:
                self._follow(self._endpoint)
            client, endpoint = self._client, self._endpoint
            try:
                return getattr(client, op)(*args)
            except StoreGone:
                raise
            except dist.DistError as e:
                gone = (isinstance(e, dist.DistNetworkError) or op not in KEY_WAITS
                        or self._location.named() not in (None, endpoint))
                if not gone:
                    raise  # a wait for a key timed out: the caller's business
                log.debug("rank %d: %s on the control store at %s failed: %s", self._location.rank, op, endpoint,
                          first_line(e))
                self._follow(endpoint)

    def _wait(self, keys, seconds: float) -> None:
        """A wait for ``keys``, in a thread of its own, while this one reads the file: a store whose host
        stopped answering without closing the connection (stopped, cut off) would hold the wait until
        the host came back, and the successor's store would go unwatched. The wait left behind ends when
        the old host goes or answers; nothing reads its outcome."""
        deadline = time.monotonic() + seconds
        while True:
            if self._endpoint != self._location.endpoint:
                self._follow(self._endpoint)
            client, endpoint = self._client, self._endpoint
            outcome: list[BaseException | None] = []
            done = threading.Event()

            def wait(client=client, outcome=outcome, done=done):
                try:
                    client.wait(keys, datetime.timedelta(seconds=max(0.001, deadline - time.monotonic())))
                    outcome.append(None)
                except BaseException as e:  # handed to the caller's thread
                    outcome.append(e)
                finally:
                    done.set()

            threading.Thread(target=wait, name="ftrun-store-wait", daemon=True).start()
            while not done.wait(WAIT_POLL):
                if self._location.named() not in (None, endpoint):
                    break  # another store: wait there
            if not done.is_set():
                self._location.successor(endpoint)
                continue
            error = outcome[0]
            if error is None:
                return
            if isinstance(error, dist.DistNetworkError) and not isinstance(error, StoreGone):
                self._follow(endpoint)
                continue
            raise error

    def _follow(self, gone: Endpoint) -> None:
        """Connect to the store that replaced ``gone`` (unless another thread of this connection did)."""
        with self._lock:
            if self._endpoint == gone:
                self._endpoint, self._client = self._connect(self._location.successor(gone))

    def _connect(self, target: Endpoint):
        """(endpoint, client) of the store at ``target``, or of the one the file names next."""
        while True:
            try:
                client = connect_store(target, timeout=CONNECT_ATTEMPT)
            except Exception as e:
                log.debug("rank %d: cannot reach the control store at %s: %s", self._location.rank, target,
                          first_line(e))
                target = self._location.try_again(target)
                continue
            self._location.reached(target)
            return target, client

    # the calls of torch's Store that ftrun and torch's process groups make

    def set(self, key, value):
        self._call("set", key, value)

    def get(self, key):
        return self._call("get", key)

    def add(self, key, value):
        return self._call("add", key, value)

    def compare_set(self, key, expected, desired):
        return self._call("compare_set", key, expected, desired)

    def check(self, keys):
        return self._call("check", keys)

    def delete_key(self, key):
        return self._call("delete_key", key)

    def num_keys(self):
        return self._call("num_keys")

    def wait(self, keys, timeout: datetime.timedelta | None = None):
        self._wait(keys, KEY_WAIT_TIMEOUT if timeout is None else timeout.total_seconds())

    def multi_get(self, keys):
        return self._call("multi_get", keys)

    def multi_set(self, keys, values):
        self._call("multi_set", keys, values)
