"""What the roster knows, added to an event the moment it is decided.

An observer reads the store; who holds a node, which idle spare could take its place, and whether a
person's request can be met are the roster's, and change as earlier events of the same turn are applied
(a takeover hands a spare to a node). So the controller completes each event here just before the policy
decides on it, and the policy reads no roster.
"""

from __future__ import annotations

import dataclasses
import logging

from ftrun.controller.board import StatusBoard
from ftrun.controller.inbox import Event, HostGone, NodeLost, OperatorAsked, Reported, StragglerSeen
from ftrun.controller.policy import operator_refusal, straggler_refusal
from ftrun.controller.roster import Roster
from ftrun.controller.states import JobView
from ftrun.messages import OperatorAction, ReportKind

log = logging.getLogger(__name__)


class RosterLookup:
    """Completes events from the roster (and the status board, for a rank's pid); ``signed``: whether the
    job takes requests from ``ftrun top`` (it has a token)."""

    def __init__(self, roster: Roster, board: StatusBoard, signed: bool, controller_agent: str = ""):
        self.roster, self.board, self.signed = roster, board, signed
        #: the agent whose process runs the controller: its node's ranks stay where they are
        self.controller_agent = controller_agent

    def complete(self, event: Event, view: JobView) -> Event | None:
        """``event`` with what the roster says now, or None when it no longer concerns the job."""
        if isinstance(event, HostGone):
            return self._host_gone(event, view)
        if isinstance(event, NodeLost):
            slot = self.roster.nodes.get(event.slot.node_rank, event.slot)
            spare = self.roster.spare_for(slot.nproc)
            return dataclasses.replace(event, slot=slot, spare=spare.agent_id if spare else "")
        if isinstance(event, Reported):
            return self._from_the_holder(event)
        if isinstance(event, OperatorAsked):
            return self._answered(event, view)
        if isinstance(event, StragglerSeen):
            return self._straggler(event, view)
        return event

    def _straggler(self, seen: StragglerSeen, view: JobView) -> StragglerSeen:
        """A straggler with the node that holds its rank, the spare that could take the node's ranks, and why
        they stay ("" when they move)."""
        slot = self.roster.holder_of_rank(seen.finding.rank)
        spare = self.roster.spare_for(slot.nproc) if slot is not None else None
        refusal = straggler_refusal(view, seen.replace, seen.finding.named, spare.agent_id if spare else "",
                                    seen.moved_before, slot is not None and slot.agent_id == self.controller_agent,
                                    seen.outside)
        if slot is None and not refusal:
            refusal = "no node holds it"
        return dataclasses.replace(seen, slot=slot, spare=spare.agent_id if spare else "", refusal=refusal)

    def _host_gone(self, gone: HostGone, view: JobView) -> Event | None:
        """The agent on a host is known to be gone (its ssh session ended): no need to wait for its keepalive.
        (In SSH mode every host runs one agent, named by its address.)"""
        node = self.roster.forget_host(gone.host)
        if node is None or node not in view.present:
            return None
        log.error(gone.detail)
        return self.complete(NodeLost(self.roster.nodes[node], gone.detail), view)

    def _from_the_holder(self, reported: Reported) -> Event | None:
        """A report counts from the agent that holds its node now; a node without usable devices is lost
        when a spare can take its place."""
        report = reported.report
        owner = self.roster.nodes.get(report.node_rank)
        if report.agent_id and owner is not None and report.agent_id != owner.agent_id:
            log.warning("ignoring a %s report from %s: node %d now belongs to %s", report.kind.value,
                        report.agent_id, report.node_rank, owner.agent_id)
            return None
        spare = self.roster.spare_for(owner.nproc) if owner is not None else None
        if report.kind is ReportKind.NODE_UNUSABLE and owner is not None and spare is not None:
            return NodeLost(owner, f"node {report.node_rank} ({owner.host}): {report.detail}", spare.agent_id)
        return reported

    def _answered(self, asked: OperatorAsked, view: JobView) -> OperatorAsked:
        """A person's request with the node it concerns, the spare a drain takes, the rank's pid, and why it
        is refused ("" when it is not)."""
        request = asked.request
        if request.action is OperatorAction.DRAIN:
            slot = self.roster.nodes.get(request.node_rank)
        else:
            slot = self.roster.holder_of_rank(request.rank)
        spare = self.roster.spare_for(slot.nproc) if slot is not None else None
        refusal = operator_refusal(view, request, self.signed, spare.agent_id if spare else "")
        if slot is None and not refusal and request.action is not OperatorAction.STOP:
            refusal = "no node holds it"
        pid = next((r.get("pid", 0) for r in self.board.snapshot.get("ranks", ()) if r["rank"] == request.rank), 0)
        return dataclasses.replace(asked, slot=slot, spare=spare.agent_id if spare else "", pid=pid, refusal=refusal)
