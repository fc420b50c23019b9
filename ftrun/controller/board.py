"""The job's status snapshot: what the live view and ``ftrun status`` show.

The controller builds it at each keepalive from its own view and each agent's NodeStatus (which sums
up its ranks: pid, liveness, committed step, heartbeat age), so that it reads one key per node and
never one per rank. It keeps it in memory for the live view on its own terminal, and publishes it as
JSON under ``keys.status`` for ``ftrun status`` elsewhere.
Plain data only (dicts, lists, numbers, strings), so both read the same thing.
"""

from __future__ import annotations

import collections
import time

from ftrun.controller.states import REPAIR_PHASES, JobView, Phase
from ftrun.events import EventLog
from ftrun.keys import JobKeys
from ftrun.messages import NodeSlot, NodeStatus, RankState
from ftrun.step_times import StepTimes, read_collective
from ftrun.store import ControlStore

#: the training rate is measured over this many seconds of committed steps
RATE_WINDOW = 5.0
#: events shown with the snapshot (progress events left out)
EVENTS_SHOWN = 8
#: the event log gets a progress line this often (seconds): densely at first, for a short job's timeline
PROGRESS_EVERY_EARLY, PROGRESS_EVERY, EARLY = 1.0, 10.0, 60.0
#: ftrun top's per-rank history: a sample this often (seconds), this many kept
HISTORY_EVERY, HISTORY_LENGTH = 2.0, 15


def eta(step: int | None, total: int | None, rate: float) -> float | None:
    """Seconds until ``total`` steps are done at ``rate`` steps/s (None when either is unknown)."""
    if step is None or total is None:
        return None
    if step >= total:
        return 0.0
    return round((total - step) / rate, 1) if rate > 0 else None


class Rate:
    """Steps per second over the last RATE_WINDOW seconds; starts afresh when the step goes back."""

    def __init__(self):
        self._samples: collections.deque[tuple[float, int]] = collections.deque()

    def add(self, now: float, step: int) -> float:
        samples = self._samples
        if samples and step < samples[-1][1]:
            samples.clear()  # a rollback to an older step
        samples.append((now, step))
        while len(samples) > 2 and now - samples[1][0] >= RATE_WINDOW:
            samples.popleft()
        (t0, s0), (t1, s1) = samples[0], samples[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 else 0.0


class StatusBoard:
    """Builds the snapshot; records progress in the event log now and then."""

    def __init__(self, store: ControlStore, keys: JobKeys, events: EventLog, run_id: str):
        #: --rdzv-backend etcd: where the controller is ({"host", "moves"}); None with a store that never moves
        self.controller: dict | None = None
        #: the job stands still, or a data link is dark (``links.LinkObserver.status``); None while it moves
        self.stall: dict | None = None
        self.store = store
        self.keys = keys
        self.events = events
        self.run_id = run_id
        self.started = time.monotonic()
        self.snapshot: dict = {}
        self._rate = Rate()
        #: a script without the worker library: the rate of the step its output says (the outside view)
        self._output_rate = Rate()
        self._next_progress = 0.0
        self._last_logged_step: int | None = None
        #: rank -> its last samples [elapsed s, step, heartbeat age s]; the events published so far
        self._history: dict[int, collections.deque[list]] = {}
        self._next_history = 0.0
        self._events_published = 0
        self._total: int | None = None
        #: the wall-clock time of the snapshot being built: a rank's collective shows for how long it waited
        self._now = time.time()
        #: the straggler watch's last word (``StragglerWatch.summary``): the snapshot's ``stragglers``, and each
        #: rank's and node's score
        self.stragglers: dict = {}

    def refresh(self, view: JobView, nodes: dict[int, NodeSlot], spares: list[NodeSlot], phase_since: float,
                saved: dict | None = None) -> dict:
        """``saved``: with snapshots, ``restorable_step`` and ``checkpoint_step`` (None where there is none)."""
        now = time.monotonic()
        self._now = time.time()
        active = [slot for _, slot in sorted(nodes.items()) if slot.node_rank in view.present]
        statuses = self.store.messages(NodeStatus, [self.keys.agent_status(s.agent_id) for s in active + spares])
        node_rows = [self._node_row(view, slot, "active", status) for slot, status in zip(active, statuses)]
        node_rows += [self._vacant_row(view, node) for node in sorted(view.vacant | view.lost)]
        node_rows += [self._node_row(view, slot, "spare", status) for slot, status in zip(spares, statuses[len(active):])]
        scores, outside = self.stragglers.get("scores", {}), self.stragglers.get("outside", ())
        for row in node_rows:
            row["straggler_score"] = self.stragglers.get("nodes", {}).get(row["node"])
            row["straggler"] = row["node"] in self.stragglers.get("named_nodes", ())
            for r in row["rank_states"]:
                r["straggler_score"] = scores.get(r["rank"])
                r["straggler_view"] = "outside" if r["rank"] in outside else None
        by_rank = {r["rank"]: r for row in node_rows for r in row.pop("rank_states")}
        ranks = [by_rank.get(rank) or {"rank": rank, "step": None, "heartbeat_age": None}
                 for rank in range(view.world_size)]
        steps = [r["step"] for r in ranks if r["step"] is not None]
        step = min(steps) if steps else None
        rate = self._rate.add(now, step) if step is not None else 0.0
        total = self._total_steps() if steps else None
        # a script without the worker library: the step its output says, where a rank says one (rank 0 alone, often)
        said = [r["output_step"] for r in ranks if r.get("output_step") is not None] if step is None else []
        output_step = min(said) if said else None
        output_rate = self._output_rate.add(now, output_step) if output_step is not None else 0.0
        self.snapshot = {
            "run_id": self.run_id,
            "time": self._now,
            "elapsed": now - self.started,
            "generation": view.generation,
            "phase": view.phase.value,
            "level": view.level.value if view.phase in REPAIR_PHASES else "",
            "phase_for": now - phase_since,
            "recovery": view.recovery.value,
            "restarts_used": view.restarts_used,
            "max_restarts": view.max_restarts,
            "world_size": view.world_size,
            "step": step,
            "steps_per_s": round(rate, 3),
            "total_steps": total,
            "eta_s": eta(step, total, rate),
            "output_step": output_step,
            "output_steps_per_s": round(output_rate, 3),
            "restorable_step": (saved or {}).get("restorable_step"),
            "checkpoint_step": (saved or {}).get("checkpoint_step"),
            "reason": view.reason,
            "exit_code": view.exit_code if view.phase in (Phase.EXITING, Phase.DONE) else None,
            "nodes": node_rows,
            "ranks": ranks,
            "events": self.events.last(_SHOWN_KINDS, EVENTS_SHOWN),
            "controller": self.controller,
            "stall": self.stall,
            "stragglers": self.stragglers.get("named", []),
        }
        self._log_progress(view, now, step, rate)
        return self.snapshot

    def for_top(self) -> tuple[list[dict], dict | None]:
        """What ``ftrun top`` reads beyond the snapshot (the controller's publisher writes it): the events
        logged since the last call, and every HISTORY_EVERY seconds each rank's short history (else None)."""
        events = self.events.events[self._events_published:]
        self._events_published += len(events)
        now = time.monotonic()
        if now < self._next_history or not self.snapshot:
            return events, None
        self._next_history = now + HISTORY_EVERY
        for rank in self.snapshot["ranks"]:
            samples = self._history.setdefault(rank["rank"], collections.deque(maxlen=HISTORY_LENGTH))
            samples.append([round(self.snapshot["elapsed"]), rank["step"], rank["heartbeat_age"]])
        return events, {str(r): list(h) for r, h in self._history.items()}

    def _total_steps(self) -> int | None:
        """The script's step count, once the worker library has said it (``job.steps(total)``): read
        until it has, then kept."""
        if self._total is None:
            text = self.store.try_text(self.keys.total_steps)
            self._total = int(text) if text.strip().isdigit() and int(text) > 0 else None
        return self._total

    def _node_row(self, view: JobView, slot: NodeSlot, role: str, status: NodeStatus | None) -> dict:
        states = status.ranks if status else ()
        return {"node": slot.node_rank, "host": slot.host, "agent": slot.agent_id, "role": role,
               "state": (_node_state(view, slot.node_rank, self.stall) if role == "active" else "standing by"),
               "ranks_total": slot.nproc if role == "active" else 0,
               "ranks_alive": sum(1 for r in states if r.alive),
               "standbys": status.standbys if status else 0,
               "devices": [{"index": d.index, "health": d.health, "reason": d.reason}
                           for d in (status.devices if status else ())],
               "probed": list(status.probed) if status else [], "unreachable": list(status.unreachable) if status else [],
               "probe_id": status.probe_id if status else None,
               "rank_states": [{"rank": r.rank, "step": r.step, "heartbeat_age": r.heartbeat_age, "node": slot.node_rank,
                                "pid": r.pid, "alive": r.alive, "restarts": r.restarts, **_times(r),
                                **_standing(r, self._now), **_outside(r)} for r in states]}

    def _vacant_row(self, view: JobView, node: int) -> dict:
        return {"node": node, "host": "", "agent": "", "role": "active", "state": "lost" if node in view.lost else "vacant",
                "ranks_total": 0, "ranks_alive": 0, "standbys": 0, "devices": [], "rank_states": []}

    def _log_progress(self, view: JobView, now: float, step: int | None, rate: float) -> None:
        if step is None or now < self._next_progress or step == self._last_logged_step:
            return
        if view.phase in (Phase.EXITING, Phase.DONE):
            return  # job_finished carries the final step: nothing comes after it but the last phase
        early = now - self.started < EARLY
        self._next_progress = now + (PROGRESS_EVERY_EARLY if early else PROGRESS_EVERY)
        self._last_logged_step = step
        self.events.emit("progress", view.generation, f"step {step}, {rate:.2f} steps/s", step=step,
                         steps_per_s=round(rate, 3))


_SHOWN_KINDS = ("fault", "node_lost", "decision", "repair_done", "repair_failed", "takeover", "controller_moved", "resized",
                "generation_started", "job_finished", "straggler", "straggler_gain")


def _times(state: RankState) -> dict:
    """A rank's recent step times (``ftrun.step_times``), as the snapshot shows them (None where it sent none)."""
    times = StepTimes.from_text(state.times)
    save = {"save_s": times.save if times is not None and times.save else None}  # the longest save it measured
    if times is None or not times.steps:
        return {"timed_steps": 0, "step_s": None, "compute_s": None, "wait_s": None, **save}
    return {"timed_steps": times.steps, "step_s": times.step, "compute_s": times.compute, "wait_s": times.wait, **save}


def _outside(state: RankState) -> dict:
    """What is seen of a rank from outside (``ftrun.agent.cpu_time``, ``ftrun.detection.output_steps``), and whether it
    uses the worker library (its step times or committed step: then the outside view does not score it)."""
    return {"library": bool(state.times) or state.step is not None, "cpu_s_per_s": state.cpu,
            "output_step": state.output_step, "output_step_age": state.output_age}


def _standing(state: RankState, now: float) -> dict:
    """Where a rank stands, as the snapshot shows it: ``collective``, the collective it waits in now (``{"op",
    "group", "group_size", "for"}``, for how many seconds at the snapshot's ``time``; ``{}`` while it waits in none;
    None where it sent no word), and ``saving``, for how many seconds it has saved a checkpoint (None: it saves
    none)."""
    read = read_collective(state.collective)
    if read is None:
        return {"collective": None, "saving": None}
    wait = read.wait
    collective = {"op": wait.op, "group": wait.group, "group_size": wait.group_size,
                  "for": round(max(0.0, now - wait.since), 1)} if wait is not None else {}
    saving = round(max(0.0, now - read.saving), 1) if read.saving is not None else None
    return {"collective": collective, "saving": saving}


def _node_state(view: JobView, node: int, stall: dict | None = None) -> str:
    if view.phase is Phase.RUNNING and stall is not None and str(node) in stall["dark"]:
        return "link dark"
    if view.phase is Phase.RUNNING and stall is not None and stall.get("bound") is not None:
        return "stalled"
    if view.phase is Phase.RUNNING:
        return "finished" if node in view.succeeded else "running"
    if view.phase in REPAIR_PHASES and view.level.value == "process":
        return "repairing" if node in view.clearing else "waiting"
    return view.phase.value
