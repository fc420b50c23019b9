"""The chaos suite, short: a few rounds of scripts/chaos.py (the long run: scripts/chaos.py --rounds 50)."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.integration
#: rounds drawn from this seed (none under etcd): store-slow s3 + sigkill r3 s10 (recovers); alarm r2 s9 +
#: sigkill r0 s12 (recovers); exit1 r2 s2 + segv r0 s6 with a budget of 1 (it runs out: a clean failure, the
#: summary naming the first fault as the root cause). Spares and repairs that wait long for a replacement are in
#: the long run (scripts/chaos.py --rounds 50) and in tests/integration/test_spares.py and
#: test_process_repair.py.
SEED = 1296
ROUNDS = 3
#: then two rounds of their own under etcd, with a spare, which cover its four kinds of fault (the long run:
#: scripts/chaos.py --rdzv-backend etcd): an etcd member down from step 3 for 2 s, and node 0's agent, which
#: hosts the store and the controller, SIGKILLed after step 7; etcd's quorum lost after step 4 for 5 s (past
#: --node-timeout) with rank 1, on the controller's node, SIGKILLed at step 6 inside the outage (issue 40's
#: scenario), then node 0's agent alone SIGSTOPped for 4 s after step 10, past its lease: woken before another
#: agent took its office, it takes the office back, the agents that gave its store up come back to it, and it
#: counts none of them lost for its own stop. Each recovers, bit for bit, redoing no more steps than the
#: snapshot interval
ETCD_ROUNDS = (
    (dict(kind="etcd-member", step=3, member=1), dict(kind="controller-lost", step=7)),
    (dict(kind="quorum-lost", step=4, member=0), dict(kind="sigkill", step=6, rank=1),
     dict(kind="controller-stopped", step=10, pause=4.0)),
)


def load_chaos():
    scripts = str(ROOT / "scripts")
    if scripts not in sys.path:  # chaos.py imports benchlib from beside it, as a script does
        sys.path.insert(0, scripts)
    spec = importlib.util.spec_from_file_location("ftrun_chaos", ROOT / "scripts" / "chaos.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def etcd_rounds(chaos) -> tuple:
    """The fixed rounds under etcd, or none where etcd is not installed (scripts/test.sh installs it as root)."""
    import etcd_cluster  # beside chaos.py, which load_chaos puts on the path

    try:
        etcd_cluster.etcd_program()
    except etcd_cluster.EtcdUnavailable:
        return ()
    return tuple(chaos.Plan(ROUNDS + 1 + i, tuple(chaos.Fault(**fault) for fault in faults), 1, chaos.BUDGET)
                 for i, faults in enumerate(ETCD_ROUNDS))


def test_chaos_rounds_recover_or_fail_cleanly_and_leave_nothing_behind(tmp_path):
    chaos = load_chaos()
    fixed = etcd_rounds(chaos)
    results = chaos.run_rounds(ROUNDS, SEED, tmp_path, report=chaos.print_round, fixed=fixed)  # lines show on failure
    summary = chaos.totals(results)
    rounds = "\n".join(f"round {r.number}: {r.plan} -> {r.outcome} {r.exit_codes} {r.why} (logs: {r.folder})"
                       for r in results)
    assert (summary["hung"], summary["orphans"], summary["unexpected"]) == (0, 0, 0), rounds
    assert (summary["recovered"], summary["failed_cleanly"]) == (2 + len(fixed), 1), rounds
    assert len({kind for r in results for kind in r.injected}) >= 5, rounds  # the seed still covers several kinds
    if fixed:
        assert [r.injected for r in results[ROUNDS:]] == [["etcd-member", "controller-lost"],
                                                         ["quorum-lost", "sigkill", "controller-stopped"]], rounds
