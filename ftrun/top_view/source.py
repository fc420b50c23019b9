"""What ``ftrun top`` reads from the job's store, and the requests it writes there.

Reads are on demand: the snapshot each second, the event batches from where it left off, a node's
output lines and the rank history only while a rank is opened, a stack only after asking for one. The
operator's requests are signed with the job's token (``ftrun.auth``); without one they are not sent.
Under --rdzv-backend etcd the store moves with the controller: ``follow`` finds the new one.
"""

from __future__ import annotations

import getpass
import json
import socket
import uuid
from typing import Callable

from ftrun.keys import JobKeys
from ftrun.messages import OperatorAction, OperatorRequest, StackRequest
from ftrun.store import ControlStore


class NoToken(Exception):
    """An action that changes the job, asked for without the job's token."""


def who_am_i() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


class JobSource:
    """One job's store, as ``ftrun top`` sees it."""

    def __init__(self, store: ControlStore, keys: JobKeys,
                 relocate: Callable[[], tuple[ControlStore, str] | None] | None = None):
        """``relocate``: where the store that stopped answering is now, and the controller's host there
        (None when none came in time); given only where the store moves (--rdzv-backend etcd)."""
        self.store = store
        self.keys = keys
        self.who = who_am_i()
        self.events: list[dict] = []
        self._batches_read = 0
        self._relocate = relocate

    @property
    def has_token(self) -> bool:
        return self.store.signer.enabled

    @property
    def follows(self) -> bool:
        """The store may move with the controller (--rdzv-backend etcd): one that stops answering is looked for."""
        return self._relocate is not None

    def follow(self) -> str:
        """The store stopped answering: find the controller's new one (a bounded wait) and read from it from
        now on. The new controller's host; "" when none came."""
        found = self._relocate() if self._relocate is not None else None
        if found is None:
            return ""
        self.store, host = found
        # the new controller numbers its event batches from 0 (its log starts as it takes office): the
        # events read so far are kept, and the new ones go after them
        self._batches_read = 0
        return host

    def snapshot(self) -> dict:
        text = self.store.try_text(self.keys.status)
        return json.loads(text) if text else {}

    def read_events(self) -> list[dict]:
        """Every event the controller has published so far (the new batches read and kept)."""
        count = self.store.counter(self.keys.event_count)
        while self._batches_read < count:
            text = self.store.try_text(self.keys.event_batch(self._batches_read))
            self._batches_read += 1
            self.events.extend(json.loads(text) if text else [])
        return self.events

    def output(self, agent_id: str) -> dict[str, list[str]]:
        text = self.store.try_text(self.keys.agent_output(agent_id)) if agent_id else ""
        return json.loads(text) if text else {}

    def history(self) -> dict[str, list]:
        text = self.store.try_text(self.keys.rank_history)
        return json.loads(text) if text else {}

    def ask_for_stack(self, agent_id: str, rank: int) -> str:
        """Ask the rank's agent for its stack; the nonce to wait for with :meth:`stack`."""
        nonce = uuid.uuid4().hex[:12]
        self.store.set(self.keys.stack_request(agent_id), StackRequest(rank, nonce))
        return nonce

    def stack(self, rank: int, nonce: str) -> dict | None:
        """The stack the agent published for request ``nonce`` (how, lines), or None while it has not."""
        text = self.store.try_text(self.keys.rank_stack(rank))
        answer = json.loads(text) if text else {}
        return answer if answer.get("nonce") == nonce else None

    def ask(self, action: OperatorAction, rank: int = -1, node_rank: int = -1) -> None:
        """Send a signed request to the controller (it logs it, with who asked, and answers in the event log)."""
        if not self.has_token:
            raise NoToken(action.value)
        request = OperatorRequest(action, self.who, rank, node_rank)
        self.store.append(self.keys.operator_count, self.keys.operator_request, request)
