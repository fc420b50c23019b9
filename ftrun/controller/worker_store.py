"""The worker store's life: a fresh c10d store per generation, hosted in the controller's process (and,
for a MindSpore job, a fresh port for the generation's scheduler beside it).

It is what the ranks' ``env://`` rendezvous (and gloo's, NCCL's, HCCL's bootstrap) goes through. Each
generation gets a store of its own, so that no key is reused across generations: the previous
generation's workers are all stopped when the next one starts, so its store goes (and, under the
static rendezvous, its port comes free for the next one's).
"""

from __future__ import annotations

import socket

from ftrun.ports import PortRange, free_port
from ftrun.store import ControlStore, start_worker_store


class WorkerStores:
    """Opens each generation's worker store, and closes the one before."""

    def __init__(self, control: ControlStore, advertised_host: str, bind: str, port: int = 0,
                 ports: PortRange | None = None):
        self._control = control
        self._host = advertised_host
        #: where each store listens
        self._bind = bind
        #: the static rendezvous's port, where every generation's worker store listens (0: a fresh port
        #: each, from ``ports``); generation 0's is open already (ftrun.store._open_static)
        self._port, self._ports = port, ports
        self._first = getattr(control, "worker_store", None)
        self._store = None
        #: the current generation's store, as "host:port" ("" before the first START)
        self.address = ""

    def fresh(self) -> str:
        """The next generation's store, open; its address. The previous one is closed."""
        self._store = None
        if self._first is not None:
            self._store, port = self._first, self._port
            self._first = self._control.worker_store = None
        else:
            self._store, port = start_worker_store(self._host, self._bind, self._ports, self._port,
                                                   self._control.endpoint.port)
        self.address = f"{self._host}:{port}"
        return self.address

    def scheduler(self) -> str:
        """A fresh port for the generation's MindSpore scheduler, on this node (the agent that hosts the
        controller starts it there): "host:port", the host as an address (MindSpore's cluster takes no
        names)."""
        port = free_port(self._ports, self._bind if self._bind not in ("", "0.0.0.0", "::") else "127.0.0.1")
        try:
            host = socket.gethostbyname(self._host)
        except OSError:
            host = self._host
        return f"{host}:{port}"

    def close(self) -> None:
        self._store = None
