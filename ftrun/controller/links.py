"""A data link gone dark, and a job that stands still: what the controller sees and does.

Two watches, each a pure decision over a frozen state with the clock passed in, and one observer that
feeds them from the store and turns what they decide into the controller's events:

* the ladder (:func:`on_link_report`, :func:`on_link_tick`): a node's agent reports its data link dark or
  back (``ftrun.detection.links``, within LINK_POLL of the kernel's word). Back within the online window:
  the job is repaired online, no process started, the moment it is back (every rank's stuck connection
  is given up and the groups re-form on fresh ones, instead of waiting out TCP's retransmission backoff).
  Dark for longer than the window with an idle spare: the node's ranks move to the spare at process
  level, the others keep their processes. No spare: the job waits for the link, and says so, until
  ``--repair-timeout``; then it ends, in one line, with a non-zero exit (a job-level restart would form the new
  generation's groups over the same dark link: on the test bed it failed to connect at once, its online repair
  stood until its own deadline, and the budget was spent on nothing). A link that goes dark ``flaps`` times within
  ``flap_window`` moves its node to a spare (where there is one) the next time.
* the stall (:class:`StallWatch`): every rank alive and beating, and no step committed for longer than the
  job's own steps allow: ``factor`` times a high percentile of its recent step times, never under the
  longest step it has had (an evaluation, or a save the worker library does not see, among them) times
  ``factor / 2``, and never under ``floor``. While a rank saves a checkpoint (its heartbeat says so), the
  job's saves set the bound instead: SAVE_FACTOR times the longest save measured, never under the steps'.
  Said in one line, shown in the status (``stalled``), cleared when a step is committed or the save ends.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Union

from ftrun.controller.inbox import Event, LinkBack, LinkLost, NodeLost, Reported
from ftrun.controller.states import JobView, Phase
from ftrun.detection.reach import Verdict, localise
from ftrun.events import EventLog
from ftrun.messages import NodeSlot, ReportKind
from ftrun.timeouts import (
    FIRST_SAVE,
    SAVE_FACTOR,
    STALL_FACTOR,
    STALL_FLOOR,
    STALL_PERCENTILE,
    STALL_SAMPLES,
    contradictions,
    save_contradictions,
)

log = logging.getLogger(__name__)

#: how long a dark data link may stay dark, with a spare idle, before its node's ranks move there (s)
ONLINE_WINDOW = 2.0
#: a node whose data link went dark this many times within FLAP_WINDOW seconds moves to a spare
FLAPS, FLAP_WINDOW = 3, 300.0
#: a pair of nodes the probe finds answering again within this many seconds of their OS's word about a link is
#: that link's return, already repaired: no second online repair
OS_EXPLAINS = 5.0
#: after this many measured steps the timeout chain is checked against the job's step time, once
MEASURED_CHECK = 20
#: a rank whose heartbeat is older than this is not "beating" (its agent's hang check takes it first)
BEATING = 3.0


@dataclass(frozen=True)
class LinkRules:
    online_window: float = ONLINE_WINDOW
    flaps: int = FLAPS
    flap_window: float = FLAP_WINDOW
    #: --repair-timeout: with no spare, how long the job waits for a dark link before it ends
    repair_timeout: float = 60.0


@dataclass(frozen=True)
class DarkLink:
    node_rank: int
    #: the agent's words ("data link eth1 dark (operstate down, no carrier)")
    detail: str
    #: when the controller heard of it (its monotonic clock)
    since: float
    #: who said it: the node's OS ("os"), or the data network's probe ("probe"); only the same source clears it
    source: str = "os"


@dataclass(frozen=True)
class Links:
    """The ladder's state: the dark links, each node's recent downs, and what was said or done."""

    dark: tuple[DarkLink, ...] = ()
    #: (node, when) of every down within the flap window
    downs: tuple[tuple[int, float], ...] = ()
    #: nodes whose ranks were sent to a spare (their agent leaves): nothing more is done for them
    moved: frozenset[int] = frozenset()
    #: nodes for which "no spare: waiting" was said
    waiting: frozenset[int] = frozenset()
    #: the job's end was asked for (once): a link stayed dark past --repair-timeout with no spare
    ended: bool = False

    def dark_link(self, node_rank: int) -> DarkLink | None:
        return next((d for d in self.dark if d.node_rank == node_rank), None)

    def flaps(self, node_rank: int) -> int:
        return sum(1 for node, _ in self.downs if node == node_rank)


@dataclass(frozen=True)
class MoveToSpare:
    node_rank: int
    detail: str


@dataclass(frozen=True)
class RepairOnline:
    node_rank: int
    detail: str


@dataclass(frozen=True)
class LeaveOut:
    """A link stayed dark past --repair-timeout, no spare can take its node, and --nnodes MIN allows one node
    fewer: the job goes on without it (a job-level restart in a smaller world; its agent leaves)."""

    node_rank: int
    detail: str


@dataclass(frozen=True)
class EndJob:
    """A link stayed dark past --repair-timeout and no spare can take its node: the job ends (``detail``: why)."""

    detail: str


@dataclass(frozen=True)
class Say:
    """A line for the log and the event log (``kind``: link or stall), about ``node_rank`` (-1: the job)."""

    line: str
    node_rank: int = -1
    kind: str = "link"


Action = Union[MoveToSpare, RepairOnline, LeaveOut, EndJob, Say]


def on_link_report(links: Links, node_rank: int, up: bool, detail: str, now: float, rules: LinkRules,
                   spare: bool, source: str = "os", host: int = -1) -> tuple[Links, list[Action]]:
    """A node's data link went dark (``up`` False) or came back, as ``source`` says (its OS, or the data
    network's probe: a dark link is cleared only by the source that said it). ``host``: the node whose agent
    hosts the controller, which never moves (its agent would leave, and the job's store with it)."""
    spare = spare and node_rank != host
    dark = links.dark_link(node_rank)
    if node_rank in links.moved:
        return links, []
    if not up:
        if dark is not None:
            return links, []
        downs = tuple(d for d in links.downs if now - d[1] <= rules.flap_window) + ((node_rank, now),)
        links = dataclasses.replace(links, dark=links.dark + (DarkLink(node_rank, detail, now, source),), downs=downs)
        said = Say(f"node {node_rank}: {detail}; its collectives stand still until it is back", node_rank)
        count = links.flaps(node_rank)
        if count >= rules.flaps and spare:
            flapped = f"{detail}, {count} times in {rules.flap_window:g}s (a flapping link)"
            return dataclasses.replace(links, moved=links.moved | {node_rank}), [said, MoveToSpare(node_rank, flapped)]
        return links, [said]
    if dark is None or dark.source != source:
        return links, []
    links = dataclasses.replace(links, dark=tuple(d for d in links.dark if d is not dark),
                                waiting=links.waiting - {node_rank})
    back = f"node {node_rank}: {detail} after {now - dark.since:.1f}s dark"
    return links, [Say(back, node_rank), RepairOnline(node_rank, back)]


def on_link_tick(links: Links, now: float, rules: LinkRules, spare: bool, running: bool,
                 host: int = -1, shrink: bool = False) -> tuple[Links, list[Action]]:
    """A dark link, a moment later: moved to a spare past the online window, or waited for, said so, and
    after --repair-timeout left out of the job (``shrink``: --nnodes MIN allows one node fewer) or the job's
    end. Nothing while a repair or an exit is under way. ``host``'s node (the controller's) never moves and is
    never left out: it is waited for as with no spare, then the job ends."""
    if not running:
        return links, []
    actions: list[Action] = []
    for dark in links.dark:
        node, dark_for = dark.node_rank, now - dark.since
        if node in links.moved:
            continue
        if spare and node == host and node not in links.waiting:
            links = dataclasses.replace(links, waiting=links.waiting | {node})
            actions.append(Say(f"node {node} hosts the controller: its ranks stay; waiting for its data link to "
                               f"come back {_until(rules, False)}", node))
            continue
        spare_here, leave_out = spare and node != host, shrink and node != host
        if spare_here and dark_for >= rules.online_window:
            links = dataclasses.replace(links, moved=links.moved | {node})
            actions.append(MoveToSpare(node, f"{dark.detail} for {dark_for:.1f}s (past the online window, "
                                             f"{rules.online_window:g}s)"))
        elif not spare_here and node not in links.waiting:
            links = dataclasses.replace(links, waiting=links.waiting | {node})
            actions.append(Say(f"no spare node to move node {node}'s ranks to: waiting for its data link to "
                               f"come back {_until(rules, leave_out)}", node))
        elif not spare_here and dark_for >= rules.repair_timeout and leave_out:
            links = dataclasses.replace(links, moved=links.moved | {node})
            actions.append(LeaveOut(node, f"{dark.detail} for {dark_for:.0f}s (--repair-timeout "
                                          f"{rules.repair_timeout:g}s), with no spare node to move its ranks to"))
        elif not spare_here and dark_for >= rules.repair_timeout and not links.ended:
            links = dataclasses.replace(links, ended=True)
            actions.append(EndJob(f"node {node}: {dark.detail} for {dark_for:.0f}s (--repair-timeout "
                                  f"{rules.repair_timeout:g}s), with no spare node to move its ranks to; a restart "
                                  f"would form the groups over the same dark link (to wait longer, raise "
                                  f"--repair-timeout; to move the node, give the job a spare: --spares)"))
    return links, actions


def _until(rules: LinkRules, leave_out: bool) -> str:
    """What the wait for a dark link with no spare is bounded by, and what comes after it, in words."""
    after = "the job goes on without the node (--nnodes allows it)" if leave_out else "the job ends"
    return f"(up to --repair-timeout {rules.repair_timeout:g}s; then {after})"


def taken_over(links: Links, node_rank: int) -> Links:
    """Node ``node_rank`` moved to a spare and the spare holds its place now: what the ladder knew of the old
    holder's link (dark, its downs, its move, its wait) is forgotten; the new holder's link starts afresh (else the
    job showed stalled for good after the move, and the new holder's own dark link went unsaid)."""
    return dataclasses.replace(links, dark=tuple(d for d in links.dark if d.node_rank != node_rank),
                               downs=tuple(d for d in links.downs if d[0] != node_rank),
                               moved=links.moved - {node_rank}, waiting=links.waiting - {node_rank})


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


@dataclass(frozen=True)
class Saving:
    """A rank that saves a checkpoint now, as the snapshot shows it: the one that has saved longest, and for how long."""

    rank: int
    seconds: float


@dataclass(frozen=True)
class Stall:
    """The job stands still: since when (monotonic), for how long, the bound it passed, and why that bound; the
    rank that saves a checkpoint meanwhile, where one does (a save that outlasts its bound)."""

    since: float
    waited: float
    bound: float
    basis: str
    saving: Saving | None = None


class StallWatch:
    """Every rank alive and beating, no step committed for longer than the job's own step times allow, or, while
    a rank saves a checkpoint, than its saves allow."""

    def __init__(self, factor: float = STALL_FACTOR, floor: float = STALL_FLOOR, samples: int = STALL_SAMPLES):
        self.factor, self.floor, self.samples = factor, floor, samples
        self.durations: list[float] = []
        #: the longest checkpoint save any rank measured (0: none yet)
        self.longest_save = 0.0
        #: the step last seen (None before the first committed step), and when the clock last started: the step's
        #: first sight, or the end of a checkpoint save seen since (a save is no step time: it has its own bound)
        self._step: int | None = None
        self._since = 0.0
        self._saw_save = False
        #: the first step committed since the clock started (the job's, or a repair's first) is no step time: it
        #: imports, compiles and forms the groups, and twice it would bound the next STALL_SAMPLES steps
        self._first = True
        self.stalled: Stall | None = None

    def bound(self) -> tuple[float, str]:
        """The bound now, and what it comes from."""
        if not self.durations:
            return self.floor, f"floor {self.floor:g}s"
        high = _percentile(self.durations, STALL_PERCENTILE)
        longest = max(self.durations)
        candidates = [(self.factor * high, f"{self.factor:g} x p{STALL_PERCENTILE * 100:.0f} step {high:.2f}s"),
                      (self.factor / 2 * longest, f"{self.factor / 2:g} x the longest step {longest:.2f}s"),
                      (self.floor, f"floor {self.floor:g}s")]
        return max(candidates)

    def save_bound(self) -> tuple[float, str]:
        """The bound while a rank saves a checkpoint: SAVE_FACTOR x the longest save measured (FIRST_SAVE before
        any was), never under the step's bound."""
        longest = self.longest_save
        save = ((SAVE_FACTOR * longest, f"{SAVE_FACTOR:g} x the longest save {longest:.2f}s") if longest
                else (FIRST_SAVE, f"a first save: {FIRST_SAVE:g}s"))
        return max(save, self.bound())

    def pause(self, now: float) -> None:
        """A repair or a restart: its time is no step time, and the clock starts again at its end."""
        self._step, self.stalled, self._first = None, None, True

    def observe(self, now: float, step: int | None, beating: bool, saving: Saving | None = None,
                longest_save: float = 0.0) -> Stall | None:
        """The lowest committed step across ranks, seen at ``now``; ``beating``: every rank alive with a fresh
        heartbeat; ``saving``: a rank that saves a checkpoint now, if one does; ``longest_save``: the longest save
        a rank measured. The stall while it lasts (None once a step is committed; never before the job's first
        step time is known: the first step imports, compiles and forms the groups). A save's end starts the
        clock again: the step that waited for it is on its way, and its time is no step's."""
        self.longest_save = max(self.longest_save, longest_save)
        saw_save, self._saw_save = self._saw_save, saving is not None
        if step is None:
            return None
        if saw_save and saving is None:
            self._since = now
        if self._step is None or step < self._step:
            self._step, self._since, self.stalled = step, now, None
            return None
        if step > self._step:
            if not self._first:
                per_step = (now - self._since) / (step - self._step)
                self.durations = (self.durations + [per_step])[-self.samples:]
            self._step, self._since, self.stalled, self._first = step, now, None, False
            return None
        if not self.durations:
            return None  # no step time yet: the first step (imports, compilation, the group's forming) is none
        waited = now - self._since
        bound, basis = self.save_bound() if saving is not None else self.bound()
        # a rank not beating is dead or hung: the hang check and the exit path take it
        self.stalled = Stall(self._since, waited, bound, basis, saving) if beating and waited > bound else None
        return self.stalled


def _rank_runs(members: list[int]) -> str:
    """Ranks in words, runs shortened: "rank 3", "ranks 0-3", "ranks 0-1, 4"."""
    members = sorted(members)
    ranges, start = [], members[0]
    for index, member in enumerate(members):
        if index + 1 == len(members) or members[index + 1] != member + 1:  # a run of ranks ends here
            ranges.append(f"{start}-{member}" if member != start else f"{start}")
            start = members[index + 1] if index + 1 < len(members) else member
    return f"rank{'s' if len(members) > 1 else ''} {', '.join(ranges)}"


def where_ranks_stand(ranks: list[dict]) -> str:
    """Which ranks wait in which collective, in words, from the snapshot's rank rows (their committed ``step``
    and ``collective``: ``{"op", "group", "group_size", "for"}`` while they wait in one, ``{}`` while in none,
    None where no word came; ``saving``: for how long they have saved a checkpoint, None while they save none):
    "rank 6 saves a checkpoint for 34s (step 23); ranks 0-1 wait in all_reduce (step 23) for 12s; ranks 2-3 in
    broadcast on group 1 of 2 ranks (step 23) for 11s; rank 4 computes (step 23); rank 5: no report". The ranks
    that save first, then those that waited longest: a rank that waits in another collective than the rest, or
    in none, is the one to look at."""
    world = len(ranks)
    saving: dict[int | None, tuple[list[int], float]] = {}
    waiting: dict[tuple, tuple[list[int], float]] = {}
    computing: dict[int | None, list[int]] = {}
    silent: list[int] = []
    for rank in ranks:
        collective, step = rank.get("collective"), rank.get("step")
        if rank.get("saving") is not None:  # inside the save, a collective is the save's own (a distributed one)
            members, longest = saving.get(step, ([], 0.0))
            saving[step] = (members + [rank["rank"]], max(longest, rank["saving"]))
        elif collective is None:
            silent.append(rank["rank"])
        elif not collective:
            computing.setdefault(step, []).append(rank["rank"])
        else:
            group = collective["group"] if collective["group_size"] != world else None
            key = (collective["op"], group, collective["group_size"], step)
            members, longest = waiting.get(key, ([], 0.0))
            waiting[key] = (members + [rank["rank"]], max(longest, collective["for"]))

    def at(step: int | None) -> str:
        return f" (step {step})" if step is not None else ""

    parts: list[str] = [f"{_rank_runs(members)} save{'' if len(members) > 1 else 's'} a checkpoint for {longest:.0f}s"
                        f"{at(step)}" for step, (members, longest) in sorted(saving.items(), key=lambda kv: -kv[1][1])]
    said_wait = False
    for (op, group, size, step), (members, longest) in sorted(waiting.items(), key=lambda kv: (-kv[1][1], kv[0][0],
                                                                                                 min(kv[1][0]))):
        verb = "" if said_wait else (" wait" if len(members) > 1 else " waits")
        said_wait = True
        on = f" on group {group} of {size} ranks" if group is not None else ""
        parts.append(f"{_rank_runs(members)}{verb} in {op}{on}{at(step)} for {longest:.0f}s")
    for step, members in sorted(computing.items(), key=lambda kv: min(kv[1])):
        parts.append(f"{_rank_runs(members)} comput{'e' if len(members) > 1 else 'es'}{at(step)}")
    if silent:
        parts.append(f"{_rank_runs(silent)}: no report")
    return "; ".join(parts) or "no rank has reported"


def _saving(ranks: list[dict]) -> Saving | None:
    """The rank that has saved a checkpoint longest of those that save now (the snapshot's ``saving``), or None."""
    savers = [(r["saving"], r["rank"]) for r in ranks if r.get("saving") is not None]
    if not savers:
        return None
    seconds, rank = max(savers)
    return Saving(rank, seconds)


def probe_words(snapshot: dict) -> tuple[dict[int, tuple[int, ...]], dict[int, tuple[int, ...]], dict[int, str]]:
    """What ``localise`` reads, from the board's node rows: each prober's unreachable and probed ids (a node's
    is its node rank, a spare's its probe id below zero), only ids that are on the ring now (a spare that took
    a node's place, or left, keeps its old id in the others' rounds for a moment); and how a spare is said."""
    ids: dict[int, dict] = {}
    names: dict[int, str] = {}
    for row in snapshot.get("nodes") or ():
        if not row.get("probed"):
            continue
        if row.get("role") == "active":
            ids[row["node"]] = row
        elif row.get("role") == "spare" and row.get("probe_id") is not None and row["probe_id"] < 0:
            ids[row["probe_id"]] = row
            names[row["probe_id"]] = f"spare node {row.get('host') or row['probe_id']}"
    return ({n: tuple(i for i in row["unreachable"] if i in ids) for n, row in ids.items()},
            {n: tuple(i for i in row["probed"] if i in ids) for n, row in ids.items()}, names)


def job_links(verdict: Verdict) -> tuple[tuple[int, int], ...]:
    """The verdict's broken links between two of the job's nodes (a spare's are said, and repaired by nothing)."""
    return tuple(pair for pair in verdict.links if min(pair) >= 0)


class LinkObserver:
    """The controller's side of both watches: takes the agents' link reports out of the report stream, runs
    the ladder at each keepalive, watches the board's step for a stall, says what it finds, and returns
    the controller's events (a node lost to a spare, an online repair, the job's end)."""

    def __init__(self, events: EventLog, rules: LinkRules, stalls: StallWatch | None = None):
        self.events, self.rules = events, rules
        self.links = Links()
        self.stalls = stalls or StallWatch()
        self._stall_said: Stall | None = None
        #: which ranks wait in which collective, as the board's newest snapshot says (``where_ranks_stand``)
        self._where = ""
        #: the agent that hosts the controller: its node never moves to a spare (``on_link_tick``)
        self.host_agent = ""
        #: the launch's timeout chain (``ftrun.timeouts``), checked once more against the job's measured step time
        #: and each longer checkpoint save
        self.bounds: list = []
        self._measured_checked = False
        #: the collective timeouts said to be shorter than a measured save (each said once, as saves grow)
        self._save_said: set[str] = set()
        #: the data network's probe: the verdict last said, and since when each node has been in it (a node cut off
        #: is dark since its first broken pair, a round or two before the verdict can tell it from its peers)
        self.verdict = Verdict()
        self._unreached: dict[int, float] = {}
        #: nodes whose OS reported their link dark while the probe found pairs broken, or a moment before they
        #: answered again: the OS's word explains those pairs, and its link's return repaired the job already
        self._explained: set[int] = set()
        self._os_said: dict[int, float] = {}
        #: nodes sent to a spare, and the agent that held each then: once another holds it, it was taken over
        self._moving: dict[int, str] = {}

    def take_reports(self, events: list[Event], view: JobView, nodes: dict[int, NodeSlot], spare: bool,
                     now: float) -> list[Event]:
        """``events`` less the link reports, which are decided here; plus what those decided."""
        kept: list[Event] = []
        for event in events:
            report = event.report if isinstance(event, Reported) else None
            if report is None or report.kind not in (ReportKind.LINK_DOWN, ReportKind.LINK_UP):
                kept.append(event)
                continue
            holder = nodes.get(report.node_rank)
            if holder is None or (report.agent_id and report.agent_id != holder.agent_id):
                continue  # a fenced agent's word
            self._os_said[report.node_rank] = now
            self.links, actions = on_link_report(self.links, report.node_rank, report.kind is ReportKind.LINK_UP,
                                                 report.detail, now, self.rules, spare, host=self._host(nodes))
            kept += self._act(actions, view, nodes)
        return kept

    def observe(self, view: JobView, nodes: dict[int, NodeSlot], spare: bool, now: float) -> list[Event]:
        for node, agent in list(self._moving.items()):
            if node in nodes and nodes[node].agent_id != agent:
                self.links = taken_over(self.links, node)
                del self._moving[node]
                # the peers' probes reach the new holder a round later: that pair answering again is no link's return
                self._explained.add(node)
        for node in self.links.moved & view.vacant:  # left out of the job: nothing of its link concerns it now
            self.links = taken_over(self.links, node)
        # leaving a node out is a job-level restart at one node fewer: one unit of budget (none left, the job ends)
        shrink = bool(view.min_nodes) and len(view.present) - 1 >= view.min_nodes and view.budget_left > 0
        self.links, actions = on_link_tick(self.links, now, self.rules, spare, view.phase is Phase.RUNNING,
                                           self._host(nodes), shrink)
        return self._act(actions, view, nodes)

    def watch_reach(self, view: JobView, snapshot: dict, nodes: dict[int, NodeSlot], spare: bool,
                    now: float) -> list[Event]:
        """The nodes' probes of the data network (their statuses on the board): the fault put on a node or on
        links, said when it changes. A node cut off from every peer is a dark link (the ladder, as the OS's
        word); links that answer again after they did not are repaired online, as a link back is."""
        verdict = localise(*probe_words(snapshot))
        before, self.verdict = self.verdict, verdict
        self._unreached = {n: self._unreached.get(n, now) for n in {*verdict.nodes, *(n for p in verdict.links for n in p)}}
        if job_links(verdict):
            self._explained |= {d.node_rank for d in self.links.dark if d.source == "os"}
        found: list[Event] = []
        if verdict.text and verdict.text != before.text:
            log.warning("data network probe: %s", verdict.text)
            self.events.emit("link", view.generation, f"data network probe: {verdict.text}")
        # a node cut off goes down the ladder (once: the ladder holds it), unless its OS spoke of its link a moment
        # ago: the probe's rounds lag the OS's word by a second or two (a link dark and back already, whose probe
        # verdict came late, is no new dark link); a verdict that outlasts that goes down the ladder then.
        # A spare cut off (an id below zero) is said, and goes down no ladder
        for node in verdict.nodes:
            if node >= 0 and now - self._os_said.get(node, -OS_EXPLAINS) >= OS_EXPLAINS:
                self.links, actions = on_link_report(self.links, node, False, "unreachable on the data network from "
                                                     "every peer (probe)", self._unreached[node], self.rules, spare,
                                                     "probe", self._host(nodes))
                found += self._act(actions, view, nodes)
        if verdict.text == before.text:
            return found
        for node in before.nodes:
            if node >= 0 and node not in verdict.nodes:
                self.links, actions = on_link_report(self.links, node, True, "reachable on the data network again "
                                                     "(probe)", now, self.rules, spare, source="probe")
                found += self._act(actions, view, nodes)
        broken, mended = job_links(before), job_links(verdict)
        if broken and not mended and not self.links.dark:
            a, b = broken[0]
            explained = self._explained | {n for n, at in self._os_said.items() if now - at < OS_EXPLAINS}
            self._explained = set()
            if not explained & {n for pair in broken for n in pair}:  # the OS's word already repaired it
                back = f"nodes {a} and {b} reach each other on the data network again (probe)"
                found += self._act([Say(back, b), RepairOnline(b, back)], view, nodes)
        return found

    def watch_steps(self, view: JobView, snapshot: dict, now: float) -> Stall | None:
        """The board's newest snapshot: the stall, said once when it begins and once when it ends."""
        if view.phase is not Phase.RUNNING or not snapshot or snapshot.get("generation") != view.generation:
            self.stalls.pause(now)
            stall = None
        else:
            ranks = snapshot.get("ranks") or []
            self._where = where_ranks_stand(ranks)
            beating = bool(ranks) and all(r.get("heartbeat_age") is not None and r["heartbeat_age"] < BEATING
                                          for r in ranks)
            measured = self.stalls.longest_save
            stall = self.stalls.observe(now, snapshot.get("step"), beating, _saving(ranks),
                                        max([r.get("save_s") or 0.0 for r in ranks], default=0.0))
            if self.stalls.longest_save > measured:
                self._check_saves()
            if not self._measured_checked and len(self.stalls.durations) >= MEASURED_CHECK:
                self._measured_checked = True
                self._check_measured()
        if stall is not None and self._stall_said is None:
            save = (f"rank {stall.saving.rank} saves a checkpoint for {stall.saving.seconds:.0f}s, longer than the "
                    "job's saves allow; " if stall.saving else "")
            line = (f"training stands still: {save}no step committed for {stall.waited:.1f}s while every rank lives "
                    f"and beats (bound {stall.bound:.1f}s: {stall.basis}); {self._where}{self._dark_words()}")
            log.error(line)
            self.events.emit("stall", view.generation, line, waited=round(stall.waited, 3), bound=round(stall.bound, 3))
        elif stall is None and self._stall_said is not None:
            self.events.emit("stall", view.generation, "training moves again", waited=0.0, bound=0.0)
        self._stall_said = stall
        return stall

    def status(self, now: float) -> dict | None:
        """What the status shows: the stall (or a dark link), the dark links by node and which ranks wait in which
        collective, or None."""
        stall, dark = self._stall_said, self.links.dark
        if stall is None and not dark:
            return None
        reason = "; ".join(f"node {d.node_rank}: {d.detail}" for d in dark) or (
            f"rank {stall.saving.rank} saves a checkpoint" if stall and stall.saving else "no step committed")
        since = min([d.since for d in dark] + ([stall.since] if stall else []))
        return {"for": round(now - since, 1), "reason": reason,
                "bound": round(stall.bound, 1) if stall else None,
                "dark": {str(d.node_rank): d.detail for d in dark}, "ranks": self._where}

    def _host(self, nodes: dict[int, NodeSlot]) -> int:
        return next((n for n, slot in nodes.items() if slot.agent_id == self.host_agent), -1)

    def _check_measured(self) -> None:
        """The timeout chain against the job's own step time: a collective timeout the stall bound has
        outgrown is said once, with what to change (the launch said the contradictions it could see at start)."""

        step = _percentile(self.stalls.durations, STALL_PERCENTILE)
        said_at_start = set(contradictions(self.bounds))
        for line in contradictions(self.bounds, step_time=step):
            if line not in said_at_start:
                log.warning("timeouts contradict, with the job's step time (p%.0f %.2fs): %s", STALL_PERCENTILE * 100,
                            step, line)

    def _check_saves(self) -> None:
        """The timeout chain against the longest checkpoint save measured so far: a collective timeout that a
        save outlasts is said once (the ranks waiting for the saving one would time out), with what to change."""
        longest = self.stalls.longest_save
        for name, line in save_contradictions(self.bounds, longest).items():
            if name not in self._save_said:
                self._save_said.add(name)
                log.warning("timeouts contradict, with the job's longest checkpoint save (%.1fs): %s", longest, line)

    def _dark_words(self) -> str:
        return "".join(f"; node {d.node_rank}: {d.detail}" for d in self.links.dark)

    def _act(self, actions: list[Action], view: JobView, nodes: dict[int, NodeSlot]) -> list[Event]:
        found: list[Event] = []
        for action in actions:
            if isinstance(action, Say):
                log.warning("%s", action.line)
                holder = nodes.get(action.node_rank)
                self.events.emit(action.kind, view.generation, action.line, node=action.node_rank,
                                 host=holder.host if holder else None)
            elif isinstance(action, (MoveToSpare, LeaveOut)) and action.node_rank in nodes:
                if isinstance(action, MoveToSpare):
                    self._moving[action.node_rank] = nodes[action.node_rank].agent_id
                found.append(NodeLost(nodes[action.node_rank], f"node {action.node_rank}: {action.detail}"))
            elif isinstance(action, RepairOnline):
                holder = nodes.get(action.node_rank)
                found.append(LinkBack(action.node_rank, holder.host if holder else "",
                                      holder.first_rank if holder else 0, action.detail, time.time()))
            elif isinstance(action, EndJob):
                found.append(LinkLost(action.detail))
        return found
