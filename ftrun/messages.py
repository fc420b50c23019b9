"""Messages that travel through the store, as frozen dataclasses serialised to JSON.

Never pickle: a store is reachable by anyone who can reach its port.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import signal
import threading
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Iterator, TypeVar

from ftrun.errors import ExitCode

T = TypeVar("T")


def to_json(message: Any) -> str:
    return json.dumps(_plain(message), sort_keys=True)


def _plain(value):
    """``dataclasses.asdict`` without its deep copies (a node's status is written twice a second, a
    layout names every node): what each type is, is looked up once per type."""
    cls = type(value)
    if cls in _SCALARS:
        return value
    names = _names(cls)
    if names is not None:
        return {name: _plain(getattr(value, name)) for name in names}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, frozenset):
        return sorted(_plain(v) for v in value)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


_SCALARS = frozenset({str, int, float, bool, type(None)})


@functools.cache
def _names(cls) -> tuple[str, ...] | None:
    """A dataclass's field names; None for any other type."""
    return tuple(f.name for f in dataclasses.fields(cls)) if dataclasses.is_dataclass(cls) else None


def from_json(cls: type[T], text: str | bytes) -> T:
    if dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen:  # type: ignore[attr-defined]
        with _BUILDING:
            return _built(cls, text)
    return _build(cls, json.loads(text))


#: one thread builds a frozen message at a time, so that threads reading the same bytes at once wait
#: for the first one's instead of each missing the cache and building their own
_BUILDING = threading.Lock()


@functools.lru_cache(maxsize=32)
def _built(cls, text: str | bytes):
    """A frozen message read again as the same bytes is built once: the layout at each generation, and
    the rendezvous result and layout of a thousand nodes that every simulated agent of a process reads
    (scripts/bench_control_plane.py), which would otherwise be parsed once per agent on shared cores
    (when 256 agents woke at once, up to 30 of a process missed the cache together, and their
    rendezvous took 3 s instead of 0.7)."""
    return _build(cls, json.loads(text))


def _build(cls, data: dict):
    fields = _fields(cls)
    # a newer sender may add fields; older readers ignore them
    return cls(**{name: fields[name](value) for name, value in data.items() if name in fields})


@functools.cache
def _fields(cls) -> dict[str, Callable[[Any], Any]]:
    """How to rebuild each field of a message class from JSON, worked out once per class: an agent
    reads the rendezvous result and the layout of a thousand nodes, a controller their statuses."""
    return {name: _converter(kind) for name, kind in typing.get_type_hints(cls).items()}


def _converter(kind) -> Callable[[Any], Any]:
    if dataclasses.is_dataclass(kind):
        return lambda value: _build(kind, value) if isinstance(value, dict) else value
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return kind
    if typing.get_origin(kind) is types.UnionType:  # X | None
        return _converter(next(arg for arg in typing.get_args(kind) if arg is not type(None)))
    if typing.get_origin(kind) is tuple:
        item = _converter(typing.get_args(kind)[0])
        return lambda value: tuple(item(v) for v in value) if isinstance(value, list) else value
    if typing.get_origin(kind) is frozenset:
        item = _converter(typing.get_args(kind)[0])
        return lambda value: frozenset(item(v) for v in value) if isinstance(value, list) else value
    return _same


def _same(value):
    return value


@dataclass(frozen=True)
class RankTableDevice:
    """One device a node offers its ranks, as the rank tables name it."""

    #: the logical id the runtime counts in
    index: int
    #: the physical id (npu-smi's Phy-ID; HCCL's device_id), or -1 when the backend has none
    physical: int = -1
    #: the chip's RoCE address (hccn_tool, or --device-ips), or ""
    ip: str = ""
    #: on an A3 SuperPoD, the chip's super device id (SDID) and its super pod's id; -1 elsewhere
    super_device_id: int = -1
    super_pod_id: int = -1


@dataclass(frozen=True)
class JoinRecord:
    """What an agent says of itself when it joins the rendezvous."""

    agent_id: str
    host: str
    pid: int
    nproc: int
    #: the node rank the user asked for with --node-rank, or -1 to be assigned one
    requested_node_rank: int = -1
    #: --preflight: what is wrong with this node's devices ("" when fit to train)
    preflight: str = ""
    #: the host's IP address (the HCCL rank table's server_id), and its usable devices, ascending
    host_ip: str = ""
    devices: tuple[RankTableDevice, ...] = ()
    #: --preflight: its slowest device's time for a small matmul, seconds (0: not measured)
    matmul_s: float = 0.0
    #: --preflight: "HOST:PORT" of its listener on its data address for the pairs' bandwidth check ("": none)
    data_endpoint: str = ""
    #: ``ftrun probe`` across nodes: each device's matmul time, seconds (the launch sends only the slowest)
    matmul_each: tuple[float, ...] = ()


@dataclass(frozen=True)
class NodeSlot:
    node_rank: int
    agent_id: str
    host: str
    nproc: int
    first_rank: int
    host_ip: str = ""
    #: the devices the node's local ranks take at a fresh start, in order
    devices: tuple[RankTableDevice, ...] = ()


@dataclass(frozen=True)
class NodeLayout:
    """Which agent holds which node rank now: the rendezvous's nodes, updated at each takeover."""

    nodes: tuple[NodeSlot, ...] = ()
    #: how many layouts the controller published up to this one (0: none yet)
    version: int = 0

    @property
    def world_size(self) -> int:
        return sum(n.nproc for n in self.nodes)

    def change_from(self, older: NodeLayout) -> NodeLayoutChange:
        """What an agent that holds ``older`` (this layout's version less one) reads to hold this one."""
        before = {n.node_rank: n for n in older.nodes}
        now = {n.node_rank for n in self.nodes}
        return NodeLayoutChange(self.version, tuple(n for n in self.nodes if before.get(n.node_rank) != n),
                                tuple(sorted(set(before) - now)))

    def changed(self, change: NodeLayoutChange) -> NodeLayout:
        """This layout with ``change`` (the next version's) made."""
        nodes = {n.node_rank: n for n in self.nodes if n.node_rank not in change.removed}
        nodes.update((n.node_rank, n) for n in change.nodes)
        return NodeLayout(tuple(nodes[rank] for rank in sorted(nodes)), change.version)


@dataclass(frozen=True)
class NodeLayoutChange:
    """The nodes that differ between two layouts one version apart: a takeover's is one node, so that
    an agent that holds the layout reads O(1) bytes at a later generation instead of the whole."""

    version: int
    #: the slots that are new or changed, and the node ranks no longer in the layout
    nodes: tuple[NodeSlot, ...] = ()
    removed: tuple[int, ...] = ()


@dataclass(frozen=True)
class Placement:
    """What the rendezvous tells one agent (in its own key, and its doorbell's text): its place, and the
    job's size, in O(1) bytes; or why the rendezvous failed. The whole layout is read when the first
    generation starts (``keys.layout``)."""

    #: its node (node_rank >= 0) or its place as a spare (-1); None: it came too late or one too many
    slot: NodeSlot | None = None
    world_size: int = 0
    node_count: int = 0
    error: str = ""
    #: the exit code that goes with the error (ExitCode.RENDEZVOUS, or DEVICE for a failed preflight)
    exit_code: int = 3


@dataclass(frozen=True)
class RendezvousResult:
    """The controller's answer to the rendezvous: who is which node, or why it failed."""

    nodes: tuple[NodeSlot, ...] = ()
    world_size: int = 0
    error: str = ""
    #: the exit code that goes with the error (ExitCode.RENDEZVOUS, or DEVICE for a failed preflight)
    exit_code: int = 3

    #: standby agents (spare nodes): node_rank and first_rank -1 until one takes over a lost node
    spares: tuple[NodeSlot, ...] = ()
    #: --preflight: agents left out of the job (a spare took their place), and why
    left_out: tuple[tuple[str, str], ...] = ()

    def places(self) -> Iterator[tuple[str, Placement]]:
        """Each agent's Placement, by agent id: nodes, then spares, then those left out (why, as an error)."""
        for slot in self.nodes + self.spares:
            yield slot.agent_id, Placement(slot, self.world_size, len(self.nodes))
        for agent_id, why in self.left_out:
            yield agent_id, Placement(None, self.world_size, len(self.nodes), why, ExitCode.DEVICE)

    @property
    def outcome(self) -> Placement:
        """What an agent that has no place of its own reads: the job's size, or the error."""
        return Placement(None, self.world_size, len(self.nodes), self.error, self.exit_code)


@dataclass(frozen=True)
class RankState:
    """One local rank as its agent sees it, for the status view."""

    rank: int
    local_rank: int
    pid: int
    alive: bool
    #: how many times this rank's process was started again (job- or process-level)
    restarts: int = 0
    #: its last committed step, and seconds since its heartbeat counter last moved (None: not yet; the
    #: worker library keeps both): the agent reads them for its hang check and sums them up here, so
    #: that the controller reads one status per node and never a key per rank
    step: int | None = None
    heartbeat_age: float | None = None
    #: its recent step, compute and wait times as the worker library wrote them (``ftrun.step_times``;
    #: "" without the library), forwarded for the straggler watch
    times: str = ""
    #: the collective it waits in now, as the worker library wrote it (``ftrun.step_times.collective_text``;
    #: "" without the library, or from a process that is not this one), forwarded for the stall's line
    collective: str = ""
    #: the outside view, for any script: its CPU seconds per wall second over the agent's last samples
    #: (``ftrun.agent.cpu_time``; None: not yet a window's worth), and the last step its output said
    #: (``ftrun.detection.output_steps``; None: none yet) with the seconds since
    cpu: float | None = None
    output_step: int | None = None
    output_age: float | None = None


@dataclass(frozen=True)
class DeviceState:
    """One of the node's devices: ok, resetting, preseparated or isolated (and why)."""

    index: int
    health: str = "ok"
    reason: str = ""


@dataclass(frozen=True)
class NodeStatus:
    """What an agent publishes about its node at each keepalive, for the status view."""

    agent_id: str
    host: str
    generation: int = -1
    ranks: tuple[RankState, ...] = ()
    standbys: int = 0
    devices: tuple[DeviceState, ...] = ()
    #: the data network's probe (``ftrun.detection.reach``): the nodes this one probed, and those it could not reach
    probed: tuple[int, ...] = ()
    unreachable: tuple[int, ...] = ()
    #: a spare's id on the probe's ring (below zero; None for a node, whose id is its node rank)
    probe_id: int | None = None


class CommandKind(str, enum.Enum):
    START = "start"  # spawn this generation's workers
    STOP = "stop"  # stop this generation's workers and acknowledge
    EXIT = "exit"  # stop everything, acknowledge and leave with exit_code
    REPLACE = "replace"  # process level: kill (if alive) and respawn these ranks for this generation
    TAKEOVER = "takeover"  # a spare (agent_id) becomes node node_rank, whose agent was lost and is fenced


@dataclass(frozen=True)
class Command:
    kind: CommandKind
    generation: int
    #: TORCHELASTIC_RESTART_COUNT for the generation's workers; START only
    restart_count: int = 0
    #: the job-wide budget (TORCHELASTIC_MAX_RESTARTS); START only
    max_restarts: int = 0
    #: HOST:PORT of the generation's own worker store (MASTER_ADDR/MASTER_PORT); START, REPLACE
    worker_store: str = ""
    #: HOST:PORT of the generation's MindSpore scheduler (MS_SCHED_HOST/MS_SCHED_PORT), started by the agent
    #: beside the worker store; START of a --framework mindspore job only ("" otherwise)
    scheduler: str = ""
    #: REPLACE: the global ranks to respawn
    ranks: tuple[int, ...] = ()
    exit_code: int = 0
    reason: str = ""
    #: TAKEOVER: the node rank handed over, and the spare agent that takes it
    node_rank: int = -1
    agent_id: str = ""
    #: the layout's version as the command was published (-1: not said): an agent that holds it asks
    #: the store nothing of the layout
    layout: int = -1
    #: START, REPLACE: the world size of the generation before (0: none), which FTRUN_PREVIOUS_WORLD_SIZE
    #: says (``ElasticJob.on_resize``)
    previous_world_size: int = 0


class OperatorAction(str, enum.Enum):
    RESTART = "restart"  # replace one rank through the process-level path, as a drill
    DRAIN = "drain"  # move a node's ranks to a spare; the node then leaves
    STOP = "stop"  # stop the job


@dataclass(frozen=True)
class OperatorRequest:
    """What a person asked of the job from ``ftrun top`` (signed with the job's token)."""

    action: OperatorAction
    #: user@host of whoever asked, for the event log
    who: str
    rank: int = -1
    node_rank: int = -1


@dataclass(frozen=True)
class StackRequest:
    """``ftrun top`` asks a rank's agent for its Python stack; ``nonce`` tells one request from the next."""

    rank: int
    nonce: str


class ReportKind(str, enum.Enum):
    WORKER_FAILED = "worker_failed"  # one or more local workers ended badly
    SUCCEEDED = "succeeded"  # every local worker of the generation exited 0
    STOPPED = "stopped"  # acknowledges a STOP: no worker of the generation is left
    INTERRUPTED = "interrupted"  # the agent got SIGINT/SIGTERM from its user
    EXITED = "exited"  # acknowledges an EXIT: the agent is leaving
    CLEARED = "cleared"  # acknowledges a REPLACE: the failed ranks' processes are dead and reaped
    NODE_UNUSABLE = "node_unusable"  # no usable device is left on the node for its ranks: a node-level fault
    LINK_DOWN = "link_down"  # the node's data link went dark (its OS's link state); detail: which and why
    LINK_UP = "link_up"  # that link carries packets again


@dataclass(frozen=True)
class WorkerFailure:
    """One worker that ended badly, with what the summary needs to name it."""

    #: the global rank; -1 for a MindSpore job's scheduler (``ftrun.mindspore.SCHEDULER_RANK``), which holds none
    rank: int
    local_rank: int
    node_rank: int
    host: str
    pid: int
    exit_code: int | None
    #: signal name (``SIGKILL``) when the worker was killed by a signal
    signal: str = ""
    stderr_tail: tuple[str, ...] = ()
    #: the Python exception recorded in the worker's error file, if any
    error: str = ""
    timestamp: float = 0.0
    generation: int = 0
    #: what kind of fault it was: exit, signal, oom, exception, device, hang, setting (ftrun.detection.exits),
    #: collective (a collective failed while the process lived: ``ftrun.contract.CollectiveFailure``), or link
    #: (the node's data link dark and back: ``ftrun.controller.links``)
    cause: str = ""
    #: the classification's one line of evidence ("no heartbeat for 3.2s", "UCE ERROR in its output")
    detail: str = ""
    #: the fault level of a device error seen in the worker's output (RestartBusiness), else ""
    level: str = ""

    def describe(self) -> str:
        if self.cause == "collective":  # the process lived (the online level): no pid or exit code to give
            return f"rank {self.rank} on node {self.node_rank} ({self.host}): a collective failed ({self.detail})"
        if self.cause == "link":  # a data link dark and back (ftrun.controller.links): every process lived
            return f"node {self.node_rank} ({self.host}): {self.detail}"
        how = f"killed by {self.signal}" if self.signal else f"exit code {self.exit_code}"
        who = f"rank {self.rank} (local rank {self.local_rank})" if self.rank >= 0 else "the MindSpore scheduler"
        text = f"{who} on node {self.node_rank} ({self.host}), pid {self.pid}: {how}"
        return f"{text} ({self.cause}: {self.detail})" if self.detail else text


@dataclass(frozen=True)
class Report:
    kind: ReportKind
    node_rank: int
    generation: int
    failures: tuple[WorkerFailure, ...] = ()
    #: exit code the agent wants for the job (INTERRUPTED: 130 or 143)
    exit_code: int = 0
    detail: str = ""
    #: the reporting agent: a fenced agent's word about a node it no longer holds is ignored
    agent_id: str = ""


def signal_name(returncode: int) -> str:
    """``SIGKILL`` for a Popen return code of -9; empty for a normal exit."""
    if returncode >= 0:
        return ""
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"
