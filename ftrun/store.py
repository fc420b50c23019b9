"""The job's control store: a torch ``TCPStore`` that speaks JSON messages.

Hosting or joining it, with a deadline on every step: a TCPStore client that
reaches a port where something other than a store listens waits forever, so
the handshake runs under a guard thread.
"""

from __future__ import annotations

import datetime
import logging
import socket
import threading
import time
from typing import Callable, TypeVar

import psutil

from ftrun.config import Endpoint
from ftrun.errors import RendezvousError, UsageError
from ftrun.messages import from_json, to_json

log = logging.getLogger(__name__)
T = TypeVar("T")

#: how long a client waits for one store operation once connected
OPERATION_TIMEOUT = datetime.timedelta(seconds=60)
#: a listener that accepts but does not finish the store handshake within this is not a store
HANDSHAKE_DEADLINE = 3.0


class StoreUnavailable(Exception):
    """The control store stopped answering: its host is gone or the network is cut."""


class ControlStore:
    """The job's store, seen through the few operations ftrun needs."""

    def __init__(self, store, endpoint: Endpoint, is_host: bool):
        self.raw = store
        self.endpoint = endpoint
        self.is_host = is_host

    def counter(self, key: str) -> int:
        return self._call(self.raw.add, key, 0)

    def add(self, key: str, amount: int = 1) -> int:
        return self._call(self.raw.add, key, amount)

    def set(self, key: str, message) -> None:
        self._call(self.raw.set, key, to_json(message))

    def get(self, cls: type[T], key: str) -> T:
        return from_json(cls, self._call(self.raw.get, key))

    def try_get(self, cls: type[T], key: str) -> T | None:
        if not self._call(self.raw.check, [key]):
            return None
        return self.get(cls, key)

    def set_text(self, key: str, text: str) -> None:
        self._call(self.raw.set, key, text)

    def try_text(self, key: str) -> str:
        """The key's text, or "" while it is unset."""
        if not self._call(self.raw.check, [key]):
            return ""
        return self._call(self.raw.get, key).decode("utf-8", "replace")

    def append(self, count_key: str, item_key: Callable[[int], str], message) -> int:
        """Append to a sequence: reserve the next index, then write the item under it."""
        index = self.add(count_key) - 1
        self.set(item_key(index), message)
        return index

    def read_from(self, count_key: str, item_key: Callable[[int], str], cls: type[T], start: int) -> list[T]:
        """Items ``start..`` of a sequence that are fully written."""
        items = []
        for index in range(start, self.counter(count_key)):
            item = self.try_get(cls, item_key(index))
            if item is None:
                break  # reserved but not yet written; read it next time
            items.append(item)
        return items

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except Exception as e:  # torch raises DistNetworkError/DistStoreError/RuntimeError
            raise StoreUnavailable(f"the control store at {self.endpoint} stopped answering ({_first_line(e)})") from e


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def is_local_host(host: str) -> bool:
    """Whether ``host`` names this machine (loopback, one of its addresses or its name)."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except socket.gaierror:
        raise UsageError(f"cannot resolve host name '{host}'") from None
    local = {a.address for addrs in psutil.net_if_addrs().values() for a in addrs}
    return any(a.startswith("127.") or a == "::1" or a in local for a in addresses)


def host_store(endpoint: Endpoint):
    """Bind a TCPStore server on ``endpoint``'s port; ``None`` if the port is taken."""
    from torch.distributed import TCPStore

    try:
        return TCPStore(
            endpoint.host, endpoint.port, is_master=True, wait_for_workers=False, timeout=OPERATION_TIMEOUT
        )
    except Exception as e:
        if "EADDRINUSE" in str(e) or "address already in use" in str(e):
            return None
        raise UsageError(f"cannot host the store on {endpoint}: {_first_line(e)}") from None


def open_control_store(endpoint: Endpoint, is_host: bool | None, timeout: float) -> ControlStore:
    """Host the job's store (``is_host`` True, or None and the port is free here) or join it."""
    wants_host = is_host if is_host is not None else is_local_host(endpoint.host)
    if wants_host:
        server = host_store(endpoint)
        if server is not None:
            return ControlStore(server, endpoint, is_host=True)
        # taken: by the agent that bound first (join it), unless this agent had to host
        if is_host or not _is_store(endpoint):
            raise UsageError(f"port {endpoint.port} on {endpoint.host} is already in use by another program")
    return ControlStore(connect_store(endpoint, timeout), endpoint, is_host=False)


def _is_store(endpoint: Endpoint) -> bool:
    try:
        connect_store(endpoint, timeout=HANDSHAKE_DEADLINE)
        return True
    except RendezvousError:
        return False


def connect_store(endpoint: Endpoint, timeout: float):
    """A TCPStore client of ``endpoint``, retrying until ``timeout`` seconds have passed."""
    deadline = time.monotonic() + timeout
    last_error = "nothing listens there"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RendezvousError(f"cannot reach the rendezvous endpoint {endpoint} within {timeout:g}s: {last_error}")
        try:
            with socket.create_connection((endpoint.host, endpoint.port), timeout=min(left, 2.0)):
                pass
        except socket.gaierror:
            raise UsageError(f"cannot resolve host name '{endpoint.host}'") from None
        except OSError as e:  # refused, unreachable, timed out: the host may not be up yet
            last_error = e.strerror or str(e)
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

    store = TCPStore(endpoint.host, endpoint.port, is_master=False, timeout=datetime.timedelta(seconds=5))
    store.set_timeout(OPERATION_TIMEOUT)
    return store


def _guarded(fn: Callable[[], T], deadline: float) -> T | None:
    """Run ``fn`` in a daemon thread; ``None`` if it fails or has not returned by ``deadline``."""
    result: list = []

    def run():
        try:
            result.append(fn())
        except Exception as e:
            log.debug("store client failed: %s", _first_line(e))

    thread = threading.Thread(target=run, name="ftrun-store-connect", daemon=True)
    thread.start()
    thread.join(deadline)
    return result[0] if result else None


def start_worker_store(host: str):
    """A fresh TCPStore for one generation's workers; returns (store, port).

    torch's env:// rendezvous assumes a new store per attempt when it shares the
    agent's store (TORCHELASTIC_USE_AGENT_STORE): giving it one is what keeps a
    restarted group from reading the previous attempt's keys.
    """
    from torch.distributed import TCPStore

    store = TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=OPERATION_TIMEOUT)
    return store, store.port
