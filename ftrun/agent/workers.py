"""A node's workers: spawned each in its own process group, watched, stopped, reaped.

Every OS call goes through :class:`ProcessOps`, one small object.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

from ftrun import mindspore
from ftrun.agent import standby
from ftrun.agent.forkserver import ForkedProcess, ForkServer, reap_orphans
from ftrun.agent.output import RECENT_LINES, STDERR, STDOUT, ConsoleStream, FilteredCopy, StreamPump, line_prefix, rank_log_paths
from ftrun.config import LaunchConfig
from ftrun.contract import DeviceAssignment, SnapshotSettings, WorkerEnv
from ftrun.detection.exits import classify_exit
from ftrun.detection.oom import OomWatch
from ftrun.detection.output_steps import OutputSteps
from ftrun.detection.table import FaultTable
from ftrun.messages import WorkerFailure, signal_name
from ftrun.orphans import die_with_parent

if TYPE_CHECKING:
    from ftrun.agent.protocol import Wakeup

log = logging.getLogger(__name__)
#: how long to wait for a dead worker's last output before reporting it
DRAIN_TIMEOUT = 1.0
#: how often a stop looks whether the workers it signalled are gone (first after this long)
STOP_POLL = 0.02


class ProcessOps:
    """Spawning and signalling worker process groups, with the orphan guardian told of each."""

    def __init__(self):
        self._guardian = subprocess.Popen(
            [sys.executable, "-m", "ftrun.agent.guardian"],
            stdin=subprocess.PIPE,
            start_new_session=True,
            close_fds=True,
        )

    def spawn(self, argv: list[str], env: dict[str, str], cwd: str | None = None, stdin=subprocess.DEVNULL,
              cpus: tuple[int, ...] = (), pass_fds: tuple[int, ...] = (), output=subprocess.PIPE) -> subprocess.Popen:
        def before_exec() -> None:
            die_with_parent()
            if cpus:
                os.sched_setaffinity(0, cpus)  # before exec: every thread the worker starts inherits it

        proc = subprocess.Popen(
            argv,
            env=env,
            cwd=cwd,
            stdin=stdin,
            stdout=output,
            stderr=output,
            start_new_session=True,  # own process group: a stop reaches its grandchildren too
            preexec_fn=before_exec,
            pass_fds=pass_fds,
        )
        self._tell_guardian(f"+{proc.pid}")
        return proc

    def adopt(self, proc: ForkedProcess) -> ForkedProcess:
        """A rank forked from the node's warm interpreter, the agent's child now: the guardian is told of it."""
        self._tell_guardian(f"+{proc.pid}")
        return proc

    def signal_group(self, pgid: int, sig: int) -> None:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def forget_group(self, pgid: int) -> None:
        self._tell_guardian(f"-{pgid}")

    def remove_on_exit(self, folder: str) -> None:
        """Have the guardian remove ``folder`` if the agent dies without doing it (its snapshot memory)."""
        self._tell_guardian(f"d{folder}")

    def close(self) -> None:
        """Let the guardian go (every group is reaped by now)."""
        try:
            self._guardian.stdin.close()
        except OSError:
            pass
        try:
            self._guardian.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._guardian.kill()
            self._guardian.wait()

    def _tell_guardian(self, line: str) -> None:
        try:
            self._guardian.stdin.write(line.encode() + b"\n")
            self._guardian.stdin.flush()
        except (OSError, ValueError):
            log.warning("the orphan guardian is gone; workers still carry a parent-death signal")


@dataclass(frozen=True)
class WorkerPlacement:
    """Where one worker sits in the job."""

    local_rank: int
    rank: int
    node_rank: int
    host: str
    #: the device it runs on (FTRUN_DEVICE, FTRUN_DEVICE_INDEX); None on CPU
    device: DeviceAssignment | None = None
    #: the runtime's variable of the devices it sees and its value (CUDA_VISIBLE_DEVICES, "4,6"); None on CPU
    visibility: tuple[str, str] | None = None
    #: the CPUs it is bound to (--numa-binding); () = not bound
    cpus: tuple[int, ...] = ()


@dataclass
class Worker:
    placement: WorkerPlacement
    proc: subprocess.Popen | ForkedProcess
    out: StreamPump
    err: StreamPump
    error_file: str
    returncode: int | None = None
    #: set when the agent itself ended the worker (hang, device fault): the cause and its evidence
    cause: str = ""
    detail: str = ""
    #: the last step its output said (the outside view of a script without the worker library)
    steps: OutputSteps = field(default_factory=OutputSteps)

    @property
    def pid(self) -> int:
        return self.proc.pid


@dataclass(frozen=True)
class GenerationEnv:
    """What differs between generations: their number and their worker store."""

    generation: int
    restart_count: int
    world_size: int
    node_count: int
    master_addr: str
    master_port: int
    control_store: str
    #: the job-wide budget, as the controller counts it
    max_restarts: int
    #: process level: this worker replaces a failed rank and must receive the training state
    replacement: bool = False
    #: the generation's rank table (FTRUN_RANKTABLE), "" for none
    ranktable: str = ""
    #: on Ascend, its HCCL rank table (RANK_TABLE_FILE), "" for none
    hccl_ranktable: str = ""
    #: the world size of the generation before (a scale-in or grow-back changes it), 0 for the first
    previous_world_size: int = 0
    #: where the ranks write their snapshots (FTRUN_SNAPSHOT_*), when --snapshot-every is on
    snapshots: SnapshotSettings | None = None
    #: --rdzv-backend etcd: the file that names the control store as it moves (FTRUN_CONTROL_STORE_FILE)
    control_store_file: str = ""
    #: --framework mindspore: the generation's scheduler, "host:port" (MS_SCHED_HOST, MS_SCHED_PORT)
    scheduler: str = ""
    #: --framework mindspore: the node's relay folder (FTRUN_RELAY_DIR), "" for none
    relay_dir: str = ""


class WorkerGroup:
    """The node's workers, and its warm interpreter (``forkserver.py``) they are forked from."""

    def __init__(self, ops: ProcessOps, config: LaunchConfig, log_dir: str, warm_standbys: int = 0):
        self.ops = ops
        self.config = config
        self.log_dir = log_dir
        self.generation = -1
        self.workers: list[Worker] = []
        #: --framework mindspore, on the node that hosts the worker store: the generation's scheduler. Not
        #: one of ``workers`` (it holds no rank), but watched, reported and stopped as they are
        self.scheduler: Worker | None = None
        #: --warm-standby: ranks are forked from a warm interpreter (one that can run the entrypoint, for a
        #: script that imports torch)
        self.warm_wanted = (warm_standbys > 0 and standby.can_run(config.entrypoint)
                            and standby.names_torch(warm_script(config.entrypoint)))
        self.warm: ForkServer | None = None
        #: the process groups of reaped ranks that may still hold processes the agent adopted (their orphans)
        self._orphan_groups: set[int] = set()
        #: what stop() sends first: SIGTERM, or the signal that stopped the agent when the user asked
        #: for it to be forwarded (--signals-to-handle)
        self.stop_signal: int = signal.SIGTERM
        #: (generation, stream name) -> the attempt's filtered copy (--duplicate-*-filters)
        self._filtered: dict[tuple[int, str], FilteredCopy] = {}

    def keep_warm(self) -> None:
        """Start the node's warm interpreter when it is wanted and there is none (it imports torch in the
        background, and its ranks wait for it), or a new one in place of one that failed."""
        if not self.warm_wanted or self.warm is not None and not self.warm.failed:
            return
        if self.warm is not None:
            self.ops.forget_group(self.warm.proc.pid)
        env = base_env(self.config)  # what torch reads when it loads must be what the workers get
        # the script, whose text says which framework to import ahead (none for a module run with -m)
        script = warm_script(self.config.entrypoint)
        self.warm = ForkServer(self.ops, env, [script] if script else [])

    @property
    def warming(self) -> bool:
        """The warm interpreter is still importing: the node's ranks wait for it."""
        return self.warm is not None and self.warm.warming

    @property
    def warm_ready(self) -> bool:
        return self.warm is not None and not self.warm.warming and self.warm.ready

    def start(self, placements: list[WorkerPlacement], gen: GenerationEnv) -> None:
        self.generation = gen.generation
        self.workers = [self._spawn(p, gen) for p in placements]

    def start_scheduler(self, gen: GenerationEnv, node_rank: int, host: str) -> None:
        """--framework mindspore: the generation's scheduler, the training script run as msrun runs it
        (MS_ROLE=MS_SCHED), before the workers that connect to it."""
        scheduler = mindspore.Scheduler.parse(gen.scheduler)
        assert scheduler is not None
        self.generation = gen.generation
        paths = rank_log_paths(self.log_dir, gen.generation, "scheduler")
        env = generation_env(self.config, gen, paths["error"])
        env.update(FTRUN_RUN_ID=self.config.run_id, FTRUN_GENERATION=str(gen.generation))  # no rank: no WorkerEnv
        env.update(mindspore.scheduler_variables(scheduler, gen.world_size, self.config.cluster_timeout))
        argv = [*self.config.entrypoint, *self.config.script_args]
        proc = self.ops.spawn(argv, env)
        placement = WorkerPlacement(-1, mindspore.SCHEDULER_RANK, node_rank, host)
        log.info("MindSpore scheduler of generation %d at %s (pid %d)", gen.generation, scheduler, proc.pid)
        self.scheduler = self._watch(placement, proc, paths, gen.generation, b"[scheduler]: ")

    def _spawn(self, placement: WorkerPlacement, gen: GenerationEnv) -> Worker:
        torchrun_layout = self.config.log_layout == "torchrun"
        paths = rank_log_paths(self.log_dir, gen.generation, placement.local_rank if torchrun_layout else placement.rank)
        env = worker_env(self.config, placement, gen, paths["error"])
        argv = [*self.config.entrypoint, *self.config.script_args]
        proc = self._forked(argv, env, placement.cpus) or self.ops.spawn(self._fresh(argv), env, cpus=placement.cpus)
        prefix = line_prefix(self.config.log_layout, self.config.log_line_prefix_template, self.config.role,
                             placement.rank, placement.local_rank).encode()
        return self._watch(placement, proc, paths, gen.generation, prefix)

    def _watch(self, placement: WorkerPlacement, proc: subprocess.Popen | ForkedProcess, paths: dict[str, str], generation: int,
               prefix: bytes) -> Worker:
        """A started process's output pumped to the console and its log files (as -r, -t and
        --local-ranks-filter say for its local rank; the scheduler's, -1, follows the defaults)."""
        local = placement.local_rank
        redirected = self.config.redirects.for_rank(local)
        teed = self.config.tee.for_rank(local)
        shown = self.config.local_ranks_filter is None or local in self.config.local_ranks_filter

        recent: collections.deque[str] = collections.deque(maxlen=RECENT_LINES)
        steps = OutputSteps()

        def pump(pipe, which: int, name: str) -> StreamPump:
            on_console = shown and (not redirected & which or teed & which)
            return StreamPump(
                pipe,
                f"ftrun-{name}-rank{placement.rank}",
                ConsoleStream(which) if on_console else None,
                prefix if teed & which or self.config.head_managed else b"",
                paths[name] if (redirected | teed) & which else None,
                filtered=self._filtered_copy(generation, name),
                file_prefix=prefix,
                recent=recent,
                steps=steps,
            )

        return Worker(
            placement, proc, pump(proc.stdout, STDOUT, "stdout"), pump(proc.stderr, STDERR, "stderr"),
            paths["error"], steps=steps,
        )

    def _filtered_copy(self, generation: int, name: str) -> FilteredCopy | None:
        """The attempt's filtered_stdout.log or filtered_stderr.log, shared by the node's ranks."""
        words = self.config.duplicate_stdout_filters if name == "stdout" else self.config.duplicate_stderr_filters
        if not words:
            return None
        key = (generation, name)
        if key not in self._filtered:
            folder = os.path.join(self.log_dir, f"attempt_{generation}")
            self._filtered[key] = FilteredCopy(os.path.join(folder, f"filtered_{name}.log"), words)
        return self._filtered[key]

    def _fresh(self, argv: list[str]) -> list[str]:
        """A fresh interpreter's command: prepared as a forked rank is (standby.run), for a script whose Trainer
        gets ftrun's integration (--recovery process, not --no-integrations)."""
        if self.config.recovery != "process" or not self.config.integrations:
            return argv
        return standby.prepared(argv)

    def _forked(self, argv: list[str], env: dict[str, str], cpus: tuple[int, ...]) -> ForkedProcess | None:
        """The rank forked from the warm interpreter, when it is ready (else the caller starts a fresh one)."""
        if self.warm is None:
            return None
        proc = self.warm.fork(argv, env, cpus)
        if proc is None:
            return None
        log.info("rank %s forked from the node's warm interpreter (pid %d)", env["RANK"], proc.pid)
        return self.ops.adopt(proc)

    def clear(self, local_rank: int, timeout: float) -> None:
        """Kill one worker if it is still alive and reap it (process-level env clear)."""
        if local_rank >= len(self.workers):
            return  # never ran here: a spare taking over a lost node's ranks
        worker = self.workers[local_rank]
        if worker.returncode is None:
            self.ops.signal_group(worker.pid, signal.SIGKILL)
            worker.proc.wait(timeout=timeout + 5)
            worker.returncode = worker.proc.returncode
            self._clear_group(worker)

    def fail(self, local_rank: int, cause: str, detail: str) -> None:
        """End a worker the agent found faulty (hung, on a sick device); the next poll reports it."""
        worker = self.workers[local_rank]
        if worker.returncode is None:
            worker.cause, worker.detail = cause, detail
            self.ops.signal_group(worker.pid, signal.SIGKILL)

    def respawn(self, placement: WorkerPlacement, gen: GenerationEnv) -> None:
        """Start a replacement for one rank; the node's other workers keep running."""
        self.generation = gen.generation
        worker = self._spawn(placement, gen)
        if placement.local_rank < len(self.workers):
            self.workers[placement.local_rank] = worker
        else:  # a spare taking over a lost node: its ranks come in order
            self.workers.append(worker)

    def poll(self) -> list[Worker]:
        """Workers (and the scheduler) that ended since the last poll (their process groups are cleared)."""
        ended = []
        for worker in self._processes:
            if worker.returncode is None and worker.proc.poll() is not None:
                worker.returncode = worker.proc.returncode
                self._clear_group(worker)
                ended.append(worker)
        self._orphan_groups = {pgid for pgid in self._orphan_groups if reap_orphans(pgid)}
        return ended

    def wait(self, timeout: float, wakeup: Wakeup | None = None) -> None:
        """Sleep up to ``timeout``, waking as soon as a running worker ends (Linux's pidfds): a death
        is seen at once instead of at the next --monitor-interval (elsewhere: a plain sleep); and as
        soon as ``wakeup`` (a ``Wakeup``: a command was published) is written to."""
        fds: list[int] = []
        try:
            for worker in self._processes:
                if worker.returncode is not None:
                    continue
                fds.append(os.pidfd_open(worker.pid))
            if fds or wakeup is not None:
                select.select(fds + ([wakeup] if wakeup is not None else []), [], [], timeout)
                if wakeup is not None:
                    wakeup.drain()
            else:
                time.sleep(timeout)
        except ProcessLookupError:
            pass  # one is gone already: poll() reaps it now
        except (AttributeError, OSError):  # no pidfds here
            time.sleep(timeout)
        finally:
            for fd in fds:
                os.close(fd)

    @property
    def running(self) -> list[Worker]:
        return [w for w in self.workers if w.returncode is None]

    @property
    def _processes(self) -> list[Worker]:
        """The workers, and the scheduler when this node runs one."""
        return self.workers + ([self.scheduler] if self.scheduler is not None else [])

    @property
    def all_succeeded(self) -> bool:
        """Every worker exited 0 (and the scheduler, which msrun waits for too)."""
        return bool(self.workers) and all(w.returncode == 0 for w in self._processes)

    def stop(self, timeout: float, keep_warm: bool = False) -> list[Worker]:
        """SIGTERM (or ``stop_signal``) every running worker's group, SIGKILL what is left after
        ``timeout``, reap all; the warm interpreter too, unless ``keep_warm`` (a generation's stop before
        a job-level restart, whose ranks are forked from it). Returns the workers that a SIGKILL not of this stop
        ended meanwhile (one that died as the stop came: killed, or taken by the OOM killer)."""
        if not keep_warm:
            self._stop_warm()
        alive = stopping = [w for w in self._processes if w.returncode is None]
        for worker in alive:
            self.ops.signal_group(worker.pid, self.stop_signal)
        deadline = time.monotonic() + timeout
        while alive and time.monotonic() < deadline:
            time.sleep(STOP_POLL)
            alive = [w for w in alive if w.proc.poll() is None]
        for worker in alive:
            self.ops.signal_group(worker.pid, signal.SIGKILL)
        for worker in self._processes:
            if worker.returncode is not None:
                continue
            worker.proc.wait()
            worker.returncode = worker.proc.returncode
            self._clear_group(worker)
        for copy in self._filtered.values():
            copy.close()  # a line still on its way opens it again
        self.scheduler = None  # the next generation's, if any, starts afresh (here, or where the controller is)
        return [w for w in stopping if w.returncode == -signal.SIGKILL and w not in alive]

    def _stop_warm(self) -> None:
        if self.warm is not None:
            self.warm.close()
            self.ops.forget_group(self.warm.proc.pid)
            self.warm = None

    def _clear_group(self, worker: Worker) -> None:
        # whatever the worker left behind in its group dies with it (and is reaped, when the agent adopted it)
        self.ops.signal_group(worker.pid, signal.SIGKILL)
        self.ops.forget_group(worker.pid)
        if self.warm_wanted:  # the agent is a subreaper
            self._orphan_groups.add(worker.pid)

    def failure(self, worker: Worker, table: FaultTable, oom: OomWatch | None = None) -> WorkerFailure:
        worker.err.drain(DRAIN_TIMEOUT)
        code = worker.returncode
        p = worker.placement
        error = read_error_file(worker.error_file)
        level = ""
        if worker.cause:
            cause, detail = worker.cause, worker.detail
        else:
            evidence = oom.killed_by_oom(worker.pid) if oom is not None and code == -signal.SIGKILL else ""
            fault = classify_exit(code, tuple(worker.err.tail), error, table, oom=evidence)
            cause, detail = fault.kind, fault.detail
            level = fault.level.value if fault.level is not None else ""  # set for device errors only
        return WorkerFailure(
            rank=p.rank,
            local_rank=p.local_rank,
            node_rank=p.node_rank,
            host=p.host,
            pid=worker.pid,
            exit_code=code if code is not None and code >= 0 else None,
            signal=signal_name(code) if code is not None else "",
            stderr_tail=tuple(worker.err.tail),
            error=error,
            timestamp=time.time(),
            generation=self.generation,
            cause=cause,
            detail=detail,
            level=level,
        )


def read_error_file(path: str) -> str:
    """The exception a worker recorded with torch's ``@record`` (TORCHELASTIC_ERROR_FILE), if any."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return ""
    message = data.get("message", "")
    if isinstance(message, dict):
        message = message.get("message", "")
    return str(message).strip()


def warm_script(entrypoint: tuple[str, ...] | list[str]) -> str | None:
    """The script of a ``python -u SCRIPT`` entrypoint (None for ``python -u -m MODULE``)."""
    return entrypoint[2] if entrypoint[2] != "-m" else None


def base_env(config: LaunchConfig) -> dict[str, str]:
    """The agent's environment as the workers inherit it, before anything rank-specific."""
    env = dict(os.environ)
    for name in ("TORCH_CPP_LOG_LEVEL",):
        # the agent quiets torch's C++ logging for itself; the workers get the user's setting back
        saved = env.pop(f"FTRUN_SAVED_{name}", None)
        if saved is None:
            env.pop(name, None)
        else:
            env[name] = saved
    if config.nproc_per_node > 1 and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = "1"  # torchrun's default: N workers must not each take every core
    return env


def generation_env(config: LaunchConfig, gen: GenerationEnv, error_file: str) -> dict[str, str]:
    """What every process of a generation gets, the workers and a MindSpore scheduler alike: the agent's
    environment and torchrun's job-wide variables (no rank)."""
    env = base_env(config)
    env.update(
        ROLE_NAME=config.role,
        LOCAL_WORLD_SIZE=str(config.nproc_per_node),
        GROUP_WORLD_SIZE=str(gen.node_count),
        ROLE_WORLD_SIZE=str(gen.world_size),
        MASTER_ADDR=gen.master_addr,
        MASTER_PORT=str(gen.master_port),
        TORCHELASTIC_RESTART_COUNT=str(gen.restart_count),
        TORCHELASTIC_MAX_RESTARTS=str(gen.max_restarts),
        TORCHELASTIC_RUN_ID=config.run_id,
        TORCHELASTIC_USE_AGENT_STORE="True",
        TORCHELASTIC_ERROR_FILE=error_file,
        TORCH_NCCL_ASYNC_ERROR_HANDLING=env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    )
    if config.recovery == "process":
        env.update(torch_npu_recovery_variables(env))
    if gen.relay_dir and config.recovery == "process":  # a MindSpore job on Ascend (config.py)
        env.update(mindspore.recovery_variables(env))
    return env


def torch_npu_recovery_variables(env: Mapping[str, str]) -> dict[str, str]:
    """What a process-level repair needs of torch_npu (only torch_npu reads these, so they go to every worker).

    Its HCCL watchdog ends the whole process on a communicator error by default (TORCH_HCCL_ASYNC_ERROR_HANDLING
    1). A peer's death shows up on a healthy rank's communicators (an error CQE) before any repair is announced,
    so that rank would die too; with 0, the error reaches the rank's collective and the repair. The user's own
    setting, or the deprecated HCCL_ASYNC_ERROR_HANDLING, wins."""
    if "TORCH_HCCL_ASYNC_ERROR_HANDLING" in env or "HCCL_ASYNC_ERROR_HANDLING" in env:
        return {}
    return {"TORCH_HCCL_ASYNC_ERROR_HANDLING": "0"}


def worker_env(config: LaunchConfig, placement: WorkerPlacement, gen: GenerationEnv, error_file: str) -> dict[str, str]:
    """torchrun's environment contract, plus ftrun's own FTRUN_* variables (the worker's contract,
    ``WorkerEnv``, whole: the ranks, the world size, the rank table, the device, the snapshots); the
    runtime's own (the visible devices, HCCL's rank table) and msrun's MS_* ones for a MindSpore job."""
    if config.virtual_local_rank:
        placement = own_device_only(placement)
    env = generation_env(config, gen, error_file)
    env.update(ROLE_RANK=str(placement.rank))
    worker = WorkerEnv(
        rank=placement.rank,
        local_rank=0 if config.virtual_local_rank else placement.local_rank,
        world_size=gen.world_size,
        run_id=config.run_id,
        generation=gen.generation,
        control_store=gen.control_store,
        control_store_file=gen.control_store_file,
        store_timeout=config.store_timeout,
        replacement=gen.replacement,
        heartbeat_timeout=config.heartbeat_timeout,
        node_rank=placement.node_rank,
        recovery=config.recovery,
        previous_world_size=gen.previous_world_size or gen.world_size,
        relay_dir=gen.relay_dir,
        ranktable=gen.ranktable,
        device=placement.device,
        snapshots=gen.snapshots,
        integrations=config.integrations,
    )
    env.update(worker.to_environ())
    if placement.visibility is not None:
        env[placement.visibility[0]] = placement.visibility[1]
    if gen.hccl_ranktable:
        env["RANK_TABLE_FILE"] = gen.hccl_ranktable
    scheduler = mindspore.Scheduler.parse(gen.scheduler)
    if scheduler is not None:
        env.update(mindspore.worker_variables(scheduler, gen.world_size, config.cluster_timeout, placement.rank,
                                              worker.device_index))
    return env


def own_device_only(placement: WorkerPlacement) -> WorkerPlacement:
    """--virtual-local-rank: the devices the worker sees narrowed to its own, which it then sees as
    device 0 (torchrun's rule, for CUDA_VISIBLE_DEVICES and ASCEND_RT_VISIBLE_DEVICES alike). Without
    a device assigned there is nothing to narrow."""
    assigned = placement.device
    if assigned is None:
        return placement
    visibility = (placement.visibility[0], str(assigned.device)) if placement.visibility is not None else None
    return dataclasses.replace(placement, device=DeviceAssignment(assigned.device, index=0), visibility=visibility)


