"""The process-level repair of a MindSpore rank on Ascend, through MindSpore's own hooks.

The sequence is the one ``ftrun/elastic/repair.py`` runs for torch ranks (docs/design.md, "The repair,
step by step"), made of the calls MindSpore's fault-tolerance callback makes when MindCluster's TaskD
and MindIO drive it (``mindspore/train/callback/_train_fault_tolerance.py`` in mindspore 2.10):

1. **stop**: the step raises, or the watch, seeing the repair announced while the main thread is still
   in its step, stops the device (``_stop_device``): the blocked step raises and its guard hands the rank
   to :meth:`MindSporeRepair.recover`. (MindSpore fails a stopped step only with ``MS_ENABLE_TFT``'s ARF or
   UCE on, which the agent sets: ``ftrun/mindspore.py``.) A rank whose step was cut short in its
   optimizer's update (the fault-tolerant optimizer's flag says so) gives up its claim to its committed step.
2. **env clear**: the rank says ``stopped``; ``clean_tdt_channel()`` and ``_reset_snapshot_state()``, as
   the callback's clean does for a repair that replaces a process ("recover"). For a repair that replaces
   none (the online level: a collective failed while every process lived, which the rank told the
   controller through its agent), its other branch ("retry"): ``resume_hccl_comm()``, the same
   communicators go on. After an on-chip memory error (UCE) in the rank's step, the device says where it
   hit (``_get_uce_mem_info``, ``_get_uce_process_strategy``): in the training state, the rank takes a
   healthy replica's; in memory a step uses for a while, the step is redone; elsewhere, the process exits
   to be replaced.
3. **repair**: the agent respawns the failed rank under its old ``MS_NODE_ID`` with
   ``MS_ENABLE_RECOVERY=1``, so that its ``init()`` rejoins the generation's scheduler, which keeps running.
   Once every rank arrived, the healthy ones destroy and rebuild their communication groups
   (``_finalize_comm()``, ``_rebuild_group()``) and every rank prepares the point-to-point links
   (``_pre_launch_send_recv``); at the online level they rebuild nothing. A rank that had a UCE repairs
   its device (``_repair_device``). Every rank that was stopped clears the stop's error state
   (``_reset_error_state``).
4. **rollback**: the ranks gather what each committed and which snapshots it holds (an all-gather on the
   rebuilt world group) and decide alike (:func:`ftrun.rollback.choose_rollback`): a healthy replica sends
   the parameters to the replacement (``send_recv(parameters, src, dst)``, the call the callback makes on
   both ends); with no replica holding the state, every rank goes back to the newest snapshot all hold,
   and with none of those the repair falls back to job level, as for torch.
5. **continue**: the rank says ``resumed`` and ``steps()`` goes on from the agreed step. As each step
   ends, the optimizer's flag goes back to 1 and, after a rebuild, ``set_is_arf(False)`` lowers the ARF
   flag, as MindSpore's fault-tolerance callback does at a step's end.

**The channel.** A MindSpore python has no torch, so the rank cannot open the control store (a torch
``TCPStore``), and a client of its wire protocol of our own would be a second implementation to keep in
step with torch's. The rank's agent relays instead, through files in a node-local folder
(:class:`ftrun.contract.RelayFolder`, ``ftrun/agent/relay.py``): it writes the announced generation
and the readiness of its groups, and counts in the store the milestone files the ranks leave. A rank's
watch looks at one file's ``os.stat`` every WATCH_POLL seconds (a microsecond each, and no connection
that a fault could leave half open); the relay costs the agent one store read per tick. Each wait has a
deadline: a repair whose ranks never all arrive ends in :class:`~ftrun.repair_loop.RepairError`, a rank stuck in its step
exits to be replaced, and one whose fallback is never answered leaves with one line.

Not run on Ascend hardware: tests/unit/test_mindspore_repair.py drives it through a fake of
``mindspore._c_expression`` and ``mindspore.communication`` (docs/mindspore.md says what that shows).
Like the rest of the MindSpore worker library it imports no torch; mindspore is imported by the hooks.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable, NoReturn, Protocol

from ftrun.contract import CollectiveFailure, Fallback, Milestone, RollbackFailure
from ftrun.errors import EXIT_STUCK
from ftrun.mindspore_elastic.backends import UCE_SIGNS, UCE_STRATEGIES, AscendHooks, consistency_flag
from ftrun.mindspore_elastic.link import WATCH_POLL, RepairChannel
from ftrun.repair_loop import RepairError, repair_until_resumed
from ftrun.rollback import NO_STATE, RollbackPlan, choose_rollback
from ftrun.snapshots.format import SnapshotError

log = logging.getLogger("ftrun.mindspore_elastic")
#: after a repair is announced, how long the main thread may take to leave its step before the watch stops
#: the device: one look. Every collective of the old generation is lost anyway
INTERRUPT_AFTER = WATCH_POLL
#: how many of its snapshots a rank names in the rollback (its agent keeps two)
HELD = 2
#: MindSporeRepair's flag parameter before it was looked up
_NOT_LOOKED_UP = object()


class RepairedState(Protocol):
    """What the repair needs of the rank's training state (``MindSporeJob`` gives it)."""

    sharded: bool

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def step(self) -> int: ...

    def parameters(self) -> list: ...

    def held_snapshots(self) -> list[int]: ...

    def load_snapshot(self, step: int) -> None: ...

    def resume_at(self, step: int) -> None: ...


class MindSporeRepair:
    """One MindSpore rank's part in every process-level repair of its job, and the watch that makes sure
    its main thread takes part."""

    def __init__(self, state: RepairedState, hooks: AscendHooks, channel: RepairChannel, generation: int,
                 replacement: bool, timeout: float, fault_wait: float):
        self.state = state
        self.hooks = hooks
        self.channel = channel
        #: the generation this rank's groups belong to
        self.generation = generation
        #: a replacement's first repair joins the generation it was spawned into without stopping
        self.spawned_for = generation if replacement else None
        #: this rank holds the training state of its committed step (a replacement, until its rollback, not)
        self.holds_state = not replacement
        #: how long every rank may take to arrive in a new generation (the cluster's MS_TOPO_TIMEOUT)
        self.timeout = timeout
        #: after a step raised, how long to wait for the repair's announcement; and how long a rank may
        #: stay in its step once one is announced
        self.fault_wait = fault_wait
        #: the main thread is in a step's body (the watch stops the device only then)
        self.in_step = False
        #: the main thread is in a repair: the watch leaves it alone
        self.repairing = False
        #: the step that stopped raised an on-chip memory error (UCE): the device says where it hit
        self.uce = False
        #: a step's body was cut short by the repair (not a repair between two steps): its optimizer may
        #: have been in its update
        self.step_interrupted = False
        #: this rank rebuilt its groups and raised MindSpore's ARF flag: the next step's end lowers it
        self.rebuilt = False
        #: the fault-tolerant optimizer's flag among the rank's parameters (None: none), once looked up
        self._flag: Any = _NOT_LOOKED_UP
        self._closed = threading.Event()
        self._watch: threading.Thread | None = None

    # -- the main thread -----------------------------------------------------------------------------

    def announced(self) -> int | None:
        """A repair announced beyond this rank's generation (seen between steps), or None."""
        target = self.channel.target()
        return target if target > self.generation else None

    def target_after(self, error: BaseException) -> int | None:
        """The generation to repair into when the step raised ``error`` because of a fault elsewhere;
        None when no repair comes (the rank's own error, which must end the process)."""
        if not isinstance(error, RuntimeError):  # a stopped device or a lost peer raises one
            return None
        text = str(error)
        self.uce = any(sign in text for sign in UCE_SIGNS)
        if self.channel.target() <= self.generation:  # no repair announced: nobody may know of it but this rank
            self.channel.collective_failed(CollectiveFailure(self.state.rank, self.generation,
                                                             (text.splitlines() or [type(error).__name__])[0][:200],
                                                             time.time()))
        target = self.channel.await_target(above=self.generation, timeout=self.fault_wait)
        self.step_interrupted = target is not None
        if target is not None:
            log.warning("rank %d: step %d interrupted (%s); repairing into generation %d", self.state.rank,
                        self.state.step, str(error).splitlines()[0] if str(error) else type(error).__name__, target)
        return target

    def recover(self, target: int) -> None:
        """From a stopped step (or a replacement's start) to a resumed one in ``target`` or a newer one."""
        repair_until_resumed(target, self.join, self.rollback, self._interrupted)

    def _interrupted(self, target: int, error: Exception) -> int | None:
        """A rollback that raised: the newer generation announced within fault_wait, or None."""
        newer = self.channel.await_target(above=target, timeout=self.fault_wait)
        if newer is not None:
            log.warning("rank %d: rollback of generation %d interrupted (%s)", self.state.rank, target, error)
        return newer

    def join(self, target: int) -> int:
        """Leave the old generation's communication and form ``target``'s (or a newer one's); returns it."""
        while True:
            self.repairing = True
            fresh = target == self.spawned_for  # the replacement's init() formed its communication already
            online = self.channel.online(target)
            if not fresh:
                self.channel.reach(target, Milestone.STOPPED)
                self.hooks.stop()
                self._check_parameters()
                self._check_memory()
                self.hooks.clean(online)
            self.channel.reach(target, Milestone.ARRIVED)
            try:
                ready = self.channel.group_ready(target, self.timeout)
            except TimeoutError as e:
                raise RepairError(str(e)) from None
            if ready:
                break
            target = self.channel.target()
        if not fresh and not online:
            self.hooks.rebuild()
            self.rebuilt = True
        if not online:
            self.hooks.prepare_transfers()
        if self.uce:
            self.hooks.repair_device()
            self.uce = False
        if not fresh:
            # MindSpore clears the stop's error state once its repair is done (train/model.py:326); ftrun
            # does it before the rollback, whose all-gather is the first operation the rank runs again
            self.hooks.reset_error_state()
        self.step_interrupted = False
        self.spawned_for = None
        self.generation = target
        self.channel.reach(target, Milestone.JOINED)
        return target

    def _check_parameters(self) -> None:
        """A step cut short may have been stopped in its optimizer's update: its parameters are then
        neither the committed step's nor the next one's. MindSpore refuses to stop such a rank
        (``_tft_stop_callback``); ftrun must stop it all the same, since its step may be blocked in a
        collective, so it reads the flag once the device is still and rolls the rank back instead: the
        rank gives up its claim to the committed step and takes a healthy replica's state, or with none,
        the newest snapshot every rank holds. Its process and device are sound, so it is not replaced.
        With no fault-tolerant optimizer there is no flag, and MindSpore's answer, "not consistent", is
        kept. A UCE is judged by where it hit instead (:meth:`_check_memory`), as MindSpore skips the
        check for a UCE rank."""
        if self.uce or not self.holds_state or not self.step_interrupted:
            return
        flag = self.consistency_flag()
        if flag is None or not self.hooks.parameters_consistent(flag):
            log.warning("rank %d: stopped %s; it takes its state from a replica or a snapshot", self.state.rank,
                        "in its step with no fault-tolerant optimizer to vouch for its parameters" if flag is None
                        else "in its optimizer's update")
            self.holds_state = False

    def consistency_flag(self):
        """The fault-tolerant optimizer's flag among the rank's parameters, or None (looked up once: the
        parameters are registered before the first step)."""
        if self._flag is _NOT_LOOKED_UP:
            self._flag = consistency_flag(self.state.parameters())
        return self._flag

    def step_committed(self) -> None:
        """What MindSpore's fault-tolerance callback does as each step ends (``on_train_step_end``): the
        optimizer's flag back to 1, and after a rebuild, the ARF flag lowered."""
        flag = self.consistency_flag()
        if flag is not None:
            self.hooks.mark_consistent(flag)
        if self.rebuilt:
            self.hooks.end_rebuild()
            self.rebuilt = False

    def _check_memory(self) -> None:
        """After a UCE, the device says where it hit: the training state (a replica's is taken), memory a
        step uses for a while (the step is redone), or memory MindSpore does not manage (the process
        exits to be replaced: nothing here can vouch for it)."""
        if not self.uce:
            return
        strategy = self.hooks.uce_strategy()
        if strategy not in UCE_STRATEGIES:
            log.error("rank %d: a memory error (UCE) that MindSpore cannot repair (%s); exiting to be replaced",
                      self.state.rank, strategy)
            os._exit(EXIT_STUCK)
        self.holds_state = self.holds_state and UCE_STRATEGIES[strategy]

    def rollback(self, generation: int) -> None:
        """Agree on the step; a healthy replica sends the parameters to the ranks that lack them."""
        state = self.state
        held = state.held_snapshots()[:HELD]
        committed = state.step if self.holds_state else NO_STATE
        rows = self.hooks.gather([committed, *held, *[NO_STATE] * (HELD - len(held))])
        replica_sets: list[tuple[int, ...]] | None = [(r,) for r in range(state.world_size)] if state.sharded else None
        plan = choose_rollback([row[0] for row in rows], replica_sets)
        if plan is not None:
            self.send_state(plan)
            source = plan.source_for(state.rank)
            origin = f"state from rank {source}" if source is not None else "its own state"
        else:
            plan = RollbackPlan(self.from_snapshots(generation, [row[1:] for row in rows]))
            origin = "its own snapshot"
        state.resume_at(plan.step)
        self.holds_state = True
        self.channel.reach(generation, Milestone.RESUMED)
        self.repairing = False
        log.info("rank %d: generation %d resumes at step %d (%s)", state.rank, generation, plan.step, origin)

    def send_state(self, plan: RollbackPlan) -> None:
        """Point to point, each source to its receivers, with MindSpore's ``send_recv`` on both ends."""
        rank, parameters = self.state.rank, self.state.parameters()
        for transfer in plan.transfers:
            if rank == transfer.source:
                for receiver in transfer.receivers:
                    self.hooks.send_recv(parameters, transfer.source, receiver)
            elif rank in transfer.receivers:
                self.hooks.send_recv(parameters, transfer.source, rank)

    def from_snapshots(self, generation: int, held: list[list[int]]) -> int:
        """No healthy replica for some rank: every rank goes back to the newest step all of them hold in
        their agents' memory (a replacement finds its predecessor's there)."""
        common = set.intersection(*({s for s in steps if s != NO_STATE} for steps in held))
        if not any(any(s != NO_STATE for s in steps) for steps in held):
            self.fall_back(generation, Fallback.NO_SNAPSHOTS)
        if not common:
            self.fall_back(generation, Fallback.NO_COMMON_SNAPSHOT)
        step = max(common)
        if self.state.step != step or not self.holds_state:
            try:
                self.state.load_snapshot(step)
            except SnapshotError as e:
                self.fall_back(generation, Fallback.SNAPSHOT_UNREADABLE, str(e))
        return step

    def fall_back(self, generation: int, cause: Fallback, detail: str = "") -> NoReturn:
        """The state cannot be put back at process level: every rank finds it alike, tells the controller
        (through its agent), and waits for the job-level restart to stop it, with no traceback."""
        failure = RollbackFailure(cause, not self.state.sharded and self.state.world_size > 1, detail)
        self.channel.rollback_failed(generation, failure)
        self.channel.await_stop(generation, failure)

    # -- the watch -------------------------------------------------------------------------------------

    def start_watch(self) -> None:
        self._watch = threading.Thread(target=self._watch_loop, name="ftrun-mindspore-repair-watch", daemon=True)
        self._watch.start()

    def close(self, deadline: float = 1.0) -> None:
        self._closed.set()
        if self._watch is not None:
            self._watch.join(deadline)

    def _watch_loop(self, exit: Callable[[int], Any] = os._exit) -> None:
        """Look at the relay folder until a repair is announced, then make sure the main thread takes
        part: stop the device under a step that does not leave, and leave the process (to be replaced)
        if even that does not free it within fault_wait."""
        while not self._closed.wait(WATCH_POLL):
            generation = self.generation
            if self.channel.target() > generation:
                self._see_through(generation, exit)

    def _see_through(self, generation: int, exit: Callable[[int], Any]) -> None:
        announced_at, stopped = time.monotonic(), False
        while not self._closed.is_set() and not self.repairing and self.generation <= generation:
            waited = time.monotonic() - announced_at
            if self.in_step and waited > INTERRUPT_AFTER and not stopped:
                stopped = True
                self.hooks.stop()
            if waited > self.fault_wait:
                log.error("rank %d: still in its step %.0fs after a repair was announced; exiting to be replaced",
                          self.state.rank, self.fault_wait)
                exit(EXIT_STUCK)
                return
            self._closed.wait(WATCH_POLL)
        while not self._closed.is_set() and self.generation <= generation:
            self._closed.wait(WATCH_POLL)  # the repair is under way on the main thread
