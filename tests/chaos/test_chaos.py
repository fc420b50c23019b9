"""The chaos suite, short: a few rounds of scripts/chaos.py (the long run: scripts/chaos.py --rounds 50)."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.integration
#: rounds drawn from this seed: store-slow s3 + sigkill r3 s10 (recovers); alarm r2 s9 + sigkill r0 s12
#: (recovers); exit1 r2 s2 + segv r0 s6 with a budget of 1 (it runs out: a clean failure, the summary
#: naming the first fault as the root cause). Spares and repairs that wait long for a replacement are in
#: the long run (scripts/chaos.py --rounds 50) and in tests/integration/test_spares.py and
#: test_process_repair.py.
SEED = 1296
ROUNDS = 3


def load_chaos():
    scripts = str(ROOT / "scripts")
    if scripts not in sys.path:  # chaos.py imports benchlib from beside it, as a script does
        sys.path.insert(0, scripts)
    spec = importlib.util.spec_from_file_location("ftrun_chaos", ROOT / "scripts" / "chaos.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_chaos_rounds_recover_or_fail_cleanly_and_leave_nothing_behind(tmp_path):
    chaos = load_chaos()
    results = chaos.run_rounds(ROUNDS, SEED, tmp_path, report=chaos.print_round)  # its lines show on failure
    summary = chaos.totals(results)
    rounds = "\n".join(f"round {r.number}: {r.plan} -> {r.outcome} {r.exit_codes} {r.why} (logs: {r.folder})"
                       for r in results)
    assert (summary["hung"], summary["orphans"], summary["unexpected"]) == (0, 0, 0), rounds
    assert (summary["recovered"], summary["failed_cleanly"]) == (2, 1), rounds
    assert len({kind for r in results for kind in r.injected}) >= 5, rounds  # the seed still covers several kinds
