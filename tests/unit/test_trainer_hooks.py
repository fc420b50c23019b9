"""ftrun/trainer_hooks.py and what it turns on, without a framework: the rank's interpreter prepared under
``--recovery process`` alone (and not under ``--no-integrations``), a watched module wrapped once its code ran, a
fresh interpreter's command prepared as a forked rank is, and a setup the integrations do not cover said in one
line at job level, never a failed rank. The frameworks themselves run in tests/integration/test_frameworks.py."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

import ftrun.elastic.integrations.hf as hf
import ftrun.elastic.integrations.lightning as lightning
from ftrun import coverage, trainer_hooks
from ftrun.agent import standby
from ftrun.contract import WorkerEnv
from ftrun.elastic.integrations import shared
from tests.conftest import ROOT


def worker(rank: int = 0, recovery: str = "process", integrations: bool = True) -> dict[str, str]:
    return WorkerEnv(rank=rank, local_rank=rank, world_size=2, run_id="r", generation=0, control_store="127.0.0.1:1",
                     replacement=False, heartbeat_timeout=30.0, recovery=recovery,
                     integrations=integrations).to_environ()


@pytest.fixture
def meta_path(monkeypatch):
    """sys.meta_path as it was, after the test."""
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    return sys.meta_path


@pytest.mark.parametrize("environ, prepared", [
    ({}, False), (worker(recovery="job"), False), (worker(integrations=False), False),
    ({**worker(), "FTRUN_INTEGRATIONS": "0"}, False), (worker(), True)],
    ids=["outside-ftrun", "job-level", "no-integrations", "set-by-the-user", "process-level"])
def test_a_rank_is_prepared_under_process_level_unless_told_not_to(environ, prepared, meta_path):
    before = len(meta_path)
    assert trainer_hooks.prepare(environ) is prepared
    assert len(meta_path) == before + prepared  # the frameworks are not imported here: they are watched for


def test_a_watched_module_is_wrapped_once_its_code_ran_and_imports_as_before(tmp_path, monkeypatch, meta_path):
    (tmp_path / "watched_trainer.py").write_text("class Trainer:\n    made = 0\n\n"
                                                 "    def __init__(self, steps):\n        self.steps = steps\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []

    def wrap(module):
        trainer_hooks.wrap_method(module.Trainer, "__init__", before=lambda made: seen.append("before"),
                                  after=lambda made: seen.append(made.steps))

    meta_path.insert(0, trainer_hooks.AfterImport({"watched_trainer": wrap}))
    try:
        import watched_trainer
    finally:
        sys.modules.pop("watched_trainer", None)
    assert watched_trainer.Trainer(7).steps == 7 and seen == ["before", 7]
    assert watched_trainer.Trainer.__init__.__name__ == "__init__"


def test_a_wrapper_that_fails_leaves_the_framework_as_it_is(caplog):
    trainer_hooks._apply(trainer_hooks._hf_trainer, SimpleNamespace(__name__="transformers.trainer"))
    assert "transformers.trainer left as it is (AttributeError" in caplog.text


@pytest.mark.parametrize("given, why", [
    ({}, ""), ({"fsdp": "full_shard"}, "FSDP through accelerate"), ({"fsdp": True}, "FSDP through accelerate"),
    ({"deepspeed": {"zero_optimization": {"stage": 2}}}, ""), ({"deepspeed": "ds_config.json"}, ""),
    ({"parallelism_config": SimpleNamespace(tp_size=2, cp_size=None, dp_shard_size=1)}, "accelerate's parallelism (tp 2)"),
    ({"parallelism_config": SimpleNamespace(dp_replicate_size=2)}, "")])
def test_training_arguments_the_integration_does_not_cover(given, why):
    arguments = SimpleNamespace(**{"fsdp": "", "deepspeed": None, "parallelism_config": None, **given})
    assert coverage.arguments_uncovered(arguments) == why


class DDPStrategy:
    """Lightning's strategies, as far as their names and bases go."""


class DeepSpeedStrategy(DDPStrategy):
    pass


class FSDPStrategy:
    pass


class OwnDDP(DDPStrategy):
    pass


@pytest.mark.parametrize("strategy, why", [
    (DDPStrategy(), ""), (OwnDDP(), ""), (DeepSpeedStrategy(), "trains with Lightning's DeepSpeedStrategy"),
    (FSDPStrategy(), "trains with Lightning's FSDPStrategy")])
def test_lightning_strategies_the_integration_does_not_cover(strategy, why):
    assert coverage.strategy_uncovered(strategy) == why


class FakeJob:
    """What an integration tells the job it joined: why process level cannot work."""

    def __init__(self):
        self.refused: list[str] = []

    def refuse_process_level(self, refusal: str) -> None:
        self.refused.append(refusal)


@pytest.mark.parametrize("given, uses", [({}, False), ({"deepspeed": {"zero_optimization": {"stage": 3}}}, True),
                                         ({"deepspeed": "ds_config.json"}, True), ({"fsdp": "full_shard"}, False)])
def test_training_arguments_that_train_through_deepspeed(given, uses):
    arguments = SimpleNamespace(**{"fsdp": "", "deepspeed": None, "parallelism_config": None, **given})
    assert coverage.arguments_use_deepspeed(arguments) is uses


def test_training_arguments_with_accelerate_s_deepspeed_plugin_train_through_it(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    arguments = SimpleNamespace(fsdp="", deepspeed=None, parallelism_config=None)
    assert coverage.arguments_use_deepspeed(arguments) and coverage.arguments_uncovered(arguments) == ""


@pytest.mark.parametrize("trainer, why", [
    (SimpleNamespace(is_deepspeed_enabled=False, is_fsdp_enabled=True), "shards its model with FSDP through accelerate"),
    (SimpleNamespace(is_deepspeed_enabled=False, is_fsdp_enabled=False,
                     accelerator=SimpleNamespace(parallelism_config=SimpleNamespace(tp_size=2, cp_size=2))),
     "shards its model through accelerate's parallelism (tp 2, cp 2)")])
def test_a_trainer_the_integration_does_not_cover_goes_to_job_level_in_one_line(monkeypatch, trainer, why):
    job = FakeJob()
    monkeypatch.setattr(hf, "job", job)
    hf.enable(trainer)
    hf.enable(trainer)  # ftrun's own call as the Trainer is made, then the script's: said once
    assert job.refused == [f"the Hugging Face Trainer {why}, which process-level repair does not cover"]


def test_a_lightning_fit_that_optimizes_manually_goes_to_job_level_in_one_line(monkeypatch):
    job = FakeJob()
    monkeypatch.setattr(lightning, "job", job)
    hooks = lightning._RecoveryHooks()
    hooks.on_train_start(SimpleNamespace(strategy=DDPStrategy()), SimpleNamespace(automatic_optimization=False))
    assert job.refused == ["the Lightning Trainer optimizes manually (automatic_optimization is False), which "
                           "process-level repair does not cover"]
    assert hooks.job is None and not hooks._started  # the fit trains on as Lightning's own


@pytest.mark.parametrize("rank, recovery, said", [(0, "process", True), (1, "process", False), (0, "job", False)])
def test_a_rank_that_did_not_join_says_why_once_from_rank_0(monkeypatch, capsys, rank, recovery, said):
    monkeypatch.setattr(shared, "_said", [])
    for name, value in worker(rank, recovery).items():
        monkeypatch.setenv(name, value)
    shared.say_job_level("the Lightning Trainer trains with Lightning's FSDPStrategy")
    shared.say_job_level("something else")
    line = ("ftrun.elastic: the Lightning Trainer trains with Lightning's FSDPStrategy; a fault will restart the "
            "job")
    assert capsys.readouterr().err.splitlines() == ([line] if said else [])


def test_a_deepspeed_engine_made_without_the_integration_says_so_once(monkeypatch, capsys):
    """An unchanged DeepSpeed script: its loop is its own, so no hook can drive its steps; one line says what to
    add, and the job runs at job level. With the integration imported, nothing is said."""
    monkeypatch.setattr(shared, "_said", [])
    monkeypatch.setattr(shared, "_joined", [])
    for name, value in worker(0).items():
        monkeypatch.setenv(name, value)
    fake = SimpleNamespace(initialize=lambda model=None, config=None: ("engine", "optimizer", None, None))
    trainer_hooks._deepspeed(fake)
    monkeypatch.setitem(sys.modules, trainer_hooks.INTEGRATION_OF["deepspeed"], SimpleNamespace())
    assert fake.initialize(model="m") == ("engine", "optimizer", None, None)
    assert capsys.readouterr().err == ""
    monkeypatch.delitem(sys.modules, trainer_hooks.INTEGRATION_OF["deepspeed"])
    fake.initialize(model="m")
    fake.initialize(model="m")
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("ftrun.elastic: the script's DeepSpeed engine was made without ftrun's integration "
                           "(import ftrun.elastic.integrations.deepspeed before") and "restart the job" in line


def test_plain_scripts_are_known_by_the_trainers_they_name(tmp_path):
    hf_script, lightning_script, torch_script = (tmp_path / name for name in ("hf.py", "pl.py", "loop.py"))
    hf_script.write_text("from transformers import Trainer, TrainingArguments\n")
    lightning_script.write_text("import lightning as L\n")
    torch_script.write_text("from transformers import AutoModel  # a model only, in a torch loop\n")
    assert standby.framework_imports(str(hf_script)) == ("transformers.trainer",)
    assert standby.framework_imports(str(lightning_script)) == ("lightning.pytorch",)
    assert standby.framework_imports(str(torch_script)) == ()
    hf_script.write_text("from transformers import Trainer, TrainingArguments\nargs = TrainingArguments(deepspeed=ds)\n")
    assert standby.framework_imports(str(hf_script)) == ("transformers.trainer", *standby.DEEPSPEED_IMPORTS)
    hf_script.write_text("from transformers import Trainer, TrainingArguments\n")
    python = sys.executable
    assert standby.prepared([python, "-u", str(hf_script), "--lr", "1"]) == [
        python, "-u", "-m", "ftrun.agent.standby", str(hf_script), "--lr", "1"]
    for left in ([python, "-u", str(torch_script)], [python, "-u", "-m", "pl"], [str(lightning_script)]):
        assert standby.prepared(left) == left


def test_a_fresh_interpreter_runs_the_script_as_python_would(tmp_path):
    script = tmp_path / "show.py"
    script.write_text("import sys, os\nprint(sys.argv, sys.path[0] == os.path.dirname(__file__), __name__)\n")
    done = subprocess.run([sys.executable, "-u", "-m", "ftrun.agent.standby", str(script), "--lr", "1"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == f"[{str(script)!r}, '--lr', '1'] True __main__"


def test_a_rank_that_joined_tells_the_controller_instead(monkeypatch, capsys):
    # the script imported ftrun.elastic.hf first (it joined), then its arguments asked for FSDP: the controller
    # must go to job level at the next fault, not try a repair that no step of the Trainer's takes part in
    job = FakeJob()
    monkeypatch.setattr(shared, "_joined", [job])
    monkeypatch.setattr(trainer_hooks, "_declined", [])
    trainer_hooks._arguments_made(SimpleNamespace(fsdp="full_shard", deepspeed=None, parallelism_config=None))
    assert job.refused == ["the Hugging Face Trainer's arguments ask for FSDP through accelerate, which "
                           "process-level repair does not cover"]
    assert trainer_hooks._declined and capsys.readouterr().err == ""
