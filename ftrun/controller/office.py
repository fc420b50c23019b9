"""The controller's office under ``--rdzv-backend etcd``: its journal, written before each decision's
commands, and what it does while etcd does not answer.

Its writes to etcd hold only while its lease does (``leadership.py``): a controller that finds another
leads raises ``LeadershipLost`` and changes nothing more. While etcd has no quorum a decision's journal
waits, the controller's keepalive beating meanwhile (no other agent can lead then); past
--store-timeout the job stops. Without etcd (the c10d store) the office holds nothing and writes nothing.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable

from ftrun.controller.inbox import Event, StopAsked
from ftrun.controller.journal import Journal, JournalWriter
from ftrun.controller.leadership import Leadership, LeadershipLost
from ftrun.controller.narrator import Narrator
from ftrun.controller.publisher import Publisher
from ftrun.controller.roster import OwnPause, Roster
from ftrun.controller.states import JobView, Phase
from ftrun.errors import ExitCode
from ftrun.etcd import EtcdUnavailable
from ftrun.keys import AGENT_HEARTBEAT_INTERVAL
from ftrun.messages import RendezvousResult

#: between two tries of a journal write while etcd has no quorum
JOURNAL_RETRY = 0.5


class EtcdOffice:
    """One controller's term in etcd (``leadership`` None: the c10d store, no office); ``resume``: the
    journal of the controller before it, which it goes on from (None: it starts the job)."""

    def __init__(self, leadership: Leadership | None, resume: Journal | None, agent_id: str, host: str,
                 narrator: Narrator, publisher: Publisher, pause: OwnPause, store_timeout: float,
                 clock: Callable[[], float] = time.monotonic):
        self.leadership = leadership
        self.agent_id, self.host = agent_id, host
        self.narrator, self.publisher, self.pause = narrator, publisher, pause
        self.store_timeout = store_timeout
        self.clock = clock
        #: how many controllers led the job before this one
        self.moves = resume.moves + 1 if resume is not None else 0
        self._writer = JournalWriter(resume)
        #: etcd did not answer for --store-timeout: why the job stops ("" while it answers)
        self.lost = ""
        #: set by its agent when it goes to another controller (``Controller.retire``)
        self.retired = threading.Event()

    def check_term(self) -> None:
        """LeadershipLost once this controller's lease lapsed, or its agent follows another controller."""
        if self.leadership is not None and self.leadership.lost.is_set():
            raise LeadershipLost("this agent's lease lapsed: another may lead now")
        if self.retired.is_set():
            raise LeadershipLost("this agent follows another controller now")

    def record(self, view: JobView | None, rendezvous: RendezvousResult | None, roster: Roster, started_world: int,
               started_at: float) -> None:
        """The job's state, in etcd, if this controller still leads (else LeadershipLost). While etcd has
        no quorum the decision waits, the keepalive going on; past --store-timeout the job stops. A failed
        collective the policy holds is left out: it is this controller's to time, and waiting on etcd for
        it would hold the decision that follows it."""
        if self.leadership is None or view is None or self.lost:
            return
        journal = Journal(self.agent_id, self.host, dataclasses.replace(view, held=None), rendezvous,
                          tuple(roster.nodes[n] for n in sorted(roster.nodes)), tuple(roster.spares), started_world,
                          self.moves, started_at)
        if not self._writer.due(journal):
            return
        leadership, since = self.leadership, self.clock()
        while True:
            try:
                self._beating_while(lambda: self._writer.write(leadership, journal), view.generation)
                return
            except EtcdUnavailable as e:
                self._say_unreachable(view.generation, str(e))
                if self.clock() - since > self.store_timeout:
                    self.lost = self._lost_reason(str(e))
                    return
                self._beating_while(lambda: time.sleep(JOURNAL_RETRY), view.generation)

    def _beating_while(self, call: Callable[[], object], generation: int) -> None:
        """``call()`` (a write to etcd) in a thread of its own while this one beats the controller's
        keepalive, so that a decision that waits for etcd is not taken for a controller gone. Each call to
        etcd may take the client's deadline (10 s) or more while it has no quorum; done in this thread, the
        keepalive stopped with it, every agent took the controller for lost after --node-timeout and the
        repair under way fell to job level (issue 40). Only this thread beats: a controller that hangs
        anywhere else still goes silent."""
        outcome: list[BaseException] = []

        def run() -> None:
            try:
                call()
            except BaseException as e:  # raised again in the controller's thread
                outcome.append(e)

        worker = threading.Thread(target=run, name="ftrun-journal", daemon=True)
        worker.start()
        while True:
            worker.join(AGENT_HEARTBEAT_INTERVAL)
            self.pause.turned(self.clock())  # waiting for etcd is no pause; being stopped while it waits is
            if not worker.is_alive():
                break
            if self.retired.is_set():  # what it writes, if etcd takes it, is the journal it had decided
                raise LeadershipLost("this agent follows another controller now")
            self.publisher.heartbeat()
            if self.leadership is not None and self.leadership.unreachable_since:
                self._say_unreachable(generation, "its lease could not be renewed")
        if outcome:
            raise outcome[0]

    def observe(self, view: JobView, now: float) -> list[Event]:
        """Say once that etcd does not answer, and that it answers again; the job stops past --store-timeout."""
        if self.leadership is None or view.phase in (Phase.EXITING, Phase.DONE):
            return []
        since = self.leadership.unreachable_since
        if since and not self.lost:
            self._say_unreachable(view.generation, "its lease could not be renewed")
            if now - since > self.store_timeout:
                self.lost = self._lost_reason("its lease could not be renewed")
        elif not since and self.narrator.etcd_down:
            self.narrator.etcd_back(view.generation)
            self.publisher.etcd_unreachable("")
        return [StopAsked(ExitCode.JOB_FAILED, self.lost)] if self.lost else []

    def _lost_reason(self, detail: str) -> str:
        return f"the control store (etcd) was unreachable for {self.store_timeout:g}s: {detail}"

    def _say_unreachable(self, generation: int, detail: str) -> None:
        if not self.narrator.etcd_down:
            self.narrator.etcd_unreachable(generation, detail)
            self.publisher.etcd_unreachable(detail)
