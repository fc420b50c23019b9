"""etcd's v3 API through its JSON gateway, on the standard library: the client of ``--rdzv-backend etcd``.

Only the calls the control plane makes: read, put, a transaction, a lease, and one watch at a time. Each
call tries the members in turn, starting with the one that answered last, until one answers or the
call's deadline passes (:class:`EtcdUnavailable`: every member unreachable, or the cluster without a
quorum). Why no library: ``scripts/bench_etcd_clients.py`` measured them against this, and
``docs/high-availability.md`` says what it found.
"""

from __future__ import annotations

import base64
import http.client
import json
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterable

from ftrun.contract import Endpoint

#: the v3 API's path on etcd 3.4 and newer
API = "/v3"
#: how long one call may take, every member tried, before the cluster counts as unreachable
CALL_DEADLINE = 10.0
#: a member that does not answer within this is taken for unreachable, and the next one is tried
MEMBER_TIMEOUT = 3.0
#: the pause between two rounds over the members, while none answers
RETRY_PAUSE = 0.1
#: gRPC's codes behind the gateway for a member that cannot serve now (DEADLINE_EXCEEDED, UNAVAILABLE: its
#: own connections closing or reconnecting as members come back): tried again, as no answer is
TRANSIENT_CODES = (4, 14)
#: the same, as the gateway words it (its code is not always there)
TRANSIENT_ERRORS = ("leader", "timed out", "closing", "navailable")


class EtcdError(Exception):
    """etcd answered no: a refused request (auth, a malformed call)."""


class EtcdUnavailable(EtcdError):
    """No member answered within the deadline: all unreachable, or the cluster lost its quorum."""


class NotAGateway(EtcdError):
    """Every member answered, and none as etcd's v3 JSON gateway does (a web server on that port, an etcd
    without the v3 API): no retry will change that."""


@dataclass(frozen=True)
class EtcdOptions:
    """How to reach the cluster: its members, and TLS and auth as ``--rdzv-conf`` names them (torchrun's
    etcd rendezvous's names: ``cacert``, ``cert``, ``key``; ``user`` and ``password`` for etcd's auth)."""

    endpoints: tuple[Endpoint, ...]
    cacert: str = ""
    cert: str = ""
    key: str = ""
    user: str = ""
    password: str = ""

    @property
    def tls(self) -> bool:
        return bool(self.cacert or self.cert)

    def describe(self) -> str:
        return ",".join(str(e) for e in self.endpoints)


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int = 0


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def _kv(raw: dict) -> KeyValue:
    return KeyValue(base64.b64decode(raw["key"]).decode(), base64.b64decode(raw.get("value", "")),
                    int(raw.get("create_revision", 0)), int(raw.get("mod_revision", 0)), int(raw.get("lease", 0)))


def prefix_end(prefix: str) -> str:
    """The end of the key range of every key starting with ``prefix`` (etcd's range_end)."""
    raw = prefix.encode()
    return (raw[:-1] + bytes([raw[-1] + 1])).decode()


# -- what a transaction compares and does -------------------------------------------------------------

def created_at(key: str, revision: int) -> dict:
    """The key exists and was created at ``revision`` (0: the key does not exist)."""
    return {"key": _b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": str(revision)}


def value_is(key: str, value: str | bytes) -> dict:
    return {"key": _b64(key), "result": "EQUAL", "target": "VALUE", "value": _b64(value)}


def put(key: str, value: str | bytes, lease: int = 0) -> dict:
    request: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
    if lease:
        request["lease"] = str(lease)
    return {"request_put": request}


def read(key: str) -> dict:
    return {"request_range": {"key": _b64(key)}}


def delete(key: str) -> dict:
    return {"request_delete_range": {"key": _b64(key)}}


@dataclass(frozen=True)
class TxnResult:
    succeeded: bool
    #: the key-values the branch taken read (``read`` operations), in order
    read: tuple[KeyValue | None, ...]
    revision: int


class EtcdClient:
    """One client, shared by threads: each thread keeps its own connection."""

    def __init__(self, options: EtcdOptions, deadline: float = CALL_DEADLINE, member_timeout: float = MEMBER_TIMEOUT):
        if not options.endpoints:
            raise EtcdError("no etcd endpoint given")
        self.options = options
        self.deadline = deadline
        #: how long one member may take to answer (a member without a quorum holds a write for etcd's own
        #: request timeout, 5 s and more: a client that must see the quorum back at once gives up sooner)
        self.member_timeout = member_timeout
        self._local = threading.local()
        #: the member that answered last: the next call starts there
        self._current = 0
        self._token = ""
        self._token_lock = threading.Lock()
        self._ssl = self._ssl_context() if options.tls else None

    def _ssl_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=self.options.cacert or None)
        if self.options.cert:
            context.load_cert_chain(self.options.cert, self.options.key or None)
        return context

    # -- the key-value calls -------------------------------------------------------------------------

    def get(self, key: str) -> KeyValue | None:
        kvs = self._call("/kv/range", {"key": _b64(key)}).get("kvs") or []
        return _kv(kvs[0]) if kvs else None

    def get_prefix(self, prefix: str) -> list[KeyValue]:
        answer = self._call("/kv/range", {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))})
        return [_kv(raw) for raw in answer.get("kvs") or []]

    def put(self, key: str, value: str | bytes, lease: int = 0) -> int:
        """Write ``key``; returns the cluster's revision after the write."""
        request = put(key, value, lease)["request_put"]
        return int(self._call("/kv/put", request)["header"]["revision"])

    def delete_prefix(self, prefix: str) -> int:
        answer = self._call("/kv/deleterange", {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))})
        return int(answer.get("deleted", 0))

    def txn(self, compare: Iterable[dict], success: Iterable[dict], failure: Iterable[dict] = ()) -> TxnResult:
        answer = self._call("/kv/txn", {"compare": list(compare), "success": list(success), "failure": list(failure)})
        read: list[KeyValue | None] = []
        for response in answer.get("responses") or []:
            if "response_range" in response:
                kvs = response["response_range"].get("kvs") or []
                read.append(_kv(kvs[0]) if kvs else None)
        return TxnResult(bool(answer.get("succeeded")), tuple(read), int(answer["header"]["revision"]))

    # -- leases -----------------------------------------------------------------------------------------

    def grant(self, ttl: float) -> int:
        """A lease of ``ttl`` seconds (etcd counts whole seconds: at least one)."""
        return int(self._call("/lease/grant", {"TTL": max(1, round(ttl))})["ID"])

    def keepalive(self, lease: int) -> int:
        """Renew the lease; returns the seconds it has left (0: it lapsed, and its keys are gone)."""
        answer = self._call("/lease/keepalive", {"ID": str(lease)})
        return int((answer.get("result") or answer).get("TTL", 0))

    def revoke(self, lease: int) -> None:
        """Give the lease up now: its keys go at once."""
        try:
            self._call("/lease/revoke", {"ID": str(lease)})
        except EtcdError as e:
            if "not found" not in str(e):
                raise

    # -- watching -------------------------------------------------------------------------------------------

    def revision(self) -> int:
        """The cluster's revision now."""
        return int(self._call("/kv/range", {"key": _b64("\0"), "count_only": True})["header"]["revision"])

    def wait_change(self, key: str, after_revision: int, timeout: float, prefix: bool = False) -> bool:
        """Wait until ``key`` (with ``prefix``: any key under it) changes (is written or deleted) after
        ``after_revision``, for at most ``timeout`` seconds; True if it did. One member is watched: if it
        goes, the wait ends early (False)."""
        request = {"key": _b64(key), "start_revision": str(after_revision + 1)}
        if prefix:
            request["range_end"] = _b64(prefix_end(key))
        body = {"create_request": request}
        endpoint = self.options.endpoints[self._current]
        connection = self._connect(endpoint, timeout=max(0.05, timeout))
        end = time.monotonic() + timeout
        try:
            connection.request("POST", API + "/watch", json.dumps(body), self._headers())
            response = connection.getresponse()
            if response.status != 200:
                return False
            while time.monotonic() < end:
                connection.sock.settimeout(max(0.05, end - time.monotonic()))
                line = response.readline()
                if not line:
                    return False
                result = json.loads(line).get("result") or {}
                if result.get("events"):
                    return True
        except (OSError, http.client.HTTPException, ValueError):
            return False
        finally:
            connection.close()
        return False

    # -- the wire ---------------------------------------------------------------------------------------------

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self._token:
            headers["Authorization"] = self._token
        return headers

    def _connect(self, endpoint: Endpoint, timeout: float = 0.0) -> http.client.HTTPConnection:
        timeout = timeout or self.member_timeout
        if self._ssl is not None:
            return http.client.HTTPSConnection(endpoint.host, endpoint.port, timeout=timeout, context=self._ssl)
        return http.client.HTTPConnection(endpoint.host, endpoint.port, timeout=timeout)

    def _connection(self, index: int) -> http.client.HTTPConnection:
        connections = self._local.__dict__.setdefault("connections", {})
        if index not in connections:
            connections[index] = self._connect(self.options.endpoints[index])
        return connections[index]

    def _drop(self, index: int) -> None:
        connection = self._local.__dict__.get("connections", {}).pop(index, None)
        if connection is not None:
            connection.close()

    def _call(self, path: str, body: dict) -> dict:
        if self.options.user and not self._token:
            self._authenticate()
        answer = self._post(path, body)
        if "token" in _refusal(answer) and self.options.user:
            self._authenticate()  # the token expired (simple tokens last minutes): once more with a new one
            answer = self._post(path, body)
        refusal = _refusal(answer)
        if refusal:
            raise EtcdError(f"etcd refused {path}: {refusal}")
        return answer

    def _authenticate(self) -> None:
        with self._token_lock:
            self._token = ""
            answer = self._post("/auth/authenticate", {"name": self.options.user, "password": self.options.password})
            if "token" not in answer:
                raise EtcdError(f"etcd refused user {self.options.user!r}: {answer.get('error', answer)}")
            self._token = answer["token"]

    def _post(self, path: str, body: dict) -> dict:
        """One call, at the first member that answers; a member's "no leader" or "timed out" answer counts
        as no answer (the cluster has no quorum there), and is tried again until the deadline. When every
        member answered but none as etcd's gateway, :class:`NotAGateway` at once."""
        data = json.dumps(body)
        end = time.monotonic() + self.deadline
        count = len(self.options.endpoints)
        last = "no member tried"
        while True:
            strangers = []
            for step in range(count):
                index = (self._current + step) % count
                endpoint = self.options.endpoints[index]
                try:
                    connection = self._connection(index)
                    connection.request("POST", API + path, data, self._headers())
                    response = connection.getresponse()
                    raw = response.read()
                except (OSError, http.client.HTTPException) as e:
                    self._drop(index)
                    last = f"{endpoint}: {e or type(e).__name__}"
                    continue
                answer = _answer(raw)
                if response.status < 500 and (answer is None or not _from_etcd(answer)):
                    # a 404 with an empty body (another web server on the port): its KeyError on a field of
                    # the answer was a 32-line traceback (issue 40)
                    strangers.append(f"{endpoint} is not an etcd v3 gateway (HTTP {response.status} for {API}{path})")
                    last = strangers[-1]
                    continue
                answer = answer or {}
                error, code = _refusal(answer), answer.get("code")
                if response.status >= 500 or code in TRANSIENT_CODES or any(m in error for m in TRANSIENT_ERRORS):
                    last = f"{endpoint}: {error or response.status}"
                    continue
                self._current = index
                return answer
            if len(strangers) == count:
                raise NotAGateway("; ".join(strangers))
            if time.monotonic() > end:
                raise EtcdUnavailable(f"no etcd member answered within {self.deadline:.3g}s ({last})")
            time.sleep(RETRY_PAUSE)


def _answer(raw: bytes) -> dict | None:
    """The JSON object an answer holds; None when it holds none."""
    try:
        answer = json.loads(raw or b"{}")
    except ValueError:
        return None
    return answer if isinstance(answer, dict) else None


def _refusal(answer: dict) -> str:
    """Why etcd said no ("" when it did not): etcd 3.4's gateway says it as "error", 3.5's as "message"."""
    if "header" in answer or "result" in answer:
        return ""
    return str(answer.get("error") or answer.get("message") or "")


def _from_etcd(answer: dict) -> bool:
    """The answer is the gateway's: a result (its header, or a stream's result) or an error of etcd's."""
    return any(field in answer for field in ("header", "result", "error", "message"))


def reachable(options: EtcdOptions, deadline: float) -> str:
    """"" if the cluster answers a read within ``deadline``; else why not, in a line."""
    try:
        EtcdClient(options, deadline).get("ftrun/ping")
    except EtcdError as e:
        return str(e)
    except socket.gaierror as e:
        return f"cannot resolve an etcd member: {e}"
    return ""
