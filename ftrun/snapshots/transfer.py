"""Moving snapshots between nodes: each agent serves its copies and takes its peers' replicas.

One request per connection. The server opens with a fresh nonce; the client's request line is
sealed with the job's token over that nonce (``ftrun.auth``), so a request cannot be forged or
replayed; then the snapshot's bytes follow (put) or come back (get). The bytes carry their own
checksum, which the receiver verifies before it keeps or loads anything.
"""

from __future__ import annotations

import json
import logging
import secrets
import socket
import socketserver
import threading
from typing import Callable

from ftrun.auth import Forged, Signer
from ftrun.ports import PortRange, listen_in_range

log = logging.getLogger(__name__)
#: the longest request line
MAX_LINE = 4096
#: how long one transfer may stall before it is given up
TIMEOUT = 60.0


class TransferError(Exception):
    """A transfer that failed: the peer is unreachable, refused the request, or went away mid-way."""


def _key(nonce: str) -> str:
    return f"snapshot/{nonce}"


class SnapshotServer:
    """Serves ``get`` (a file ``read(path)`` allows) and ``put`` (a replica ``receive(name, blob)`` keeps).

    ``limit`` bounds what a put may send (the bytes are held in memory until verified).
    """

    def __init__(self, bind: str, signer: Signer, read: Callable[[str], bytes],
                 receive: Callable[[str, bytearray], None], limit: int, ports: PortRange | None = None):
        owner = self

        class Handler(socketserver.StreamRequestHandler):
            timeout = TIMEOUT

            def handle(self):
                owner._handle(self.rfile, self.wfile)

        class Server(socketserver.ThreadingTCPServer):
            address_family = socket.AF_INET6 if ":" in bind else socket.AF_INET
            daemon_threads = True

            def server_bind(self):  # a port of --worker-port-range, or any
                self.socket.close()
                self.socket = listen_in_range(bind, ports, self.request_queue_size)
                self.server_address = self.socket.getsockname()

            def server_activate(self):
                pass  # listening already

        self.signer, self.read, self.receive, self.limit = signer, read, receive, limit
        self._server = Server((bind, 0), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="ftrun-snapshot-server", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handle(self, rfile, wfile) -> None:
        nonce = secrets.token_hex(16)
        try:
            wfile.write(nonce.encode() + b"\n")
            wfile.flush()
            line = rfile.readline(MAX_LINE)
            request = json.loads(self.signer.open(_key(nonce), line.strip()))
            if request.get("op") == "get":
                data = self.read(str(request["path"]))
                wfile.write(json.dumps({"nbytes": len(data)}).encode() + b"\n")
                wfile.write(data)
            elif request.get("op") == "put":
                nbytes = int(request["nbytes"])
                if not 0 < nbytes <= self.limit:
                    raise TransferError(f"a replica of {nbytes} bytes is over this node's limit of {self.limit}")
                blob = bytearray(nbytes)
                _read_into(rfile, blob)
                self.receive(str(request["name"]), blob)
                wfile.write(b'{"ok": true}\n')
            else:
                raise TransferError("unknown request")
        except Forged as e:
            log.warning("refused a snapshot request: %s", e)
            _try_write(wfile, {"error": "refused: not signed with the job's token"})
        except OSError:
            pass  # the client went away
        except Exception as e:  # a bad request or a replica that does not verify: the answer says why
            _try_write(wfile, {"error": str(e) or type(e).__name__})


def _try_write(wfile, reply: dict) -> None:
    try:
        wfile.write(json.dumps(reply).encode() + b"\n")
    except OSError:
        pass


def _read_into(rfile, blob: bytearray) -> None:
    view, done = memoryview(blob), 0
    while done < len(blob):
        got = rfile.readinto(view[done:])
        if not got:
            raise TransferError(f"the sender went away after {done} of {len(blob)} bytes")
        done += got


def _request(address: str, signer: Signer, request: dict, payload=None, timeout: float = TIMEOUT):
    host, _, port = address.rpartition(":")
    try:
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
    except (OSError, ValueError) as e:
        raise TransferError(f"cannot reach the snapshot server at {address}: {e}") from None
    with sock, sock.makefile("rb") as rfile:
        try:
            nonce = rfile.readline(MAX_LINE).decode().strip()
            sock.sendall(signer.seal(_key(nonce), json.dumps(request)).encode() + b"\n")
            if payload is not None:
                sock.sendall(payload)
            reply = json.loads(rfile.readline(MAX_LINE) or b"{}")
            if "error" in reply or not reply:
                raise TransferError(f"{address}: {reply.get('error', 'closed the connection')}")
            if "nbytes" not in reply:
                return reply, None
            blob = bytearray(int(reply["nbytes"]))
            _read_into(rfile, blob)
            return reply, blob
        except (OSError, ValueError) as e:
            raise TransferError(f"the transfer with {address} failed: {e}") from None


def put(address: str, signer: Signer, name: str, blob) -> None:
    """Send a snapshot's bytes to the agent at ``address``, to keep as replica ``name``."""
    _request(address, signer, {"op": "put", "name": name, "nbytes": len(blob)}, memoryview(blob))


def get(address: str, signer: Signer, path: str) -> bytearray:
    """The bytes of the file ``path`` on the agent at ``address``."""
    _, blob = _request(address, signer, {"op": "get", "path": path})
    if blob is None:
        raise TransferError(f"{address} sent no data for {path}")
    return blob
