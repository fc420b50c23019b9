"""--preflight's bandwidth check between nodes on the data network: the schedule, the verdict (pure), and the
transfer itself between real listeners on loopback."""

from __future__ import annotations

import itertools
import threading

import pytest

from ftrun.detection.pairs import PairCheck, PairTime, judge_pairs, plans, schedule
from ftrun.detection.preflight import NodeSpeed, judge_preflight


@pytest.mark.parametrize("count, rounds", [(0, 0), (1, 0), (2, 1), (3, 3), (4, 3), (5, 5), (8, 7), (9, 8), (64, 8)])
def test_the_schedule_meets_each_pair_once_with_no_node_twice_in_a_round(count, rounds):
    found = schedule(count)
    assert len(found) == rounds
    met = [pair for pairs in found for pair in pairs]
    assert len(met) == len(set(met))
    for pairs in found:
        nodes = [n for pair in pairs for n in pair]
        assert len(nodes) == len(set(nodes)) and all(0 <= n < count for n in nodes)
        assert len(pairs) == count // 2  # every node busy but the odd one's bye
    if count <= 8:  # all pairs, N-1 rounds (N with a bye each when odd)
        assert set(met) == set(itertools.combinations(range(count), 2))
    else:  # a large job: each node meets 8 distinct peers (7 in the rounds of its bye, with an odd count)
        assert all(sum(n in pair for pair in met) >= 8 - count % 2 for n in range(count))


def test_each_agent_s_plan_is_its_turns_with_one_side_starting_each_pair():
    made = plans({"a": "10.0.0.1:1", "b": "10.0.0.2:2", "c": "10.0.0.3:3"})
    assert [(t.round, t.peer, t.client) for t in made["a"].turns] == [(1, "c", True), (2, "b", True)]
    assert [(t.round, t.peer, t.endpoint, t.client) for t in made["b"].turns] == [(0, "c", "10.0.0.3:3", True),
                                                                                  (2, "a", "10.0.0.1:1", False)]
    assert [(t.round, t.client) for t in made["c"].turns] == [(0, False), (1, False)]  # one bye a round


HOSTS = {"a": "h0", "b": "h1", "c": "h2", "d": "h3"}


def times(*rows):
    return [PairTime(a, b, s) for a, b, s in rows]


@pytest.mark.parametrize("rows, found", [
    ([("a", "b", 0.01), ("a", "c", 0.011), ("b", "c", 0.012)], []),
    # b's link is slow: its pairs both slow, a-c fast; b named, a and c not (their best pair is fast)
    ([("a", "b", 0.2), ("a", "c", 0.01), ("b", "c", 0.21)], ["b: h1: its best pair on the data network moves 41.9 MB/s, "
                                                             "20.0x slower than the median 838.9 MB/s"]),
    # two nodes alone: one pair, nobody to blame
    ([("a", "b", 0.5)], []),
    # past twice the median but by milliseconds: a loaded host's jitter, not a link
    ([("a", "b", 0.006), ("a", "c", 0.002), ("b", "c", 0.007)], []),
    # c reached by nobody: named once, naming both peers; a-b still judged without it
    ([("a", "c", -1), ("b", "c", -1), ("a", "b", 0.01)], ["c: h2: cannot reach h0, h1 on the data network"]),
    # one broken link between two nodes that reach the others: the later of the two goes
    ([("a", "b", -1), ("a", "c", 0.01), ("b", "c", 0.01), ("a", "d", 0.01), ("b", "d", 0.01), ("c", "d", 0.01)],
     ["b: h1: cannot reach h0 on the data network"]),
    # the server's side saw no client, but the client measured it: the pair is fine
    ([("a", "b", 0.01), ("b", "a", -1), ("a", "c", 0.01), ("b", "c", 0.01)], []),
])
def test_the_pairs_verdict_names_an_unreachable_or_slow_node(rows, found):
    assert [f"{agent}: {line}" for agent, line in judge_pairs(times(*rows), HOSTS)] == found


def test_the_preflight_verdict_leaves_a_node_out_for_a_spare_or_refuses_one_line_per_node():
    speeds = [NodeSpeed(a, h, 0.01) for a, h in HOSTS.items()][:3]
    slow = times(("a", "b", 0.2), ("a", "c", 0.01), ("b", "c", 0.21))
    verdict = judge_preflight(speeds, slow, 1, "a")
    assert [a for a, _ in verdict.slow] == ["b"] and not verdict.refuse
    assert judge_preflight(speeds, slow, 0, "a").refuse  # no spare
    assert judge_preflight(speeds, times(("a", "b", 0.21), ("a", "c", 0.2), ("b", "c", 0.01)), 1, "a").refuse  # the host
    both = [NodeSpeed("a", "h0", 0.01), NodeSpeed("b", "h1", 0.05), NodeSpeed("c", "h2", 0.01)]
    verdict = judge_preflight(both, slow, 1, "a")  # slow both ways: one line, the matmul's
    assert verdict.findings == ("h1: its matmul takes 50.0 ms, 5.0x the median 10.0 ms",)


def run_all(checks, turns):
    reports, threads = {}, []
    for agent, check in checks.items():
        threads.append(threading.Thread(target=lambda a=agent, c=check: reports.__setitem__(a, c.run(a, turns[a]))))
        threads[-1].start()
    for thread in threads:
        thread.join(30)
    return [t for report in reports.values() for t in report.times]


def test_three_listeners_on_loopback_measure_every_pair_and_one_that_is_gone_is_not_reached():
    checks = {agent: PairCheck("127.0.0.1", nbytes=1 << 20) for agent in "abc"}
    try:
        measured = run_all(checks, plans({a: c.endpoint for a, c in checks.items()}))
        assert sorted((t.a, t.b) for t in measured) == [("a", "b"), ("a", "c"), ("b", "c")]  # the starting sides
        assert all(0 < t.seconds < 2.0 for t in measured)
        assert judge_pairs(measured, {"a": "h0", "b": "h1", "c": "h2"}) == []
        checks["c"].close()  # c's agent is gone: its listener closed, it takes no turn
        for agent in "ab":  # a fresh check each, as each agent's join makes one
            checks[agent].close()
            checks[agent] = PairCheck("127.0.0.1", nbytes=1 << 20)
        alive = {a: checks[a] for a in "ab"}
        turns = plans({**{a: c.endpoint for a, c in alive.items()}, "c": checks["c"].endpoint})
        measured = run_all(alive, turns)
        assert judge_pairs(measured, {"a": "h0", "b": "h1", "c": "h2"}) == [("c", "h2: cannot reach h0, h1 on the data network")]
    finally:
        for check in checks.values():
            check.close()


def test_ftrun_probe_across_three_nodes_on_loopback_measures_them_and_names_the_slow_one_on_each():
    import socket
    import time

    import torch.distributed  # noqa: F401  (the store's; imported first, not by three threads at once)

    from ftrun.contract import Endpoint
    from ftrun.probe_nodes import probe_nodes

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    found: dict[int, object] = {}

    def node(index: int, matmul: float) -> None:
        found[index] = probe_nodes(Endpoint("127.0.0.1", port), 3, "probe-test", "", [matmul, matmul / 2], 60.0)

    threads = [threading.Thread(target=node, args=(i, m)) for i, m in enumerate((0.01, 0.05, 0.011))]
    for thread in threads:
        thread.start()
        time.sleep(0.2)  # the first hosts the store
    for thread in threads:
        thread.join(90)
    host = found[0]
    assert host.hosted and not found[1].hosted and not found[2].hosted
    assert sorted(n.matmul_each for n in host.nodes) == [(0.01, 0.005), (0.011, 0.0055), (0.05, 0.025)]
    assert len({frozenset((p.a, p.b)) for p in host.pairs if p.seconds > 0}) == 3  # every pair, in 3 rounds
    for index in range(3):  # every node says the finding (first: the loopback's pairs are too noisy to assert
        # none follows on a loaded machine), and the device exit status
        assert found[index].findings[0].endswith(": its matmul takes 50.0 ms, 4.5x the median 11.0 ms")
        assert found[index].exit_code == 4
