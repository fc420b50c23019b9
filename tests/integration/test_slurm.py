"""Under Slurm: ``srun --ntasks-per-node=1 ftrun train.py`` with no placement flags.

No Slurm here: each agent gets the SLURM_* variables srun would give it on its node.
"""

from __future__ import annotations

import pytest

from tests.conftest import WORKERS, free_port

pytestmark = pytest.mark.integration
TRAIN = str(WORKERS / "train.py")


def slurm_env(node_id: int, port: int, **extra: str) -> dict[str, str]:
    return {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_JOB_NODELIST": "localhost,127.0.0.1",
            "SLURM_NNODES": "2", "SLURM_NODEID": str(node_id), "SLURM_PROCID": str(node_id),
            "SLURM_TASKS_PER_NODE": "1(x2)", "MASTER_PORT": str(port), **extra}


def test_agents_place_themselves_from_slurm_variables(launcher):
    port = free_port()
    for node_id in (1, 0):
        launcher.start(["--nproc-per-node", "2", "--monitor-interval", "0.05", TRAIN],
                       env=launcher.env(STEPS="4", **slurm_env(node_id, port)))
    assert launcher.wait() == [0, 0], launcher.output()
    results = launcher.results()
    assert sorted(results) == [0, 1, 2, 3] and {r["world"] for r in results.values()} == {4}
    # SLURM_NODEID decides the node rank, whichever agent joined first
    assert "this is node 1; store on localhost:" in launcher.nodes[0].output
    assert "node 1 of 2, ranks 2-3 of 4" in launcher.nodes[0].output
    assert {r["env"]["TORCHELASTIC_RUN_ID"] for r in results.values()} == {"slurm-4242.0"}


def test_print_hosts_shows_what_slurm_gave(ftrun_cli):
    code, out, err = ftrun_cli("--print-hosts", TRAIN, env=slurm_env(1, 29999, SLURM_JOB_NODELIST="gpu[07-08]"))
    assert code == 0, err
    assert out.splitlines() == ["Slurm job 4242: 2 nodes, this is node 1; store on gpu07:29999; run id slurm-4242.0",
                                "  node 0  gpu07", "  node 1  gpu08"]


def test_explicit_placement_wins_over_slurm(ftrun_cli):
    code, out, err = ftrun_cli("--nnodes", "1", "--print-hosts", TRAIN, env=slurm_env(0, 29999))
    assert code == 2 and "needs --hostfile, or a Slurm allocation" in err


@pytest.mark.parametrize("extra, problem", [
    ({"SLURM_TASKS_PER_NODE": "2(x2)"}, "use srun --ntasks-per-node=1"),
    ({"SLURM_NODEID": "5"}, "SLURM_NODEID 5 is out of range for 2 nodes"),
    ({"SLURM_JOB_NODELIST": "n[01-"}, "'[' without ']'"),
])
def test_bad_slurm_variables_get_one_line(ftrun_cli, extra, problem):
    code, out, err = ftrun_cli(TRAIN, env=slurm_env(0, 29999, **extra))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and problem in lines[0], err
