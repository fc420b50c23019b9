"""What a node publishes for ``ftrun top`` beside its status: each rank's last output lines, and a
rank's Python stack when someone asks for it. Only ``ftrun top`` reads these keys.
"""

from __future__ import annotations

import json
import threading
import time

from ftrun.agent.stacks import stack_lines
from ftrun.agent.workers import WorkerGroup
from ftrun.keys import JobKeys
from ftrun.messages import StackRequest
from ftrun.store import ControlStore, StoreUnavailable

#: a node's output lines are published at most this often (seconds), and only when they changed;
#: a stack request is looked for this often
OUTPUT_EVERY, STACK_POLL_EVERY = 2.0, 1.0
#: lines of a rank's stack published at most
STACK_LINES = 200


class TopFeed:
    """One node's output and stacks, for ``ftrun top``."""

    def __init__(self, store: ControlStore, keys: JobKeys, agent_id: str):
        self.store, self.keys = store, keys
        self.agent_id = agent_id
        #: what the output was last published for, and when it may be again
        self._output_seen: tuple = ()
        self._next_output = 0.0
        #: when to look for a stack request again, and the last one served
        self._next_stack_poll = 0.0
        self._stack_served = ""

    def publish(self, group: WorkerGroup) -> None:
        """At a keepalive: the output, when it changed; a stack, when one was asked for."""
        self._publish_output(group)
        self._serve_stack(group)

    def _publish_output(self, group: WorkerGroup) -> None:
        """Each rank's last lines: written only when some rank printed since the last time."""
        now = time.monotonic()
        seen = tuple((w.placement.rank, w.pid, w.out.lines + w.err.lines) for w in group.workers)
        if seen == self._output_seen or now < self._next_output:
            return
        self._output_seen, self._next_output = seen, now + OUTPUT_EVERY
        lines = {str(w.placement.rank): list(w.out.recent or ()) for w in group.workers}
        self.store.set_text(self.keys.agent_output(self.agent_id), json.dumps(lines, separators=(",", ":")))

    def _serve_stack(self, group: WorkerGroup) -> None:
        """``ftrun top`` asked for a rank's stack: dump it in a thread of its own (it may take seconds) and
        publish the text."""
        if time.monotonic() < self._next_stack_poll:
            return
        self._next_stack_poll = time.monotonic() + STACK_POLL_EVERY
        request = self.store.try_get(StackRequest, self.keys.stack_request(self.agent_id))
        if request is None or request.nonce == self._stack_served:
            return
        self._stack_served = request.nonce
        worker = next((w for w in group.running if w.placement.rank == request.rank), None)
        if worker is None:
            self._publish_stack(request, "", [f"rank {request.rank} has no running process on this node"])
            return
        beats = self.store.counter(self.keys.rank_heartbeat(request.rank))

        def dump():
            how, lines = stack_lines(worker, uses_library=beats > 0)
            self._publish_stack(request, how, lines)

        threading.Thread(target=dump, name=f"ftrun-stack-rank{request.rank}", daemon=True).start()

    def _publish_stack(self, request: StackRequest, how: str, lines: list[str]) -> None:
        text = json.dumps({"nonce": request.nonce, "how": how, "lines": lines[-STACK_LINES:]})
        try:
            self.store.set_text(self.keys.rank_stack(request.rank), text)
        except StoreUnavailable:
            pass  # the job is ending
