"""The job's control store: a torch ``TCPStore`` that speaks JSON messages.

Hosting or joining it, with a deadline on every step: a TCPStore client that
reaches a port where something other than a store listens waits forever, so
the handshake runs under a guard thread.
"""

from __future__ import annotations

import atexit
import datetime
import errno
import logging
import queue
import socket
import threading
import time
from typing import Callable, TypeVar

import psutil

from ftrun.auth import Forged, Signer
from ftrun.contract import Endpoint
from ftrun.errors import RendezvousError, UsageError
from ftrun.keys import CONTROL_STORE
from ftrun.messages import from_json, to_json
from ftrun.ports import PortRange, listen_in_range

log = logging.getLogger(__name__)
T = TypeVar("T")

#: how long a client waits for one store operation once connected
OPERATION_TIMEOUT = datetime.timedelta(seconds=60)
#: a listener that accepts but does not finish the store handshake within this is not a store
HANDSHAKE_DEADLINE = 3.0
#: how long an agent that found its port taken tries to reach a store there before it calls the port
#: another program's: a few handshakes, since a TCPStore client's connect now and then stalls for its
#: own 5 s timeout when many connect at once (one in 25 of a burst, measured on a 2-core machine)
PROBE_DEADLINE = 12.0
#: a TCPStore client's own connect timeout (its handshake with a silent listener ignores it)
CONNECT_TIMEOUT = 5.0
#: connections the store's socket queues before it accepts them (every agent and rank connects at once)
LISTEN_BACKLOG = 2048


#: the most keys (and bytes) one multi_set, and the most keys one multi_get, sends: the store's server
#: takes time that grows with the square of a message's keys. Measured, until the server has done: a
#: repair's announcement to 16,384 ranks (a one-byte key each) 155 ms in one multi_set, 7 ms in messages
#: of 64; a restore plan for each of 1,024 nodes (5.7 kB each) 240 ms in one, 5-10 ms in messages of at
#: most 64 kB; 1,024 agents' doorbells 4.4 ms, 1.4 ms; 16,384 keys read in one multi_get 163 ms, in 16
#: of 1,024, 30 ms. A multi_set is sent without waiting for an answer: its messages cost no round trips.
MULTI_SET_KEYS, MULTI_SET_BYTES, MULTI_GET_KEYS = 64, 64 * 1024, 1024


class StoreUnavailable(Exception):
    """The control store stopped answering: its host is gone or the network is cut."""


class GuardedCalls:
    """Store calls made in a thread of their own, each given ``timeout`` seconds: a store whose host stopped
    answering without closing the connection (its process stopped, the network cut) holds a TCPStore
    call for good, whatever the client's timeout, and the caller must be able to give up on it. A call
    that did not return in time leaves that thread behind (it ends when the host answers or goes), and
    every later call fails at once: the connection is given up with it."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._stuck = ""
        threading.Thread(target=self._serve, name="ftrun-store-calls", daemon=True).start()

    def _serve(self) -> None:
        while True:
            fn, args, box, done = self._calls.get()
            try:
                box.append((True, fn(*args)))
            except BaseException as e:  # handed to the caller
                box.append((False, e))
            done.set()

    def call(self, fn: Callable[..., T], *args) -> T:
        if self._stuck:
            raise TimeoutError(self._stuck)
        box: list = []
        done = threading.Event()
        self._calls.put((fn, args, box, done))
        if not done.wait(self.timeout):
            self._stuck = f"no answer within {self.timeout:g}s"
            raise TimeoutError(self._stuck)
        ok, value = box[0]
        if ok:
            return value
        raise value


class ControlStore:
    """The job's store, seen through the few operations ftrun needs.

    Messages (``set``/``get``, and texts written with ``signed=True``) are sealed by ``signer`` with the
    job's token when it has one (``ftrun.auth``); one that does not open is ignored and logged, once
    per key. Counters and the worker library's texts are not signed.
    """

    def __init__(self, store, endpoint: Endpoint, is_host: bool, signer: Signer | None = None,
                 call_timeout: float = 0.0):
        """``call_timeout``: each call gives up after that many seconds (``GuardedCalls``); 0 waits as
        long as the store client does."""
        self.raw = store
        self._guard = GuardedCalls(call_timeout) if call_timeout else None
        self.endpoint = endpoint
        self.is_host = is_host
        self.signer = signer or Signer()
        self._forged: set[str] = set()
        #: keys known to exist (``readings`` creates the others first)
        self._existing: set[str] = set()
        #: the static rendezvous's first worker store, which the controller takes over (``_open_static``)
        self.worker_store = None

    def counter(self, key: str) -> int:
        return self._call(self.raw.add, key, 0)

    def add(self, key: str, amount: int = 1) -> int:
        return self._call(self.raw.add, key, amount)

    def set(self, key: str, message) -> None:
        self._call(self.raw.set, key, self.sealed(key, message))

    def sealed(self, key: str, message) -> str:
        """The text ``set`` writes under ``key`` (the controller's doorbells carry a command's so)."""
        return self.signer.seal(key, to_json(message))

    def get(self, cls: type[T], key: str) -> T:
        """The message under ``key``; ``Forged`` when it is not one of the job's own."""
        return self._decode(cls, key, self._call(self.raw.get, key))

    def _decode(self, cls: type[T], key: str, raw: bytes) -> T:
        body = self.signer.open(key, raw)
        try:
            return from_json(cls, body)
        except (ValueError, TypeError, KeyError) as e:
            raise Forged(f"not a {cls.__name__} ({type(e).__name__})") from None

    def try_get(self, cls: type[T], key: str) -> T | None:
        """The message, or None while the key is unset or when what it holds is ignored as forged."""
        if not self._call(self.raw.check, [key]):
            return None
        return self._get_or_ignore(cls, key)

    def counters(self, keys: list[str]) -> list[int]:
        """Many counters in one round trip per 1,024 (``multi_get``): the keepalives of every node."""
        return self.readings(keys, [])[0]

    def create(self, counters: list[str], texts: list[str]) -> None:
        """Counters at 0 and empty texts, with no round trip (``set_each``), for the keys not yet known
        to exist: for keys nobody else writes yet (an existing one is set anew)."""
        fresh = [key for key in counters + texts if key not in self._existing]
        if fresh:
            zero = set(counters)
            self.set_each(fresh, ["0" if key in zero else "" for key in fresh])
            self._existing.update(fresh)

    def readings(self, counters: list[str], texts: list[str]) -> tuple[list[int], list[str]]:
        """Counters and unsigned texts together in one round trip per 1,024 (``multi_get``): an agent's keepalive
        reads the controller's counter and its ranks' heartbeats and steps so. ``multi_get`` waits for
        a missing key, so each key is created first, once: a counter at 0, a text empty (``compare_set``
        leaves alone one written meanwhile); a text never written reads ""."""
        for key in counters:
            if key not in self._existing:
                self.counter(key)
                self._existing.add(key)
        for key in texts:
            if key not in self._existing:
                self._call(self.raw.compare_set, key, "", "")
                self._existing.add(key)
        if not counters and not texts:
            return [], []
        values = self._multi_get(counters + texts)
        return ([int(value) for value in values[:len(counters)]],
                [value.decode("utf-8", "replace") for value in values[len(counters):]])

    def messages(self, cls: type[T], keys: list[str]) -> list[T | None]:
        """Many messages, None for a key not yet set (or forged): two round trips (``check``,
        ``multi_get``) when every key is set, one per key otherwise."""
        if not keys:
            return []
        found = self.all_set(cls, keys)
        return found if found is not None else [self.try_get(cls, key) for key in keys]

    def all_set(self, cls: type[T], keys: list[str]) -> list[T | None] | None:
        """The messages under ``keys`` once every one is set (None for one ignored as forged), in two
        round trips; None, after one (``check``), while any is missing: a poll of many keys that costs
        one request however many there are."""
        return self._open_all(cls, keys) if self._call(self.raw.check, keys) else None

    def _open_all(self, cls: type[T], keys: list[str]) -> list[T | None]:
        """The messages under ``keys`` (all set), in a round trip per MULTI_GET_KEYS; None for one ignored
        as forged."""
        return [self.opened(cls, key, raw) for key, raw in zip(keys, self._multi_get(keys))]

    def opened(self, cls: type[T], key: str, raw: bytes) -> T | None:
        """The message ``raw`` holds, read from ``key`` (or carried by a doorbell for it); None when it
        is ignored as forged."""
        try:
            return self._decode(cls, key, raw)
        except Forged as e:
            self._ignore(key, e)
            return None

    def wait_for(self, key: str, seconds: float) -> bool:
        """Whether ``key`` was set within ``seconds`` (True at once when it already is)."""
        from torch.distributed import DistStoreError

        try:
            if self._guard is not None:
                seconds = min(seconds, self._guard.timeout / 2)  # the guard's wait covers it
                self._guard.call(self.raw.wait, [key], datetime.timedelta(seconds=seconds))
            else:
                self.raw.wait([key], datetime.timedelta(seconds=seconds))
            return True
        except DistStoreError:  # the wait timed out; a store that went raises DistNetworkError
            return False
        except Exception as e:
            raise StoreUnavailable(f"the control store at {self.endpoint} stopped answering ({_first_line(e)})") from e

    def set_text(self, key: str, text: str, signed: bool = False) -> None:
        self._call(self.raw.set, key, self.signer.seal(key, text) if signed else text)

    def set_each(self, keys: list[str], texts: list[str]) -> None:
        """Unsigned (or already sealed) texts under their keys, in order, with no round trip
        (``multi_set``, in messages of at most MULTI_SET_KEYS keys and about MULTI_SET_BYTES bytes)."""
        first, size = 0, 0
        for end, (key, text) in enumerate(zip(keys, texts)):
            if end > first and (end - first == MULTI_SET_KEYS or size + len(key) + len(text) > MULTI_SET_BYTES):
                self._call(self.raw.multi_set, keys[first:end], texts[first:end])
                first, size = end, 0
            size += len(key) + len(text)
        if first < len(keys):
            self._call(self.raw.multi_set, keys[first:], texts[first:])

    def _multi_get(self, keys: list[str]) -> list[bytes]:
        """``multi_get`` in requests of at most MULTI_GET_KEYS keys: one round trip for up to 1,024."""
        return [value for first in range(0, len(keys), MULTI_GET_KEYS)
                for value in self._call(self.raw.multi_get, keys[first:first + MULTI_GET_KEYS])]

    def set_texts(self, keys: list[str], text: str) -> None:
        """The same unsigned (or already sealed) text under many keys, with no round trip (``set_each``)."""
        if keys:
            self.set_each(keys, [text] * len(keys))

    def try_text(self, key: str, signed: bool = False) -> str:
        """The key's text, or "" while it is unset (or, ``signed``, when it is forged)."""
        if not self._call(self.raw.check, [key]):
            return ""
        raw = self._call(self.raw.get, key)
        if not signed:
            return raw.decode("utf-8", "replace")
        try:
            return self.signer.open(key, raw)
        except Forged as e:
            self._ignore(key, e)
            return ""

    def _get_or_ignore(self, cls: type[T], key: str) -> T | None:
        """The message under ``key`` (which is set), or None when it is ignored as forged."""
        return self.opened(cls, key, self._call(self.raw.get, key))

    def _ignore(self, key: str, problem: Forged) -> None:
        if key not in self._forged:
            self._forged.add(key)
            log.warning("ignoring a message at %s in the store: %s", key, problem)

    def append(self, count_key: str, item_key: Callable[[int], str], message) -> int:
        """Append to a sequence: reserve the next index, then write the item under it."""
        index = self.add(count_key) - 1
        self.set(item_key(index), message)
        return index

    def read_from(self, count_key: str, item_key: Callable[[int], str], cls: type[T], start: int) -> list[T | None]:
        """Items ``start..`` of a sequence that are fully written, in order; None in the place of one
        ignored as forged (the caller counts it, and skips it). Three round trips when every new item
        is written (a thousand agents' join records), one more per item otherwise."""
        keys = [item_key(index) for index in range(start, self.counter(count_key))]
        if len(keys) > 1 and self._call(self.raw.check, keys):
            return self._open_all(cls, keys)
        items: list[T | None] = []
        for key in keys:
            if not self._call(self.raw.check, [key]):
                break  # reserved but not yet written; read it next time
            items.append(self._get_or_ignore(cls, key))
        return items

    def read_range(self, item_key: Callable[[int], str], cls: type[T], start: int, stop: int) -> list[T | None]:
        """Items ``start..stop-1`` of a sequence, known to be written (a doorbell rang for them): one
        round trip; None in the place of one ignored as forged."""
        return self._open_all(cls, [item_key(index) for index in range(start, stop)]) if stop > start else []

    def _call(self, fn, *args):
        try:
            return self._guard.call(fn, *args) if self._guard is not None else fn(*args)
        except Exception as e:  # torch raises DistNetworkError/DistStoreError/RuntimeError
            raise StoreUnavailable(f"the control store at {self.endpoint} stopped answering ({_first_line(e)})") from e


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def is_local_host(host: str) -> bool:
    """Whether ``host`` names this machine (loopback, one of its addresses or its name)."""
    try:
        addresses = {str(info[4][0]) for info in socket.getaddrinfo(host, None)}
    except (socket.gaierror, UnicodeError):
        raise UsageError(f"cannot resolve host name '{host}'") from None
    local = {a.address for addrs in psutil.net_if_addrs().values() for a in addrs}
    return any(a.startswith("127.") or a == "::1" or a in local for a in addresses)


#: --store-bind values that mean every interface
ALL_INTERFACES = ("0.0.0.0", "*", "all")


def bind_address(host: str, bind: str = "", several_nodes: bool = True) -> str:
    """The address a store hosted for ``host`` listens on: ``bind`` when given (one of
    ALL_INTERFACES: every interface), else the address ``host`` names. A name that resolves to
    loopback here but must be reached from other nodes (Debian maps a machine's own name to
    127.0.1.1) gets every interface instead: binding loopback would shut the other nodes out."""
    if bind:
        return "0.0.0.0" if bind in ALL_INTERFACES else bind
    try:
        address = str(socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0])
    except (socket.gaierror, UnicodeError, IndexError):
        raise UsageError(f"cannot resolve host name '{host}'") from None
    named_loopback = host not in ("localhost", "127.0.0.1") and not host.startswith("127.")
    if address.startswith("127.") and several_nodes and named_loopback:
        log.info("%s is a loopback address here; the store listens on every interface (--store-bind to choose)", host)
        return "0.0.0.0"
    return address


def host_store(endpoint: Endpoint, bind: str = "", several_nodes: bool = True):
    """A TCPStore server on ``endpoint``'s port, listening where ``bind_address`` says; ``None`` if
    the port is taken there."""
    return _store_server(endpoint.host, bind_address(endpoint.host, bind, several_nodes), endpoint.port)


def _store_server(host: str, address: str, port: int, ports: PortRange | None = None):
    """A TCPStore server on a socket of ftrun's own, bound to ``address`` (torch alone binds every
    interface, and lets two servers on one machine both think they bound a port). Port 0: a free
    one of ``ports`` (--worker-port-range), or any."""
    from torch.distributed import TCPStore

    try:
        if port == 0:
            listener = listen_in_range(address, ports, LISTEN_BACKLOG)
        else:
            listener = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
            try:
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                listener.bind((address, port))
                listener.listen(LISTEN_BACKLOG)
            except OSError:
                listener.close()
                raise
    except OSError as e:
        if e.errno == errno.EADDRINUSE and port:
            return None
        raise UsageError(f"cannot host the store on {address}:{port or ports or 'a free port'}: "
                         f"{e.strerror or e}") from None
    port = listener.getsockname()[1]
    try:  # the store owns the socket from here on
        return TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=OPERATION_TIMEOUT,
                        master_listen_fd=listener.detach())
    except Exception as e:
        raise UsageError(f"cannot host the store on {address}:{port}: {_first_line(e)}") from None


def open_control_store(endpoint: Endpoint, is_host: bool | None, timeout: float, signer: Signer | None = None,
                       bind: str = "", several_nodes: bool = True, worker_port: int = 0,
                       ports: PortRange | None = None) -> ControlStore:
    """Host the job's store (``is_host`` True, or None and the port is free here) or join it.
    ``worker_port``: the static rendezvous, whose port belongs to the workers (``_open_static``)."""
    if worker_port:
        return _open_static(endpoint, bool(is_host), timeout, signer, bind_address(endpoint.host, bind, several_nodes),
                            ports)
    wants_host = is_host if is_host is not None else is_local_host(endpoint.host)
    if wants_host:
        server = host_store(endpoint, bind, several_nodes)
        if server is not None:
            return ControlStore(server, endpoint, is_host=True, signer=signer)
        # taken: by the agent that bound first (join it), unless this agent had to host
        if is_host or not _is_store(endpoint):
            raise UsageError(f"port {endpoint.port} on {endpoint.host} is already in use by another program")
    return ControlStore(connect_store(endpoint, timeout), endpoint, is_host=False, signer=signer)


def _open_static(endpoint: Endpoint, is_host: bool, timeout: float, signer: Signer | None, address: str,
                 ports: PortRange | None) -> ControlStore:
    """The static rendezvous (--master-addr/--master-port P): the workers must see MASTER_PORT P, as
    under torchrun, since a firewall may open only P.

    Why not the control store on P with each generation's worker keys under a prefix: a plain env://
    script's TCPStore client (TORCHELASTIC_USE_AGENT_STORE) writes its keys unprefixed, so every
    generation would read and write the same keys, the stale-key hang ftrun exists to avoid. So P
    serves each generation's own worker store instead: the controller closes it and opens a fresh
    one on P for the next generation once every worker of the old one is gone
    (``start_worker_store``), and no generation ever reads another's keys. The control store moves
    to a port of --worker-port-range (or any free one), which each worker store names under
    ``CONTROL_STORE``: the other agents (and ``ftrun status``) reach P first and follow it there.
    Generation 0's worker store is opened here, so that the others find it before any generation
    starts; the controller takes it over (``worker_store``)."""
    if is_host:
        workers = _store_server(endpoint.host, address, endpoint.port)
        if workers is None:
            raise UsageError(f"port {endpoint.port} on {endpoint.host} is already in use by another program")
        control = _store_server(endpoint.host, address, 0, ports)
        workers.set(CONTROL_STORE, str(control.port))
        store = ControlStore(control, Endpoint(endpoint.host, control.port), is_host=True, signer=signer)
        store.worker_store = workers
        return store
    control_endpoint = follow_to_control_store(endpoint, timeout)
    return ControlStore(connect_store(control_endpoint, timeout), control_endpoint, is_host=False, signer=signer)


def follow_to_control_store(endpoint: Endpoint, timeout: float) -> Endpoint:
    """Where the control store of the static rendezvous at ``endpoint`` listens, as the worker store
    there says (waiting for it to say so)."""
    deadline = time.monotonic() + timeout
    while True:
        first = connect_store(endpoint, max(0.1, deadline - time.monotonic()))
        try:
            first.wait([CONTROL_STORE], datetime.timedelta(seconds=max(0.1, min(1.0, deadline - time.monotonic()))))
            return Endpoint(endpoint.host, int(first.get(CONTROL_STORE)))
        except Exception as e:  # not yet written, or the store closed between generations: ask again
            if time.monotonic() >= deadline:
                raise RendezvousError(f"the store at {endpoint} does not say where the job's control store "
                                      f"is ({_first_line(e)})") from None
        finally:
            del first
        time.sleep(0.1)


def _is_store(endpoint: Endpoint) -> bool:
    try:
        connect_store(endpoint, timeout=PROBE_DEADLINE)
        return True
    except RendezvousError:
        return False


def connect_store(endpoint: Endpoint, timeout: float, refused_is_final: bool = False):
    """A TCPStore client of ``endpoint``, retrying until ``timeout`` seconds have passed.
    ``refused_is_final``: a refused connection (the host is up, nothing listens) ends the wait at
    once, for a reader such as ``ftrun status``; agents wait, since the store's host may start later."""
    # Imported before the deadline counts, and outside the handshake's guard: a first import of torch is
    # this process's own work, not the store's silence (6 s on a 2-core machine at a load of 8.6; made in
    # the guard, it used up ftrun status's whole --timeout, and the view left with nothing shown)
    from torch.distributed import TCPStore  # noqa: F401

    deadline = time.monotonic() + timeout
    last_error = "nothing listens there"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RendezvousError(f"cannot reach the rendezvous endpoint {endpoint} within {timeout:g}s: {last_error}")
        try:
            with socket.create_connection((endpoint.host, endpoint.port), timeout=min(left, 2.0)):
                pass
        except (socket.gaierror, UnicodeError):
            raise UsageError(f"cannot resolve host name '{endpoint.host}'") from None
        except OSError as e:  # refused, unreachable, timed out: the host may not be up yet
            last_error = e.strerror or str(e)
            if refused_is_final and e.errno == errno.ECONNREFUSED:
                raise RendezvousError(f"cannot reach the store at {endpoint}: {last_error}") from None
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
            continue
        store = _guarded(lambda: _tcp_client(endpoint), min(left, HANDSHAKE_DEADLINE))
        if store is not None:
            return store
        last_error = "something listens there but does not answer as a store"
        if time.monotonic() + 0.2 >= deadline:
            continue
        time.sleep(0.2)


def _tcp_client(endpoint: Endpoint):
    from torch.distributed import TCPStore

    store = TCPStore(endpoint.host, endpoint.port, is_master=False, timeout=datetime.timedelta(seconds=CONNECT_TIMEOUT))
    store.set_timeout(OPERATION_TIMEOUT)
    return store


#: how long a connect may stay in TCPStore's constructor and still come out: c10d retries a handshake
#: that failed until its timeout, and the last try runs past it (8.1 s measured, timeout 5 s)
CONNECT_SETTLE = 2 * CONNECT_TIMEOUT + 1.0
#: connect threads still running, with when their TCPStore gives up (if it ever does)
_CONNECTING: dict[threading.Thread, float] = {}
#: set as the interpreter ends: no connect starts after
_EXITING = threading.Event()


def _guarded(fn: Callable[[], T], deadline: float) -> T | None:
    """Run ``fn`` in a daemon thread; ``None`` if it fails or has not returned by ``deadline``.

    A thread left behind is waited for as the interpreter ends (``_settle_connects``)."""
    result: list = []
    if _EXITING.is_set():
        return None

    def run():
        try:
            result.append(fn())
        except Exception as e:
            log.debug("store client failed: %s", _first_line(e))
        finally:
            _CONNECTING.pop(threading.current_thread(), None)

    thread = threading.Thread(target=run, name="ftrun-store-connect", daemon=True)
    _CONNECTING[thread] = time.monotonic() + CONNECT_SETTLE
    thread.start()
    thread.join(deadline)
    return result[0] if result else None


@atexit.register
def _settle_connects() -> None:
    """Wait, up to its own timeout, for each connect still in TCPStore's constructor.

    One that returns once the interpreter is ending aborts the process ("terminate called without an
    active exception": the thread is unwound through C++ frames), where a slow name lookup has delayed
    a connect past its guard; one still blocked after its timeout is blocked for good, and harmless.
    No connect starts from now on (``_EXITING``): a retry would be one more to wait for."""
    _EXITING.set()
    while _CONNECTING:
        for thread, until in list(_CONNECTING.items()):
            thread.join(max(0.0, until - time.monotonic()))
            _CONNECTING.pop(thread, None)


#: how long the static rendezvous's port may take to come free for the next generation's worker store
REOPEN_DEADLINE = 10.0


def start_worker_store(host: str, bind: str, ports: PortRange | None = None, port: int = 0, control_port: int = 0):
    """A fresh TCPStore for one generation's workers, listening on ``bind``; returns (store, port).

    torch's env:// rendezvous assumes a new store per attempt when it shares the
    agent's store (TORCHELASTIC_USE_AGENT_STORE): giving it one is what keeps a
    restarted group from reading the previous attempt's keys. ``port``: the static
    rendezvous's own port, free again once the previous generation's store is closed
    (see ``_open_static``); the store names ``control_port`` there. Else a port of ``ports``.
    """
    if not port:
        store = _store_server(host, bind, 0, ports)
        return store, store.port
    deadline = time.monotonic() + REOPEN_DEADLINE
    while (store := _store_server(host, bind, port)) is None:
        if time.monotonic() >= deadline:
            raise RendezvousError(f"port {port} did not come free for the next generation's worker store")
        time.sleep(0.05)
    store.set(CONTROL_STORE, str(control_port))
    return store, port
