"""scripts/chaos.py: how rounds are drawn, the rounds under etcd among them (no rounds run)."""

from __future__ import annotations

import itertools
import random

import pytest

from tests.chaos.test_chaos import load_chaos


@pytest.fixture(scope="module")
def chaos():
    return load_chaos()


def test_a_seed_keeps_its_rounds_and_some_become_rounds_under_etcd(chaos):
    rng = random.Random(1)
    drawn = [chaos.draw_plan(rng, number) for number in range(1, 51)]
    plans = chaos.draw_plans(50, 1)
    under_etcd = [plan for plan in plans if plan.etcd]
    assert 0 < len(under_etcd) < 25
    assert all(plan == old for plan, old in zip(plans, drawn) if not plan.etcd)  # the others as the seed gave them
    assert not any(plan.etcd for plan in drawn)  # the other draws never give the etcd kinds
    assert not any(plan.etcd for plan in chaos.draw_plans(3, 1296))  # tests/chaos's rounds


def test_rdzv_backend_picks_every_rounds_control_plane_and_a_seed_gives_the_same_rounds(chaos):
    rng = random.Random(1)
    assert chaos.draw_plans(50, 1, "c10d") == [chaos.draw_plan(rng, number) for number in range(1, 51)]
    under_etcd = chaos.draw_plans(50, 1, "etcd")
    assert all(plan.etcd for plan in under_etcd) and under_etcd == chaos.draw_plans(50, 1, "etcd")
    assert chaos.draw_plans(50, 1, "etcd") != chaos.draw_plans(50, 2, "etcd")


def test_rounds_under_etcd_draw_every_etcd_fault_alone_and_with_a_rank_or_node_fault_and_a_spare_for_each_node(chaos):
    rng = random.Random(0)
    plans = [chaos.draw_etcd_plan(rng, number) for number in range(300)]
    alone, with_rank, with_node = set(), set(), set()
    for plan in plans:
        kinds = {fault.kind for fault in plan.faults}
        etcd_kinds = kinds & set(chaos.ETCD_KINDS)
        assert plan.etcd and plan.max_restarts == chaos.BUDGET
        assert not set(chaos.CONTROLLER_KINDS) <= kinds  # node 0 goes once
        (with_rank if kinds & set(chaos.RANK_KINDS) else with_node if "agent" in kinds else alone).update(etcd_kinds)
        assert sum(f.kind in chaos.NODE_LOSING for f in plan.faults) <= plan.spares <= 2  # every round can recover
        assert sum(f.spends_budget(plan.spares) for f in plan.faults) <= plan.max_restarts
        lost = bool(kinds & set(chaos.CONTROLLER_KINDS))
        for fault in plan.faults:
            if fault.kind in chaos.RANK_KINDS:
                assert fault.rank in ((2, 3) if lost else range(4))  # node 0's ranks go with it
            if fault.kind in ("etcd-member", "quorum-lost"):
                assert fault.member in range(chaos.ETCD_MEMBERS) and fault.rank is None
            assert (fault.pause in chaos.CONTROLLER_STOPS) == (fault.kind == "controller-stopped")
        spending = sorted(f.step for f in plan.faults if f.spends_budget(plan.spares))
        assert all(b - a >= chaos.SPACING for a, b in itertools.pairwise(spending))
        quorum = next((f for f in plan.faults if f.kind == "quorum-lost"), None)
        near = next((f for f in plan.faults if f.kind in (*chaos.RANK_KINDS, "agent")), None)
        if quorum is not None and near is not None:  # the outage starts within a step or two of the fault
            assert -2 <= quorum.step - near.step <= 1 or quorum.step in (chaos.FIRST_FAULT_STEP, chaos.LAST_FAULT_STEP)
    assert alone == with_rank == with_node == set(chaos.ETCD_KINDS)


def test_node_losses_spend_a_unit_with_a_spare_end_the_job_without_and_etcd_faults_spend_nothing(chaos):
    lost, member = chaos.Fault("controller-lost", 5), chaos.Fault("etcd-member", 4, member=2)
    stopped, quorum = chaos.Fault("controller-stopped", 8, pause=4.0), chaos.Fault("quorum-lost", 3, member=1)
    for fault in (lost, stopped):
        assert (fault.spends_budget(1), fault.terminal(1), fault.terminal(0)) == (True, False, True)
    for fault in (member, quorum):
        assert (fault.spends_budget(1), fault.terminal(0)) == (False, False)
    assert str(member) == "etcd-member m2 s4" and str(stopped) == "controller-stopped s8 4s"
    plan = chaos.Plan(1, (member, lost), 1, chaos.BUDGET)
    assert plan.describe() == "etcd-member m2 s4, controller-lost s5; budget 3; spare; etcd"
    two = chaos.Plan(2, (quorum, stopped, chaos.Fault("agent", 11)), 2, chaos.BUDGET)
    assert two.describe() == "quorum-lost m1 s3, controller-stopped s8 4s, agent s11; budget 3; 2 spares; etcd"
    assert "etcd" not in chaos.Plan(3, (chaos.Fault("store-lost", 5),), 1, 3).describe()
