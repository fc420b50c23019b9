"""Rendezvous: the agents gather in the control store and get their node ranks.

Deciding is split from doing: :func:`decide_rendezvous` is a pure function of
the join records and the time; :func:`gather` (run by the controller) and
:func:`join` (run by every agent) apply it through the store. Each agent reads
only its own place (``keys.rendezvous_place``, O(1) bytes), carried by its doorbell.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

from ftrun.detection.pairs import PairCheck, PairPlan, PairReport, PairTime, check_bound, plans, schedule
from ftrun.detection.preflight import NodeSpeed, judge_preflight
from ftrun.errors import ExitCode, FtrunError, RendezvousError
from ftrun.keys import RENDEZVOUS_RING, JobKeys
from ftrun.messages import JoinRecord, NodeSlot, Placement, RendezvousResult
from ftrun.store import ControlStore, StoreUnavailable

log = logging.getLogger(__name__)
POLL_INTERVAL = 0.05
#: an agent with a Watch: how long it sleeps between looks at its stop request while the bell has not
#: rung (a thousand agents waking every POLL_INTERVAL cost their hosts nothing, a simulator of them much),
#: and how often it reads the rendezvous result all the same
RING_WAIT, RESULT_NET = 0.25, 1.0
#: how long an agent that joined after the rendezvous waits for the controller's answer
ADMISSION_DEADLINE = 10.0


@dataclass(frozen=True)
class RendezvousPolicy:
    min_nodes: int
    max_nodes: int
    #: with MIN:MAX, how long to wait for more nodes once MIN have joined
    last_call_timeout: float
    timeout: float
    #: agents beyond max_nodes admitted as spares
    spares: int = 0


def decide_rendezvous(
    joins: list[JoinRecord],
    policy: RendezvousPolicy,
    host_agent_id: str,
    waited: float,
    min_reached_for: float | None,
    pairs: tuple[PairTime, ...] = (),
) -> RendezvousResult | None:
    """The rendezvous result once it is decided, else ``None`` (keep waiting).

    ``waited`` is the time since the rendezvous opened, ``min_reached_for`` the time
    since MIN nodes had joined (None while fewer have); ``pairs``: --preflight's data network
    check, measured once :func:`pairs_due` said so.
    """
    clash = _rank_clash(joins)
    if clash:
        return RendezvousResult(error=clash)
    unfit = [j.preflight for j in joins if j.preflight]
    if unfit:
        return RendezvousResult(error=f"preflight failed: {'; '.join(unfit)}", exit_code=ExitCode.DEVICE)
    if _complete(joins, policy, min_reached_for):
        verdict = judge_preflight([NodeSpeed(j.agent_id, j.host, j.matmul_s) for j in _host_first(joins, host_agent_id)],
                                  list(pairs), max(0, len(joins) - policy.min_nodes), host_agent_id)
        for line in verdict.findings:  # one line per finding
            (log.error if verdict.refuse else log.warning)("preflight: %s", line)
        if verdict.refuse:
            return RendezvousResult(error=f"preflight failed: {'; '.join(verdict.findings)}", exit_code=ExitCode.DEVICE)
        left_out = dict(verdict.slow)
        result = assign_node_ranks([j for j in joins if j.agent_id not in left_out], host_agent_id, policy.max_nodes,
                                   policy.spares)
        left = tuple((agent, f"preflight: left out: {line}") for agent, line in left_out.items())
        return dataclasses.replace(result, left_out=left) if left and not result.error else result
    if waited >= policy.timeout:
        return RendezvousResult(error=_missing_message(joins, policy))
    return None


def _complete(joins: list[JoinRecord], policy: RendezvousPolicy, min_reached_for: float | None) -> bool:
    return len(joins) >= policy.max_nodes + policy.spares or (
        min_reached_for is not None and min_reached_for >= policy.last_call_timeout)


def _host_first(joins: list[JoinRecord], host_agent_id: str) -> list[JoinRecord]:
    return sorted(joins, key=lambda j: j.agent_id != host_agent_id)


def pairs_due(joins: list[JoinRecord], policy: RendezvousPolicy, host_agent_id: str,
              min_reached_for: float | None) -> list[JoinRecord]:
    """The agents whose data network --preflight measures now, the store's host first: every one that listens
    for it, once the rendezvous has all the agents it waits for (none when it is failing anyway)."""
    if _rank_clash(joins) or any(j.preflight for j in joins) or not _complete(joins, policy, min_reached_for):
        return []
    listening = [j for j in _host_first(joins, host_agent_id) if j.data_endpoint]
    return listening if len(listening) >= 2 else []


def _rank_clash(joins: list[JoinRecord]) -> str:
    owner: dict[int, JoinRecord] = {}
    for join in joins:
        rank = join.requested_node_rank
        if rank < 0:
            continue
        if rank in owner:
            return (f"--node-rank {rank} was given to two agents: {owner[rank].host} (pid {owner[rank].pid}) and "
                    f"{join.host} (pid {join.pid})")
        owner[rank] = join
    return ""


def _missing_message(joins: list[JoinRecord], policy: RendezvousPolicy) -> str:
    expected = policy.min_nodes
    joined = ", ".join(sorted(j.host if j.requested_node_rank < 0 else f"node {j.requested_node_rank} on {j.host}"
                              for j in joins))
    text = f"rendezvous timed out after {policy.timeout:g}s: {len(joins)} of {expected} nodes joined ({joined or 'none'})"
    requested = {j.requested_node_rank for j in joins if j.requested_node_rank >= 0}
    if requested:
        missing = sorted(set(range(policy.max_nodes)) - requested)
        text += f"; missing node rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}"
    else:
        text += f"; waiting for {expected - len(joins)} more"
    return text


def assign_node_ranks(joins: list[JoinRecord], host_agent_id: str, max_nodes: int | None = None,
                      spares: int = 0) -> RendezvousResult:
    """Up to ``max_nodes`` nodes: those that asked for a node rank keep it, then the store's host (0 when
    free), then the rest by arrival. Up to ``spares`` of the agents left over stand by as spares."""
    max_nodes = len(joins) if max_nodes is None else max_nodes
    requested = [j for j in joins if j.requested_node_rank >= 0]
    others = sorted((j for j in joins if j.requested_node_rank < 0), key=lambda j: j.agent_id != host_agent_id)
    chosen = (requested + others)[:max_nodes]
    placed = {j.agent_id for j in chosen}  # a set: a list's `in` made the choice O(N²), 91 ms at 1,024 nodes
    left = [j for j in joins if j.agent_id not in placed][:spares]
    count = len(chosen)
    taken = {j.requested_node_rank: j for j in chosen if j.requested_node_rank >= 0}
    bad = [r for r in taken if r >= count]
    if bad:
        return RendezvousResult(error=f"--node-rank {bad[0]} is out of range: only {count} nodes joined")
    free = iter(r for r in range(count) if r not in taken)
    by_rank = dict(taken)
    for join in (j for j in chosen if j.requested_node_rank < 0):
        by_rank[next(free)] = join
    slots, first_rank = [], 0
    for rank in range(count):
        join = by_rank[rank]
        slots.append(node_slot(join, rank, first_rank))
        first_rank += join.nproc
    standby = tuple(node_slot(j, -1, -1) for j in left)
    return RendezvousResult(nodes=tuple(slots), world_size=first_rank, spares=standby)


def node_slot(join: JoinRecord, node_rank: int, first_rank: int) -> NodeSlot:
    """The place an agent gets: a node (ranks from ``first_rank``), or a spare (-1, -1)."""
    return NodeSlot(node_rank, join.agent_id, join.host, join.nproc, first_rank, join.host_ip, join.devices)


def gather(store: ControlStore, keys: JobKeys, policy: RendezvousPolicy, host_agent_id: str, stop,
           measured: Callable[[list[JoinRecord], tuple[PairTime, ...]], None] | None = None) -> RendezvousResult:
    """The controller's side: wait for the agents, decide, publish each agent's place. ``measured``: told the
    join records and --preflight's pairs before the result is published (``ftrun probe`` across nodes)."""
    opened = time.monotonic()
    min_reached_at = None
    joins: list[JoinRecord] = []
    read = 0  # join records read so far: each is read once, so N agents cost O(N), not O(N) per poll
    pairs: tuple[PairTime, ...] | None = None
    while True:
        new = store.read_from(keys.arrivals, keys.join, JoinRecord, read)
        read += len(new)
        joins += [j for j in new if j is not None]
        now = time.monotonic()
        if min_reached_at is None and len(joins) >= policy.min_nodes:
            min_reached_at = now
        min_for = None if min_reached_at is None else now - min_reached_at
        if pairs is None and (due := pairs_due(joins, policy, host_agent_id, min_for)):
            pairs = measure_pairs(store, keys, due, stop)
        result = decide_rendezvous(joins, policy, host_agent_id, now - opened, min_for, pairs or ())
        if result is None and stop.is_set():
            result = RendezvousResult(error="the job was stopped during the rendezvous")
        if result is not None:
            if measured is not None:
                measured(joins, pairs or ())
            publish(store, keys, result, [j.agent_id for j in joins])
            return result
        time.sleep(POLL_INTERVAL)


def measure_pairs(store: ControlStore, keys: JobKeys, joins: list[JoinRecord], stop) -> tuple[PairTime, ...]:
    """--preflight's data network check: each agent's turns written, then their reports read, within the
    check's bound; an agent that reports nothing is judged by its peers' word."""
    began = time.monotonic()
    endpoints = {j.agent_id: j.data_endpoint for j in joins}
    turns = plans(endpoints)
    rounds = len(schedule(len(joins)))
    store.set_each([keys.preflight_plan(agent) for agent in turns],
                   [store.sealed(keys.preflight_plan(agent), plan) for agent, plan in turns.items()])
    wanted = [keys.preflight_pairs(agent) for agent in turns]
    deadline = began + check_bound(rounds) + RESULT_NET + RING_WAIT + 1.0
    reports = store.all_set(PairReport, wanted)
    while reports is None and time.monotonic() < deadline and not stop.is_set():
        time.sleep(POLL_INTERVAL)
        reports = store.all_set(PairReport, wanted)
    if reports is None:
        reports = store.messages(PairReport, wanted)
    times = tuple(t for report in reports if report is not None for t in report.times)
    log.info("preflight: the data network's bandwidth between %d nodes measured in %.2fs (%d rounds)",
             len(joins), time.monotonic() - began, rounds)
    return times


def publish(store: ControlStore, keys: JobKeys, result: RendezvousResult, joined: list[str]) -> None:
    """Each agent's own place (O(1) bytes), then the outcome, then every joined agent's bell rung with
    its place's text, in one ``multi_set``: every Watch wakes holding its place. A failed rendezvous's
    bells ring empty (its error names the agents: read once from the outcome, not carried N times)."""
    places = {agent_id: (keys.rendezvous_place(agent_id), place)
              for agent_id, place in ([] if result.error else result.places())}
    texts = {agent_id: store.sealed(key, place) for agent_id, (key, place) in places.items()}
    store.set_each([key for key, _ in places.values()] + [keys.rendezvous_result]
                   + [keys.doorbell(agent_id, RENDEZVOUS_RING) for agent_id in joined],
                   list(texts.values()) + [store.sealed(keys.rendezvous_result, result.outcome)]
                   + [texts.get(agent_id, "") for agent_id in joined])


def join(store: ControlStore, keys: JobKeys, record: JoinRecord, timeout: float, stop,
         ready: threading.Event | None = None, carried: Callable[[], bytes] = bytes,
         pair_check: PairCheck | None = None) -> tuple[Placement, NodeSlot]:
    """An agent's side: announce itself, wait for its place. ``ready``: set once the place is written (a
    ``Watch``), and ``carried``: the text its bell rang with; the place is then read when it is set,
    and every RESULT_NET seconds as a net, instead of every POLL_INTERVAL. ``pair_check``: --preflight's
    listener on the data network, whose turns the agent takes when the controller hands them out."""
    try:
        placement = _await_placement(store, keys, record, timeout, stop, ready, carried, pair_check)
    except StoreUnavailable as e:
        raise RendezvousError(f"lost the store during the rendezvous: {e}") from None
    if placement.error:
        raise FtrunError(placement.error, ExitCode(placement.exit_code))
    slot = placement.slot
    if slot is None:  # joined after the rendezvous, or one too many: the controller may take it as a spare
        try:
            slot = _await_admission(store, keys, record, stop)
        except StoreUnavailable as e:
            raise RendezvousError(f"lost the store while waiting to be admitted: {e}") from None
    return placement, slot


def _await_admission(store: ControlStore, keys: JobKeys, record: JoinRecord, stop) -> NodeSlot:
    deadline = time.monotonic() + ADMISSION_DEADLINE
    while time.monotonic() < deadline and not stop.is_set():
        answer = store.try_text(keys.admission(record.agent_id), signed=True)
        if answer == "spare":
            return node_slot(record, -1, -1)
        if answer:
            raise RendezvousError(f"not admitted: {answer}")
        time.sleep(POLL_INTERVAL)
    raise RendezvousError("the job has already started and its controller did not admit this agent")


def _await_placement(store: ControlStore, keys: JobKeys, record: JoinRecord, timeout: float, stop,
                     ready: threading.Event | None, carried: Callable[[], bytes],
                     pair_check: PairCheck | None = None) -> Placement:
    store.append(keys.arrivals, keys.join, record)
    deadline = time.monotonic() + timeout + 5.0  # the controller decides at `timeout`; allow for its answer
    next_read = 0.0  # with ``ready``: read at once (a late arrival finds the outcome there), then now and then
    while True:
        plan = store.try_get(PairPlan, keys.preflight_plan(record.agent_id)) if pair_check is not None else None
        if plan is not None and pair_check is not None:
            began = time.monotonic()
            store.set(keys.preflight_pairs(record.agent_id), pair_check.run(record.agent_id, plan))
            deadline += time.monotonic() - began  # the check's time is not the rendezvous's
            pair_check = None
        if ready is None or ready.is_set() or time.monotonic() >= next_read:
            next_read = time.monotonic() + RESULT_NET
            placement = _placement(store, keys, record.agent_id, carried() if ready is not None and ready.is_set() else b"")
            if placement is not None:
                store.add(keys.rendezvous_readers)
                return placement
        if stop.is_set():
            raise RendezvousError("stopped while waiting for the rendezvous")
        if time.monotonic() > deadline:
            raise RendezvousError(f"no rendezvous result from the controller at {store.endpoint} within {timeout:g}s")
        if ready is not None and not ready.is_set():
            ready.wait(RING_WAIT)
        else:
            time.sleep(POLL_INTERVAL)


def _placement(store: ControlStore, keys: JobKeys, agent_id: str, rang: bytes) -> Placement | None:
    """The agent's place as its bell carried it (``rang``), else as the store holds it; the outcome
    without a slot when the controller gave it none; None before the rendezvous is decided. A bell's
    text that does not open is read again from the place's own key (anyone can ring a bell)."""
    mine = keys.rendezvous_place(agent_id)
    placement = store.opened(Placement, mine, rang) if rang else None
    if placement is not None:
        return placement
    outcome = store.try_get(Placement, keys.rendezvous_result)  # written after every place
    if outcome is None or outcome.error:
        return outcome
    return store.try_get(Placement, mine) or outcome


def linger_for_readers(store: ControlStore, keys: JobKeys, deadline: float) -> None:
    """The store's host after a failed rendezvous: keep the store up until every agent that joined has
    read why (their own one line beats "lost the store"), or until ``deadline`` seconds have passed."""
    until = time.monotonic() + deadline
    try:
        while store.counter(keys.rendezvous_readers) < store.counter(keys.arrivals) and time.monotonic() < until:
            time.sleep(POLL_INTERVAL)
    except StoreUnavailable:
        pass
