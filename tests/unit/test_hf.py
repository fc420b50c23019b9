"""ftrun.elastic.hf's parts (ftrun/elastic/integrations/hf.py) that need no Trainer: the line outside ftrun and
after the process group was formed, and the Trainer's progress (TrainerState, RNG states, the loss counters) taken and put back. The
Trainer itself runs in tests/integration/test_frameworks.py."""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import ftrun.elastic.integrations.hf as hf


@dataclasses.dataclass
class State:
    """What the progress needs of transformers' TrainerState: a dataclass of JSON values."""

    global_step: int = 0
    epoch: float = 0.0
    log_history: list = dataclasses.field(default_factory=list)
    stateful_callbacks: dict = dataclasses.field(default_factory=dict)


def trainer(step: int = 0) -> SimpleNamespace:
    return SimpleNamespace(state=State(global_step=step), accelerator=SimpleNamespace(scaler=None),
                           args=SimpleNamespace(device="cpu"), _tr_loss=torch.tensor(0.0), current_flos=0.0,
                           _total_loss_scalar=0.0, _globalstep_last_logged=0, _initial_global_step=0)


def test_outside_ftrun_enable_does_nothing(monkeypatch):
    monkeypatch.setattr(hf, "job", None)
    given = SimpleNamespace()
    hf.enable(given)
    assert vars(given) == {}


def test_enable_after_the_group_was_formed_trains_on_at_job_level_in_one_line(monkeypatch, capsys):
    # under ftrun --recovery process (a worker environment) but nothing joined: the process group came first
    monkeypatch.setattr(hf, "job", None)
    monkeypatch.setattr(hf.shared, "_said", [])
    environ = SimpleNamespace(rank=0, recovery="process")
    monkeypatch.setattr(hf.shared.WorkerEnv, "from_environ", classmethod(lambda cls: environ))
    given = SimpleNamespace()
    hf.enable(given)
    hf.enable(given)
    assert vars(given) == {}
    assert capsys.readouterr().err.splitlines() == [
        "ftrun.elastic: torch's process group was formed before ftrun.elastic.hf could form it (import it before "
        "making TrainingArguments, or leave it to ftrun --recovery process: docs/integrations.md); a fault will "
        "restart the job"]


def test_a_replacement_gets_the_trainer_s_progress_as_its_source_took_it():
    source = trainer(step=5)
    source.state.log_history.append({"loss": 3.9, "step": 4})
    source._tr_loss, source._total_loss_scalar, source._globalstep_last_logged = torch.tensor(7.5), 12.0, 4
    taken = hf.TrainerProgress(source)
    taken.capture()
    source.state.global_step, source._tr_loss = 6, torch.tensor(99.0)  # the step goes on after the capture
    sent = taken.state_dict()

    replacement = trainer()
    received = hf.TrainerProgress(replacement)
    received.load_state_dict(sent)
    assert received.loaded and received.global_step == 5
    received.put_back_state()
    received.put_back_counters()
    assert replacement.state == State(global_step=5, log_history=[{"loss": 3.9, "step": 4}])
    assert replacement._tr_loss.item() == 7.5 and replacement._total_loss_scalar == 12.0
    assert replacement._globalstep_last_logged == 4


def test_the_rng_states_go_back_to_where_they_were_taken():
    progress = hf.TrainerProgress(trainer())
    progress.capture()
    drawn = (random.random(), np.random.rand(), torch.rand(3))
    progress.put_back_rng()
    again = (random.random(), np.random.rand(), torch.rand(3))
    assert drawn[:2] == again[:2] and torch.equal(drawn[2], again[2])


def test_a_healthy_rank_s_log_history_is_its_own_copy():
    # the Trainer appends to its log history after the capture: a rollback must not see those entries
    source = trainer(step=2)
    progress = hf.TrainerProgress(source)
    progress.capture()
    source.state.log_history.append({"loss": 1.0})
    progress.put_back_state()
    assert source.state.log_history == []


def test_a_trainer_that_trains_through_deepspeed_is_covered():
    # its engine's state (ZeRO's partitions included) is the deepspeed integration's to register
    given = SimpleNamespace(is_deepspeed_enabled=True, is_fsdp_enabled=False,
                            accelerator=SimpleNamespace(parallelism_config=None))
    assert hf.uncovered(given) == ""


def test_under_the_trainer_a_stage_0_update_whose_all_reduce_failed_raises(monkeypatch):
    # the deepspeed integration's own steps() keeps the failure for end_step(); the Trainer's loop has no place to
    # take it there, so the engine's step() raises it (as DDP's torch optimizer's does) and _run_epoch repairs
    from ftrun.elastic.groups import GroupFailed
    from ftrun.elastic.integrations import deepspeed

    def before_update():
        raise GroupFailed("the all-reduce failed")

    job = SimpleNamespace(state=SimpleNamespace(before_update=before_update, objects={}), snapshots=None)
    engine = SimpleNamespace(is_gradient_accumulation_boundary=lambda: True)
    state = SimpleNamespace(partitioned=False, engine=engine)
    monkeypatch.setattr(deepspeed, "job", job)
    monkeypatch.setattr(deepspeed, "_looping", [True])
    monkeypatch.setattr(deepspeed, "_stopped", [])
    monkeypatch.setattr(deepspeed, "_driven", [])
    assert deepspeed._step(state, lambda: "updated") is None  # its own steps(): kept for end_step()
    assert [str(error) for error in deepspeed._stopped] == ["the all-reduce failed"]
    deepspeed._stopped.clear()
    assert deepspeed.driven_by_trainer() == []
    with pytest.raises(GroupFailed, match="the all-reduce failed"):
        deepspeed._step(state, lambda: "updated")
    assert deepspeed._stopped == []
