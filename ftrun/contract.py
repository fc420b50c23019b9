"""What the launcher and the worker library agree on: the endpoint of a store, the worker's environment,
the milestones of a repair and why one falls back to job level, the snapshot folder's token.

This module depends on nothing but the standard library, so that anything may import it and nothing
can pull it into an import circle: the worker library, which runs inside the user's training process,
reads its contract here without loading the launcher (tests/unit/test_contract.py holds the rule).
"""

from __future__ import annotations

import enum
import json
import os
from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


class EndpointError(ValueError):
    """An endpoint's text that names no host and port (the launcher reports it as a usage error)."""


def parse_endpoint(text: str, default_port: int, flag: str = "--rdzv-endpoint") -> Endpoint:
    """``host:port``, ``host`` (then ``default_port``) or ``[v6-address]:port``; ``flag`` names the
    text's origin in the error."""
    text = text.strip()
    if not text:
        raise EndpointError(f"{flag} is empty")
    host, sep, port_text = text.rpartition(":")
    if not sep or text.endswith("]"):
        host, port_text = text, str(default_port)
    host = host.strip("[]")
    if not host:
        raise EndpointError(f"{flag} '{text}' has no host name")
    try:
        host.encode("idna")  # socket calls raise UnicodeError, not gaierror, for a name they cannot take
    except UnicodeError:
        raise EndpointError(f"{flag} '{text}': '{host}' is not a host name or address") from None
    try:
        port = int(port_text)
    except ValueError:
        raise EndpointError(f"{flag} '{text}': port '{port_text}' is not a number") from None
    if not 0 < port < 65536:
        raise EndpointError(f"{flag}: port {port} is outside 1-65535")
    return Endpoint(host, port)


class Milestone(enum.Enum):
    """What the ranks count in the store during a process-level repair, each rank once per generation.

    The controller waits on three of them to end a phase (ENV_CLEAR ends on the agents' CLEARED reports
    instead: they reap the failed processes); ARRIVED is the ranks' own.
    """

    STOPPED = "stopped"  # every healthy rank left the old process group
    ARRIVED = "arrived"  # the rank reached the new generation: the last to arrive marks its groups ready
    JOINED = "joined"  # every rank is in the new generation's process group
    RESUMED = "resumed"  # every rank holds the consistent step's state and trains on


class Fallback(enum.Enum):
    """Why the ranks' rollback cannot finish a process-level repair, so the job falls back to a
    job-level restart. An expected outcome, not a bug: the ranks tell the controller which (with a
    :class:`RollbackFailure`) and wait to be stopped, and the controller says it once, with what would
    have avoided it (``controller/narrator.py``). Each value is the reason as a person reads it."""

    #: some replica set lost every rank, and the ranks take no snapshots to go back to
    NO_SNAPSHOTS = "no healthy replica holds the training state, and the ranks take no snapshots"
    #: the same, and no step's snapshot is held by every rank (the fault came before the first one)
    NO_COMMON_SNAPSHOT = ("no healthy replica holds the training state, and no step's snapshot is held in "
                          "memory by every rank")
    #: the snapshot every rank was to go back to could not be read
    SNAPSHOT_UNREADABLE = "no healthy replica holds the training state, and a snapshot to go back to is unreadable"


@dataclass(frozen=True)
class RollbackFailure:
    """What a rank tells the controller when its rollback falls back to job level (``JobKeys.rollback_failure``)."""

    cause: Fallback
    #: whether the script's layout has a replica dimension (replica sets of more than one rank)
    replicas: bool = False
    #: the error behind it, for SNAPSHOT_UNREADABLE
    detail: str = ""

    @property
    def reason(self) -> str:
        return f"{self.cause.value} ({self.detail})" if self.detail else self.cause.value

    def to_text(self) -> str:
        # plain JSON, unsigned: a rank without snapshots holds no token to sign with
        return json.dumps({"cause": self.cause.name, "replicas": self.replicas, "detail": self.detail})

    @classmethod
    def from_text(cls, text: str) -> "RollbackFailure | None":
        """None for a text that is not one (the controller then reads it as the reason itself)."""
        try:
            data = json.loads(text)
            return cls(Fallback[data["cause"]], bool(data.get("replicas")), str(data.get("detail", "")))
        except (ValueError, TypeError, KeyError):
            return None


@dataclass(frozen=True)
class CollectiveFailure:
    """What a rank tells the controller the moment one of its collectives fails while its own process
    lives (``JobKeys.collective_failure``): a link cut or reset, a timeout, a communicator error. With
    no process dead the controller repairs in place (the online level, docs/recovery.md)."""

    rank: int
    #: the generation whose collective failed
    generation: int
    #: the error, in one line
    error: str
    #: when it failed (the rank's wall clock): the repair's detection is timed from it
    at: float = 0.0

    def describe(self) -> str:
        return f"a collective of rank {self.rank} failed while every process lived ({self.error})"

    def to_text(self) -> str:
        # plain JSON, unsigned, as RollbackFailure: a rank without snapshots holds no token to sign with
        return json.dumps({"rank": self.rank, "generation": self.generation, "error": self.error, "at": self.at})

    @classmethod
    def from_text(cls, text: str) -> "CollectiveFailure | None":
        """None for a text that is not one."""
        try:
            data = json.loads(text)
            return cls(int(data["rank"]), int(data["generation"]), str(data["error"])[:200], float(data.get("at", 0.0)))
        except (ValueError, TypeError, KeyError):
            return None


class RelayFolder:
    """The files through which a rank that cannot read the control store (a MindSpore rank: its python
    has no torch, and the store is torch's ``TCPStore``) talks to the controller through its agent
    (FTRUN_RELAY_DIR, one folder per node). A rank writes its committed step into ``progress.r<rank>``,
    and on a second line its step times (``ftrun.step_times.StepTimes.to_text``), which the agent puts where
    a torch rank's heartbeat puts them (the status view, the summary's step, the stragglers).
    For a process-level repair, the agent writes what the controller announced: ``target``
    (the newest generation) and ``ready-<g>`` ("ready" once every rank arrived in generation g,
    "superseded" once a newer one was announced). A rank writes one file per milestone it reaches,
    ``g<g>.r<rank>.<milestone>``, and ``g<g>.r<rank>.failure`` (a :class:`RollbackFailure`) when its
    rollback falls back, and ``g<g>.r<rank>.collective`` (a :class:`CollectiveFailure`) when a collective of
    its step failed while it lived; the agent counts each in the store once and deletes it. For a repair
    that replaces no process (the online level) the agent writes ``online-<g>`` before the target.

    Every file is written whole under a temporary name and renamed, so that a reader sees all of it or
    nothing."""

    #: what a rank's failure file is called in place of a milestone
    FAILURE = "failure"
    #: what a rank's file for a failed collective (its process alive) is called in place of a milestone
    COLLECTIVE = "collective"
    #: what a ``ready-<g>`` file says once every rank arrived in generation g (else "superseded")
    READY = "ready"

    def __init__(self, path: str):
        self.path = path

    @property
    def target(self) -> str:
        return os.path.join(self.path, "target")

    def ready(self, generation: int) -> str:
        return os.path.join(self.path, f"ready-{generation}")

    def online(self, generation: int) -> str:
        """Present when the repair into ``generation`` replaces no process (the online level)."""
        return os.path.join(self.path, f"online-{generation}")

    def progress(self, rank: int) -> str:
        """A rank's committed step, then its step times."""
        return os.path.join(self.path, f"progress.r{rank}")

    def names(self) -> list[str]:
        """What the folder holds now (one listing, which a reader may parse in several ways)."""
        return os.listdir(self.path)

    def ranks_with_progress(self, names: list[str] | None = None) -> list[int]:
        """The ranks that wrote their progress (among ``names``, the folder's listing, by default read now)."""
        split = (name.split(".") for name in (self.names() if names is None else names))
        return sorted(int(parts[1][1:]) for parts in split
                      if len(parts) == 2 and parts[0] == "progress" and parts[1][1:].isdigit())

    def reached(self, generation: int, rank: int, what: str) -> str:
        """A rank's file for ``what`` (a Milestone's value, FAILURE or COLLECTIVE) in ``generation``."""
        return os.path.join(self.path, f"g{generation}.r{rank}.{what}")

    def reports(self, names: list[str] | None = None) -> list[tuple[str, int, int, str]]:
        """The ranks' files waiting to be counted, oldest generation first: (path, generation, rank, what)
        (among ``names``, the folder's listing, by default read now)."""
        found = []
        for name in self.names() if names is None else names:
            parts = name.split(".")
            if len(parts) == 3 and parts[0][:1] == "g" and parts[1][:1] == "r":
                try:
                    found.append((os.path.join(self.path, name), int(parts[0][1:]), int(parts[1][1:]), parts[2]))
                except ValueError:
                    continue  # not one of ours
        return sorted(found, key=lambda report: report[1])

    def write(self, path: str, text: str) -> None:
        part = f"{path}.{os.getpid()}.part"
        with open(part, "w") as f:
            f.write(text)
        os.replace(part, path)

    def read(self, path: str) -> str:
        """The file's text; "" when there is none yet."""
        try:
            with open(path) as f:
                return f.read()
        except FileNotFoundError:
            return ""


#: the file in an agent's snapshot folder that holds the job's token (its ranks sign with it)
SNAPSHOT_TOKEN_FILE = "token"


@dataclass(frozen=True)
class DeviceAssignment:
    """The rank's device, as the agent's device allocator placed it (none on CPU)."""

    #: the device's logical id on the node (FTRUN_DEVICE)
    device: int
    #: the same device as the worker's runtime counts it, among those it sees (FTRUN_DEVICE_INDEX); it
    #: differs from LOCAL_RANK after a rank moved off an isolated device
    index: int

    def to_environ(self) -> dict[str, str]:
        return {"FTRUN_DEVICE": str(self.device), "FTRUN_DEVICE_INDEX": str(self.index)}

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> "DeviceAssignment | None":
        index = env.get("FTRUN_DEVICE_INDEX")
        if not index:
            return None
        return cls(int(env.get("FTRUN_DEVICE") or index), int(index))


@dataclass(frozen=True)
class SnapshotSettings:
    """Where and how often a rank snapshots its state into its agent's shared memory (--snapshot-every)."""

    #: the agent's folder in shared memory (FTRUN_SNAPSHOT_DIR)
    folder: str
    #: every how many committed steps (FTRUN_SNAPSHOT_EVERY)
    every: int
    #: the most bytes one snapshot of the rank may take, 0 for no limit (FTRUN_SNAPSHOT_LIMIT)
    limit: int
    #: how many copies of each snapshot the node keeps (FTRUN_SNAPSHOT_COPIES), for the limit's message
    copies: int
    #: the file (JSON, a ``RestorePlan``) in which the agent left the node's restore plan of the generation,
    #: for ranks that cannot read the control store: MindSpore's (FTRUN_RESTORE_PLAN); "" for none
    restore_plan: str = ""

    def to_environ(self) -> dict[str, str]:
        env = {"FTRUN_SNAPSHOT_DIR": self.folder, "FTRUN_SNAPSHOT_EVERY": str(self.every),
               "FTRUN_SNAPSHOT_LIMIT": str(self.limit), "FTRUN_SNAPSHOT_COPIES": str(self.copies)}
        if self.restore_plan:
            env["FTRUN_RESTORE_PLAN"] = self.restore_plan
        return env

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> "SnapshotSettings | None":
        """None when the rank takes no snapshots."""
        folder, every = env.get("FTRUN_SNAPSHOT_DIR"), int(env.get("FTRUN_SNAPSHOT_EVERY") or 0)
        if not folder or every <= 0:
            return None
        return cls(folder, every, int(env.get("FTRUN_SNAPSHOT_LIMIT") or 0), int(env.get("FTRUN_SNAPSHOT_COPIES") or 1),
                   env.get("FTRUN_RESTORE_PLAN", ""))


#: --heartbeat-timeout's default, and a worker's when FTRUN_HEARTBEAT_TIMEOUT is not set: seconds without a
#: rank's heartbeat before its agent takes it for hung
HEARTBEAT_TIMEOUT = 30.0
#: ftrun.elastic.init()'s collective_timeout default: seconds that every group formation (and gloo's
#: collectives) may take
COLLECTIVE_TIMEOUT = 300.0
#: --store-timeout's default, and a worker's when FTRUN_STORE_TIMEOUT is not set: seconds a rank (and the job)
#: goes on without its control store before giving up
STORE_TIMEOUT = 300.0


@dataclass(frozen=True)
class WorkerEnv:
    """What ftrun tells a worker through its environment: its ``FTRUN_*`` variables and the torchrun ones
    the worker library reads. The agent writes it (``to_environ``), ``ftrun.elastic`` reads it back.

    The agent builds it whole (agent/workers.py's ``worker_env``) from what its parts give: the device
    (agent/device_slots.py), the snapshots (snapshots/keeper.py) and the rank table (agent/generations.py).
    """

    rank: int
    local_rank: int
    world_size: int
    run_id: str
    generation: int
    #: the control store's ``host:port``: its presence is what says the worker runs under ftrun
    control_store: str
    #: process level: this worker replaces a failed rank and receives the training state
    replacement: bool
    heartbeat_timeout: float
    #: the node's place in the generation's layout (torchrun's GROUP_RANK)
    node_rank: int = 0
    #: --recovery (process or job)
    recovery: str = ""
    #: the world size of the generation before (a scale-in or a grow-back changes it); 0: unknown
    previous_world_size: int = 0
    #: the path of ftrun's rank table of the generation (FTRUN_RANKTABLE), "" without one
    ranktable: str = ""
    device: DeviceAssignment | None = None
    snapshots: SnapshotSettings | None = None
    #: the path of a node-local file whose whole content is the current control store's ``host:port``
    #: (FTRUN_CONTROL_STORE_FILE), for a control store that may move to another node (the controller's
    #: successor hosts a new one); the agent replaces it atomically. "": the store never moves
    control_store_file: str = ""
    #: how long a rank whose control store is gone waits for the file to name another (FTRUN_STORE_TIMEOUT)
    store_timeout: float = STORE_TIMEOUT
    #: a MindSpore rank's way to the controller (its progress, a process-level repair): its node's
    #: :class:`RelayFolder` (FTRUN_RELAY_DIR); "" for a torch rank, which reads the control store
    relay_dir: str = ""
    #: ftrun turns its integration of the script's framework on as the script makes its Trainer (the Hugging
    #: Face Trainer, Lightning's): False under ``--no-integrations`` or ``FTRUN_INTEGRATIONS=0``
    integrations: bool = True

    @property
    def device_index(self) -> int:
        """The rank's device among those it sees: ftrun's choice, else LOCAL_RANK (torchrun's rule)."""
        return self.device.index if self.device is not None else self.local_rank

    def to_environ(self) -> dict[str, str]:
        env = {
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world_size),
            "GROUP_RANK": str(self.node_rank),
            "FTRUN_RUN_ID": self.run_id,
            "FTRUN_GENERATION": str(self.generation),
            "FTRUN_NODE_RANK": str(self.node_rank),
            "FTRUN_CONTROL_STORE": self.control_store,
            "FTRUN_RECOVERY": self.recovery,
            "FTRUN_HEARTBEAT_TIMEOUT": f"{self.heartbeat_timeout:g}",
            "FTRUN_REPLACEMENT": "1" if self.replacement else "0",
            "FTRUN_PREVIOUS_WORLD_SIZE": str(self.previous_world_size),
        }
        if self.ranktable:
            env["FTRUN_RANKTABLE"] = self.ranktable
        if self.device is not None:
            env.update(self.device.to_environ())
        if self.snapshots is not None:
            env.update(self.snapshots.to_environ())
        if self.control_store_file:
            env["FTRUN_CONTROL_STORE_FILE"] = self.control_store_file
            env["FTRUN_STORE_TIMEOUT"] = f"{self.store_timeout:g}"
        if self.relay_dir:
            env["FTRUN_RELAY_DIR"] = self.relay_dir
        if not self.integrations:
            env["FTRUN_INTEGRATIONS"] = "0"
        return env

    @classmethod
    def from_environ(cls, env: Mapping[str, str] = os.environ) -> "WorkerEnv | None":
        """None when the script runs outside ftrun (plain torchrun, or a single process)."""
        if not env.get("FTRUN_CONTROL_STORE"):
            return None
        return cls(
            rank=int(env["RANK"]),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            world_size=int(env["WORLD_SIZE"]),
            run_id=env["FTRUN_RUN_ID"],
            generation=int(env["FTRUN_GENERATION"]),
            control_store=env["FTRUN_CONTROL_STORE"],
            replacement=env.get("FTRUN_REPLACEMENT") == "1",
            heartbeat_timeout=float(env.get("FTRUN_HEARTBEAT_TIMEOUT") or HEARTBEAT_TIMEOUT),
            node_rank=int(env.get("GROUP_RANK", "0")),
            recovery=env.get("FTRUN_RECOVERY", ""),
            previous_world_size=int(env.get("FTRUN_PREVIOUS_WORLD_SIZE") or 0),
            ranktable=env.get("FTRUN_RANKTABLE", ""),
            device=DeviceAssignment.from_environ(env),
            snapshots=SnapshotSettings.from_environ(env),
            control_store_file=env.get("FTRUN_CONTROL_STORE_FILE", ""),
            store_timeout=float(env.get("FTRUN_STORE_TIMEOUT") or STORE_TIMEOUT),
            relay_dir=env.get("FTRUN_RELAY_DIR", ""),
            integrations=env.get("FTRUN_INTEGRATIONS", "1") != "0",
        )
