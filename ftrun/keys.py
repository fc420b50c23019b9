"""Every store key ftrun uses, built in one place.

All keys of a job live under ``ftrun/<run_id>/``. The control sequences
(commands, reports) only grow: nothing is ever overwritten, and every message
names its generation. The workers' own keys never land here: each generation
gets a fresh worker store (``ftrun.store.start_worker_store``), so no key is
reused across generations (torchrun's restarted workers hang on stale keys:
pytorch issues 135712 and 167288).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class JobKeys:
    """The keys of one job, by run id."""

    run_id: str

    @property
    def root(self) -> str:
        return f"ftrun/{self.run_id}"

    # rendezvous: agents append join records; the controller publishes the result
    @property
    def arrivals(self) -> str:
        return f"{self.root}/rdzv/arrivals"

    def join(self, index: int) -> str:
        return f"{self.root}/rdzv/join/{index}"

    @property
    def rendezvous_result(self) -> str:
        return f"{self.root}/rdzv/result"

    # liveness counters: a reader notices progress with its own clock, so hosts need no clock sync
    @property
    def controller_heartbeat(self) -> str:
        return f"{self.root}/ctl/heartbeat"

    def node_heartbeat(self, node_rank: int) -> str:
        return f"{self.root}/node/{node_rank}/heartbeat"

    # commands: controller -> agents, an append-only sequence
    @property
    def command_count(self) -> str:
        return f"{self.root}/cmd/count"

    def command(self, seq: int) -> str:
        return f"{self.root}/cmd/{seq}"

    # reports: agents -> controller, an append-only sequence
    @property
    def report_count(self) -> str:
        return f"{self.root}/report/count"

    def report(self, seq: int) -> str:
        return f"{self.root}/report/{seq}"
