"""The rank's line to the control plane: its heartbeat, the repair watch, the targets and milestones of
a repair, and what it tells the controller and the status view.

Under ftrun a :class:`ControlLink` holds the control store (its connections follow it when it moves:
store_location.py) and two threads, each on a connection of its own: the heartbeat (the agent takes a
rank whose heartbeat stops for hung) and the repair watch, which sleeps on the store until the next
generation is announced and then makes sure the main thread leaves the collective it may be blocked in.
Under plain torchrun a :class:`NullLink` stands in: nothing is announced, and a failed collective ends
the process as torchrun expects.
"""

from __future__ import annotations

import dataclasses
import datetime
import faulthandler
import logging
import os
import sys
import threading
import time
from typing import Callable, NoReturn

import torch.distributed as dist

from ftrun.auth import Signer
from ftrun.contract import CollectiveFailure, Milestone, RollbackFailure, WorkerEnv, parse_endpoint
from ftrun.elastic.backends import DeviceNotStopped
from ftrun.elastic.groups import GroupSet, first_line
from ftrun.elastic.store_location import StoreLocation
from ftrun.errors import EXIT_STUCK
from ftrun.keys import GROUP_READY, JobKeys
from ftrun.snapshots.plan import RestorePlan, RestoreSource
from ftrun.step_times import SaveClock, StepClock, collective_text
from ftrun.store import CONNECT_TIMEOUT, ControlStore

log = logging.getLogger("ftrun.elastic")
#: how often a rank writes its heartbeat and its committed step (the agent's and the controller's
#: intervals are their own)
WORKER_HEARTBEAT_INTERVAL = 1.0
#: the deadline of each of the repair watch's waits (it waits again after each)
WATCH_TIMEOUT = 3600.0
#: after a repair is announced, how long the main thread may take to notice before it is interrupted: one
#: tick of the watch. Every collective of the old generation is lost anyway, and a rank whose neighbours
#: are alive (in a ring all-reduce, all but the dead rank's) would otherwise wait out the whole delay
INTERRUPT_AFTER = 0.01
#: how long close(), or the interpreter's end, waits for the heartbeat and the repair watch: one still
#: connecting to the store is waited for as long as a connect may take
LET_GO_DEADLINE = CONNECT_TIMEOUT + 1.0
#: how long a rank whose rollback fell back to job level waits for its agent to stop it (the controller
#: reads the failure within a tick and the agents stop their ranks at once: well under a second)
FALLBACK_WAIT = 60.0
#: how often that rank looks for a newer repair meanwhile (one store read: every rank of the job waits so)
FALLBACK_POLL = 0.2


class NullLink:
    """Plain torchrun: no control plane. No repair is ever announced, so a fault ends the process."""

    #: whether a repair can replace ranks (and the library must prepare for one)
    repairs = False
    #: the generation this rank's groups belong to
    generation = 0

    def repair_target(self, error: BaseException, step: int) -> int | None:
        return None

    def step_begins(self) -> None:
        pass

    def first_step_committed(self) -> None:
        pass

    def step_ends(self) -> BaseException | None:
        return None

    def lost_collective(self) -> BaseException | None:
        return None

    def collective_failed(self, error: BaseException) -> None:
        pass

    def tell_total_steps(self, total: int) -> None:
        pass

    def refuse_process_level(self, reason: str) -> bool:
        return False

    def restore_plan(self, generation: int) -> RestorePlan | None:
        return None

    def report_damaged(self, source: RestoreSource) -> None:
        pass

    def let_go(self) -> None:
        pass

    def close(self, step: int) -> None:
        pass

    def report_progress(self, step: int) -> None:
        pass


class ControlLink:
    """One rank's link to its job's controller, through the control store."""

    repairs = True

    def __init__(self, env: WorkerEnv, signer: Signer, collective_timeout: float, fault_wait: float):
        self.rank = env.rank
        self.world_size = env.world_size
        self.node_rank = env.node_rank
        self.keys = JobKeys(env.run_id)
        self.collective_timeout = collective_timeout
        #: after a collective raises, how long to wait for the controller to announce a repair
        self.fault_wait = fault_wait
        #: where the control store is: it moves when the controller's node is lost (FTRUN_CONTROL_STORE_FILE)
        self.location = StoreLocation(parse_endpoint(env.control_store, 0, "FTRUN_CONTROL_STORE"),
                                      env.control_store_file, env.store_timeout, env.rank)
        self.store = ControlStore(self.location.connect(collective_timeout), self.location.endpoint,
                                  is_host=False, signer=signer)
        #: the generation this rank's groups belong to (-1: none yet)
        self.generation = -1
        #: a replacement: the generation it was spawned into, which it joins without having stopped
        self.spawned_for = env.generation if env.replacement else None
        #: the generation this process was started into
        self.born = env.generation
        #: the main thread is in a repair: the watch leaves it alone
        self.repairing = False
        self._groups: GroupSet | None = None
        self._closed = threading.Event()
        #: wakes the heartbeat before its second is up: a failed collective to report, or the close
        self._wake = threading.Event()
        #: a failed collective of this rank, for the heartbeat to report (then None)
        self._failed: CollectiveFailure | None = None
        self._heartbeat: threading.Thread | None = None
        self._watcher: threading.Thread | None = None
        #: the announcement key the repair watch waits on (this rank's own, of the next generation);
        #: "" before the watch first waits and once let_go rang it
        self._watch_key = ""
        #: each step's time and its waits inside collectives, which the heartbeat reports (stragglers)
        self.clock = StepClock()
        #: the checkpoint save under way and the longest measured, which the heartbeat reports (a save is no stall)
        self.saves = SaveClock()

    def start(self, groups: GroupSet, progress: Callable[[], int]) -> None:
        """Start the heartbeat, which reports ``progress()`` (the committed step), and the repair watch,
        which releases ``groups`` when a repair is announced."""
        self._groups = groups
        groups.on_failure = self.collective_failed
        self._heartbeat = threading.Thread(target=self._beat, name="ftrun-heartbeat", args=(progress,), daemon=True)
        self._watcher = threading.Thread(target=self._watch, name="ftrun-repair-watch", daemon=True)
        self._heartbeat.start()
        self._watcher.start()

    # -- a step -------------------------------------------------------------------------------------

    def step_begins(self) -> None:
        self._groups.in_step = True
        self._groups.waited = 0.0
        self.clock.begin()

    def step_ends(self) -> BaseException | None:
        """The step's body is over: the failure of one of its collectives, if one failed. A step whose
        collectives held is timed: how long it took, and how long of that it waited inside them."""
        groups = self._groups
        groups.in_step = False
        self.clock.end(groups.waited, committed=groups.failure is None)
        return groups.failure

    def lost_collective(self) -> BaseException | None:
        return self._groups.failure if self._groups is not None else None

    def first_step_committed(self) -> None:
        """This process committed its first step: the heartbeat writes it at once, not up to a second later
        (the status shows it at once)."""
        self._wake.set()

    def collective_failed(self, error: BaseException) -> None:
        """One of this rank's collectives failed (from whichever thread saw it: a future's callback may run
        in the backend's): the heartbeat tells the controller at once, on its own connection. Where every
        process lives (a link cut), nobody else would: the controller repairs in place (the online level).
        Not when a repair announced already released the collective: that one is under way."""
        generation = self.generation
        if self._groups is not None and self._groups.abandoned >= generation:
            return
        self._failed = CollectiveFailure(self.rank, generation, first_line(error), time.time())
        self._wake.set()

    def repair_target(self, error: BaseException, step: int) -> int | None:
        """The generation to repair into if ``error`` comes from a fault elsewhere (a collective
        failed and the controller announces a repair); None when it is this rank's own error,
        which must end the process."""
        if not isinstance(error, RuntimeError):  # torch's DistError is one
            return None
        target = self.await_target(above=self.generation, timeout=self.fault_wait)
        if target is not None:
            log.warning("rank %d: step %d interrupted (%s); repairing into generation %d",
                        self.rank, step, first_line(error), target)
        return target

    # -- the repair's side of the store -------------------------------------------------------------

    def target(self) -> int:
        """The newest generation the controller announced."""
        text = self.store.try_text(self.keys.target_generation)
        return int(text) if text else 0

    def replaced_since_start(self, target: int) -> bool:
        """Whether a repair since this process started, up to generation ``target``, started this rank again
        elsewhere: a frozen node's rank, woken after a spare took its place, must not join in its stead. Never
        a replacement: a newer repair that still names its rank is one it goes on into (a successor's, say)."""
        if self.spawned_for is not None:
            return False
        for generation in range(self.born + 1, target + 1):
            text = self.store.try_text(self.keys.replaced(generation))
            if text and str(self.rank) in text.split(","):
                return True
        return False

    def await_target(self, above: int, timeout: float) -> int | None:
        """The first generation announced above ``above`` within ``timeout`` seconds, or None. While the
        control store is away (its node lost, a successor's not yet named) the clock stops: the successor
        announces its repair only once its store is up, so ``timeout`` counts from then."""
        deadline = time.monotonic() + timeout
        while True:
            target = self.target()  # waits here while the store moves
            if target > above:
                return target
            deadline = max(deadline, self.location.back_at + timeout)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.01)

    def reach(self, generation: int, milestone: Milestone) -> int:
        """Count this rank in at ``milestone`` of ``generation``; how many ranks have reached it."""
        return self.store.add(self.keys.milestone(generation, milestone.value))

    def mark_group_ready(self, generation: int) -> None:
        """Every rank arrived in ``generation``: its groups may connect."""
        self.store.set_text(self.keys.group_ready(generation), GROUP_READY)

    def group_ready(self, generation: int, timeout: float) -> bool:
        """Wait until every rank arrived in ``generation`` (True) or the controller superseded it (False);
        TimeoutError after ``timeout`` seconds. No polling: both are one key's value."""
        ready = self.keys.group_ready(generation)
        try:
            self.store.raw.wait([ready], datetime.timedelta(seconds=timeout))
        except Exception:
            raise TimeoutError(f"generation {generation}: not every rank arrived within {timeout:g}s") from None
        return self.store.try_text(ready) == GROUP_READY

    def rollback_failed(self, generation: int, failure: RollbackFailure) -> None:
        """Tell the controller why this rank's rollback falls back to job level: it says so once, for every rank."""
        self.store.set_text(self.keys.rollback_failure(generation), failure.to_text())

    def await_stop(self, generation: int, failure: RollbackFailure) -> NoReturn:
        """After :meth:`rollback_failed`: wait for the agent to stop this rank for the job-level restart
        (its SIGTERM ends the process, which the agent expects of a stop). No traceback: the controller
        says why, once. If no stop comes within FALLBACK_WAIT (the controller is gone), leave with one line."""
        deadline = time.monotonic() + FALLBACK_WAIT
        while time.monotonic() < deadline:
            time.sleep(FALLBACK_POLL)
            newer = self.target()
            if newer > generation:
                # a rank died before the controller read the failure, and it announced a newer repair:
                # that one cannot put the state back either, so it falls back at once too
                generation = newer
                self.rollback_failed(generation, failure)
        raise SystemExit(f"ftrun.elastic: rank {self.rank}: {failure.reason}; no job-level restart came within "
                         f"{FALLBACK_WAIT:g}s")

    # -- what the controller and the status view are told ----------------------------------------------

    def tell_total_steps(self, total: int) -> None:
        self.store.set_text(self.keys.total_steps, str(total))  # the status view's progress and ETA

    def refuse_process_level(self, reason: str) -> bool:
        """Tell the controller why the layout rules process-level repair out; False when a generation
        before this one told it already."""
        if self.store.try_text(self.keys.process_level_refused) == reason:
            return False
        self.store.set_text(self.keys.process_level_refused, reason)
        return True

    def restore_plan(self, generation: int) -> RestorePlan | None:
        """The controller's plan of what this node's ranks restore after a job-level restart."""
        return self.store.try_get(RestorePlan, self.keys.restore_plan(generation, self.node_rank))

    def report_damaged(self, source: RestoreSource) -> None:
        self.store.append(self.keys.damaged_count, self.keys.damaged, source)

    # -- the end -----------------------------------------------------------------------------------------

    def close(self, step: int) -> None:
        """Stop the threads, then report the final ``step``."""
        self.let_go()
        self.report_progress(step)

    def report_progress(self, step: int) -> None:
        """This rank's committed ``step`` in the store now, not at the next heartbeat (the end of a
        framework's training loop, which may not close the job: the script goes on to evaluate, say)."""
        try:
            self.store.set_text(self.keys.rank_progress(self.rank), str(step))
        except Exception:
            pass  # the controller is gone already

    def let_go(self) -> None:
        """Stop the heartbeat and the repair watch and wait for them, up to LET_GO_DEADLINE: a thread that
        comes out of a store call while the interpreter tears down aborts the process ("terminate called
        without an active exception", SIGABRT), whatever the script's exit code. A watch parked in the
        store's wait is let out by setting the key it waits on, this rank's own; else a repair announced,
        or the store gone, as the process ends would take it out of there then."""
        self._closed.set()
        self._wake.set()
        self.location.closing = True  # a store gone now is not waited for: the rank is ending
        deadline = time.monotonic() + LET_GO_DEADLINE
        # _closed first, the key second; the watch sets its key, then checks _closed: it sees the close, or
        # its wait is rung (a ring before the wait ends it at once)
        key, self._watch_key = self._watch_key, ""  # rung once (close(), then the interpreter's end)
        if key:
            try:
                self.store.set_text(key, "closed")
            except Exception:
                pass  # the store is gone: the watch's wait has failed or fails at once
        for thread in (self._heartbeat, self._watcher):
            if thread is not None:
                thread.join(max(0.0, deadline - time.monotonic()))

    # -- the threads ---------------------------------------------------------------------------------

    def _beat(self, progress: Callable[[], int]) -> None:
        """Once a second: this rank's heartbeat and committed step, on a connection of its own. A store
        client runs one operation at a time: behind the main thread's wait for a slow replacement to
        form the group, the heartbeat would stop and the agent would take this healthy rank for hung.
        Woken at once to report a failed collective (:meth:`collective_failed`)."""
        try:
            store = ControlStore(self.location.connect(self.collective_timeout), self.location.endpoint, is_host=False)
        except Exception:
            return
        while True:
            self._wake.wait(WORKER_HEARTBEAT_INTERVAL)
            self._wake.clear()
            if self._closed.is_set():
                return
            try:
                failed, self._failed = self._failed, None
                if failed is not None:  # the first rank's word stays: the root cause
                    store.raw.compare_set(self.keys.collective_failure(failed.generation), "", failed.to_text())
                store.add(self.keys.rank_heartbeat(self.rank))
                waiting = self._groups.waiting_now() if self._groups is not None else None
                times = dataclasses.replace(self.clock.times(), save=self.saves.longest)
                store.set_each([self.keys.rank_progress(self.rank), self.keys.rank_step_times(self.rank),
                                self.keys.rank_collective(self.rank)],
                               [str(progress()), times.to_text(), collective_text(waiting, os.getpid(), self.saves.since)])
            except Exception:
                return  # the store is gone and did not move: the agent stops this process

    def _watch(self) -> None:
        """Sleep on the store until the next generation is announced, then make sure this rank joins.

        A blocking wait on a connection of its own: no periodic wake-ups that would take the GIL
        from the training thread. When a repair is announced and the main thread has not joined it
        shortly after, it sits in a collective that waits on a healthy peer: release it. If even that
        does not free it, leave, so that the repair replaces this rank instead of waiting for it.
        """
        try:
            store = self.location.connect(self.collective_timeout)
        except Exception:
            return
        while True:
            generation = self.generation
            self._watch_key = self.keys.announced(generation + 1, self.rank)
            if self._closed.is_set():
                return
            try:
                store.wait([self._watch_key], datetime.timedelta(seconds=WATCH_TIMEOUT))
            except dist.DistNetworkError:
                # the store is gone and did not move (a store that moves is followed inside the wait):
                # nothing more can be announced, and every further wait would fail at once
                return
            except Exception:
                continue  # nothing announced within the wait's deadline: wait again
            if self._closed.is_set():
                return  # rung by let_go
            self._see_through_repair(generation)

    def _interrupt(self) -> None:
        """Release the main thread from the collective it waits in; a device that cannot be stopped would
        hold it there for good, and this rank exits to be replaced at once."""
        try:
            self._groups.interrupt()
        except DeviceNotStopped as e:
            log.error("rank %d: %s; exiting to be replaced", self.rank, e)
            os._exit(EXIT_STUCK)

    def _see_through_repair(self, generation: int) -> None:
        self._groups.abandon(generation)  # a group still connecting may wait for a peer that died
        announced_at = time.monotonic()
        interrupted = False
        while not self._closed.is_set() and not self.repairing and self.generation <= generation:
            waited = time.monotonic() - announced_at
            if waited > INTERRUPT_AFTER and not interrupted:
                interrupted = True
                self._interrupt()
            if waited > self.fault_wait:
                log.error("rank %d: blocked in a collective %.0fs after a repair was announced; exiting to be replaced "
                          "(where each thread was, below)", self.rank, self.fault_wait)
                faulthandler.dump_traceback(sys.stderr, all_threads=True)
                os._exit(EXIT_STUCK)
            time.sleep(0.01)
        while not self._closed.is_set() and self.generation <= generation:
            time.sleep(0.05)  # the repair is under way on the main thread
