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


def test_rounds_under_etcd_lose_the_controller_with_a_spare_and_hit_node_1_then(chaos):
    rng = random.Random(0)
    plans = [chaos.draw_etcd_plan(rng, number) for number in range(200)]
    kinds = {fault.kind for plan in plans for fault in plan.faults}
    assert {"controller-lost", "etcd-member"} <= kinds and kinds & set(chaos.RANK_KINDS)
    for plan in plans:
        assert plan.etcd and plan.max_restarts == chaos.BUDGET
        lost = any(f.kind == "controller-lost" for f in plan.faults)
        assert plan.spare or not lost
        for fault in plan.faults:
            if fault.kind in chaos.RANK_KINDS:
                assert fault.rank in ((2, 3) if lost else range(4))  # node 0's ranks go with it
            if fault.kind == "etcd-member":
                assert fault.member in range(chaos.ETCD_MEMBERS) and fault.rank is None
        spending = sorted(f.step for f in plan.faults if f.spends_budget(plan.spare))
        assert all(b - a >= chaos.SPACING for a, b in itertools.pairwise(spending))


def test_the_controller_lost_spends_a_unit_with_a_spare_and_an_etcd_member_nothing(chaos):
    lost, member = chaos.Fault("controller-lost", 5), chaos.Fault("etcd-member", 4, member=2)
    assert (lost.spends_budget(True), lost.terminal(True)) == (True, False)
    assert lost.terminal(False)
    assert (member.spends_budget(True), member.terminal(False)) == (False, False)
    assert str(member) == "etcd-member m2 s4"
    plan = chaos.Plan(1, (member, lost), True, chaos.BUDGET)
    assert plan.describe() == "etcd-member m2 s4, controller-lost s5; budget 3; spare; etcd"
    assert "etcd" not in chaos.Plan(2, (chaos.Fault("store-lost", 5),), True, 3).describe()
