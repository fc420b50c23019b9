"""Placement inside a Slurm allocation, from SLURM_* alone."""

from __future__ import annotations

import pytest

from ftrun.config import DEFAULT_RDZV_PORT, Endpoint, build_launch_config
from ftrun.errors import UsageError
from ftrun.head.slurm import PORT_SPREAD, SlurmPlan, derived_port, slurm_plan
from tests.conftest import WORKERS


def slurm_env(**overrides: str) -> dict[str, str]:
    """What srun --nodes=3 --ntasks-per-node=1 sets on the second node of job 4242, step 0."""
    env = {
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_ID": "0",
        "SLURM_JOB_NODELIST": "gpu[01-03]",
        "SLURM_STEP_NODELIST": "gpu[01-03]",
        "SLURM_NNODES": "3",
        "SLURM_NODEID": "1",
        "SLURM_TASKS_PER_NODE": "1(x3)",
    }
    env.update(overrides)
    return {key: value for key, value in env.items() if value is not None}


def usage_error(env) -> str:
    with pytest.raises(UsageError) as caught:
        slurm_plan(env)
    return caught.value.message


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"PATH": "/bin", "MASTER_PORT": "1234"},
        {"SLURM_JOB_ID": ""},
        {"SLURM_NODELIST": "n[1-2]", "SLURM_NODEID": "0"},
    ],
)
def test_outside_slurm_there_is_no_plan(env):
    assert slurm_plan(env) is None


def test_plan_from_a_typical_srun_step():
    plan = slurm_plan(slurm_env())
    assert plan == SlurmPlan(
        job_id="4242",
        hosts=("gpu01", "gpu02", "gpu03"),
        node_rank=1,
        endpoint=Endpoint("gpu01", derived_port("4242", "0")),
        run_id="slurm-4242.0",
    )


def test_old_slurm_job_id_spelling_is_read():
    plan = slurm_plan(slurm_env(SLURM_JOB_ID=None, SLURM_JOBID="77"))
    assert plan is not None and plan.job_id == "77" and plan.run_id == "slurm-77.0"


@pytest.mark.parametrize(
    "lists, expected",
    [
        ({"SLURM_STEP_NODELIST": "s[1-2]", "SLURM_JOB_NODELIST": "j[1-4]", "SLURM_NODELIST": "x[1-4]"}, ("s1", "s2")),
        ({"SLURM_JOB_NODELIST": "j[1-2]", "SLURM_NODELIST": "x[1-2]"}, ("j1", "j2")),
        ({"SLURM_NODELIST": "x[1-2]"}, ("x1", "x2")),
        ({"SLURM_STEP_NODELIST": "", "SLURM_JOB_NODELIST": "j[1-2]"}, ("j1", "j2")),
    ],
)
def test_step_node_list_is_preferred_over_the_job_node_list(lists, expected):
    env = slurm_env(SLURM_STEP_NODELIST=None, SLURM_JOB_NODELIST=None, SLURM_NNODES="2", SLURM_NODEID="0")
    plan = slurm_plan({**env, **lists})
    assert plan.hosts == expected
    assert plan.endpoint.host == expected[0]


def test_step_on_part_of_the_allocation_uses_the_step_nodes_and_counts():
    env = slurm_env(
        SLURM_JOB_NODELIST="n[1-4]", SLURM_JOB_NUM_NODES="4", SLURM_STEP_NODELIST="n[3-4]",
        SLURM_STEP_NUM_NODES="2", SLURM_NNODES="2", SLURM_NODEID="1", SLURM_TASKS_PER_NODE="1(x2)",
    )
    plan = slurm_plan(env)
    assert plan.hosts == ("n3", "n4") and plan.node_rank == 1 and plan.endpoint.host == "n3"


@pytest.mark.parametrize("node_id, rank", [("0", 0), ("1", 1), ("2", 2), (None, 0)])
def test_node_rank_is_slurm_nodeid(node_id, rank):
    plan = slurm_plan(slurm_env(SLURM_NODEID=node_id))
    assert plan.node_rank == rank
    assert plan.endpoint.host == "gpu01"


def test_every_node_of_a_step_agrees_on_the_endpoint_and_run_id():
    plans = [slurm_plan(slurm_env(SLURM_NODEID=str(rank))) for rank in range(3)]
    assert [p.node_rank for p in plans] == [0, 1, 2]
    assert len({(p.endpoint, p.run_id, p.hosts) for p in plans}) == 1


@pytest.mark.parametrize("port", ["29500", "1234", " 6000 "])
def test_master_port_sets_the_store_port(port):
    assert slurm_plan(slurm_env(MASTER_PORT=port)).endpoint == Endpoint("gpu01", int(port))


@pytest.mark.parametrize("job_id", ["1", "4242", "999999"])
def test_derived_port_is_stable_and_in_the_spread(job_id):
    ports = {slurm_plan(slurm_env(SLURM_JOB_ID=job_id, SLURM_NODEID=str(n))).endpoint.port for n in range(3)}
    assert len(ports) == 1
    assert DEFAULT_RDZV_PORT <= ports.pop() < DEFAULT_RDZV_PORT + PORT_SPREAD


def test_two_steps_of_one_job_get_different_ports_and_run_ids():
    first, second = (slurm_plan(slurm_env(SLURM_STEP_ID=step)) for step in ("0", "1"))
    assert first.endpoint.port != second.endpoint.port
    assert first.run_id != second.run_id


@pytest.mark.parametrize(
    "step, run_id",
    [("0", "slurm-4242.0"), ("3", "slurm-4242.3"), (None, "slurm-4242"), ("batch", "slurm-4242.batch")],
)
def test_run_id_names_job_and_step(step, run_id):
    assert slurm_plan(slurm_env(SLURM_STEP_ID=step)).run_id == run_id


def test_consecutive_jobs_do_not_share_a_port():
    ports = {slurm_plan(slurm_env(SLURM_JOB_ID=str(job))).endpoint.port for job in range(4240, 4250)}
    assert len(ports) == 10


@pytest.mark.parametrize(
    "overrides, words",
    [
        ({"SLURM_NNODES": "4"}, ["SLURM_NNODES is 4", "'gpu[01-03]'", "names 3 nodes"]),
        ({"SLURM_NNODES": None, "SLURM_STEP_NUM_NODES": "2"}, ["SLURM_NNODES is 2", "names 3 nodes"]),
        ({"SLURM_NNODES": None, "SLURM_JOB_NUM_NODES": "5"}, ["SLURM_NNODES is 5"]),
        ({"SLURM_NNODES": "three"}, ["SLURM_NNODES must be a whole number", "'three'"]),
        ({"SLURM_NODEID": "3"}, ["SLURM_NODEID 3 is out of range for 3 nodes"]),
        ({"SLURM_NODEID": "17"}, ["SLURM_NODEID 17 is out of range"]),
        ({"SLURM_NODEID": "-1"}, ["SLURM_NODEID must be a whole number", "'-1'"]),
        ({"SLURM_NODEID": "first"}, ["SLURM_NODEID must be a whole number", "'first'"]),
        ({"SLURM_NODEID": ""}, ["SLURM_NODEID must be a whole number"]),
        ({"SLURM_TASKS_PER_NODE": "2(x3)"}, ["2(x3) tasks per node", "--ntasks-per-node=1"]),
        ({"SLURM_TASKS_PER_NODE": "8"}, ["8 tasks per node"]),
        ({"SLURM_TASKS_PER_NODE": "2,1(x2)"}, ["2,1(x2) tasks per node"]),
        ({"SLURM_TASKS_PER_NODE": None, "SLURM_STEP_TASKS_PER_NODE": "4(x3)"}, ["4(x3) tasks per node"]),
        ({"SLURM_TASKS_PER_NODE": None, "SLURM_NTASKS_PER_NODE": "2"}, ["2 tasks per node"]),
        ({"SLURM_TASKS_PER_NODE": "many"}, ["must look like 1 or 2(x3)", "'many'"]),
        ({"SLURM_STEP_NODELIST": None, "SLURM_JOB_NODELIST": None}, ["SLURM_JOB_NODELIST is not set", "srun"]),
        ({"SLURM_STEP_NODELIST": "", "SLURM_JOB_NODELIST": ""}, ["SLURM_JOB_NODELIST is not set"]),
        ({"SLURM_STEP_NODELIST": "gpu[01-03"}, ["SLURM_JOB_NODELIST:", "'[' without ']'"]),
        ({"SLURM_STEP_NODELIST": "gpu[03-01]"}, ["SLURM_JOB_NODELIST:", "backwards"]),
        ({"MASTER_PORT": "http"}, ["MASTER_PORT must be a whole number", "'http'"]),
        ({"MASTER_PORT": "70000"}, ["MASTER_PORT must be a port number", "70000"]),
        ({"MASTER_PORT": "0"}, ["MASTER_PORT must be a port number"]),
        ({"SLURM_TASKS_PER_NODE": "1,2"}, ["1,2 tasks per node"]),
        ({"SLURM_TASKS_PER_NODE": "1(x2),2"}, ["1(x2),2 tasks per node"]),
    ],
)
def test_slurm_environment_that_cannot_work(overrides, words):
    message = usage_error(slurm_env(**overrides))
    for word in words:
        assert word in message


@pytest.mark.parametrize("tasks", ["1", "1(x3)", " 1(x3)"])
def test_one_task_per_node_is_accepted(tasks):
    assert slurm_plan(slurm_env(SLURM_TASKS_PER_NODE=tasks)).node_rank == 1


@pytest.mark.parametrize("node_id", ["0", "1", "2"])
def test_options_build_a_launch_config_for_this_node(node_id):
    plan = slurm_plan(slurm_env(SLURM_NODEID=node_id))
    options = plan.options()
    assert options == {"nnodes": "3", "node_rank": int(node_id), "rdzv_endpoint": str(plan.endpoint),
                       "run_id": "slurm-4242.0"}
    config = build_launch_config({**options, "script": str(WORKERS / "train.py")})
    assert config.endpoint == plan.endpoint
    assert config.node_rank == int(node_id)
    assert (config.min_nodes, config.max_nodes) == (3, 3)
    assert config.run_id == "slurm-4242.0"


def test_describe_lists_every_node_with_its_rank():
    lines = slurm_plan(slurm_env()).describe()
    port = derived_port("4242", "0")
    assert lines == [
        f"Slurm job 4242: 3 nodes, this is node 1; store on gpu01:{port}; run id slurm-4242.0",
        "  node 0  gpu01",
        "  node 1  gpu02",
        "  node 2  gpu03",
    ]


def test_describe_a_single_node_job_in_the_singular():
    plan = slurm_plan(slurm_env(SLURM_STEP_NODELIST="solo", SLURM_NNODES="1", SLURM_NODEID="0"))
    assert plan.describe()[0].startswith("Slurm job 4242: 1 node, this is node 0; store on solo:")
