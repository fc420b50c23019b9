"""A rank's checkpoint saves, as the worker library sees them: the save clock (an injected clock), real
``torch.save`` and ``torch.distributed.checkpoint`` saves into tmp_path in this process, counted once however
nested, only on the training thread, and nothing outside ftrun."""

from __future__ import annotations

import threading

import pytest
import torch

from ftrun.elastic import saves
from ftrun.step_times import SaveClock


class Ticks:
    """A clock that moves 10 s at each reading: a save measured over two readings took 10 s, over four 30 s."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 10.0
        return self.now


@pytest.fixture
def clock(monkeypatch) -> SaveClock:
    """This process's saves counted on a clock of ticks, as ``ftrun.elastic.init()`` counts them under ftrun;
    ``torch.save`` and the library's clock put back after the test."""
    monkeypatch.setattr(torch, "save", torch.save)
    monkeypatch.setattr(saves, "_clock", None)
    ticks = Ticks()
    made = SaveClock(clock=ticks, wall=lambda: 1700000000.0 + ticks.now)
    saves.track_saves(made)
    return made


class Disk:
    """A file that notes, at each write, whether the rank's heartbeat would say it saves."""

    def __init__(self, clock: SaveClock):
        self.clock, self.seen = clock, []

    def write(self, data) -> int:
        self.seen.append(self.clock.since)
        return len(data)

    def flush(self) -> None:
        pass


def test_a_save_is_said_while_it_runs_and_measured_as_it_ends():
    ticks = Ticks()
    clock = SaveClock(clock=ticks, wall=lambda: 5.0)
    assert (clock.since, clock.longest) == (None, 0.0)
    with clock.saving():
        assert clock.since == 5.0
    assert (clock.since, clock.longest) == (None, 10.0)
    with pytest.raises(OSError), clock.saving():  # a save that fails was a save all the same
        ticks.now += 20.0
        raise OSError("disk full")
    assert (clock.since, clock.longest) == (None, 30.0)
    with clock.saving():
        pass
    assert clock.longest == 30.0  # the longest, not the last


def test_a_real_torch_save_is_counted_and_measured(clock, tmp_path):
    disk = Disk(clock)
    torch.save({"weight": torch.arange(4.0)}, disk)
    assert disk.seen and all(since is not None for since in disk.seen)  # the heartbeat said it throughout
    assert (clock.since, clock.longest) == (None, 10.0)
    torch.save({"weight": torch.arange(4.0)}, tmp_path / "model.pt")
    assert torch.load(tmp_path / "model.pt")["weight"].tolist() == [0.0, 1.0, 2.0, 3.0]  # saved as before
    assert clock.longest == 10.0


def test_nested_saves_count_once(clock, tmp_path):
    # a framework's checkpoint (the script's own writer around torch.save, or torch.save twice) is one save:
    # two readings of the clock (10 s), not four (30 s)
    with saves.saving():
        torch.save(torch.ones(2), tmp_path / "a.pt")
        torch.save(torch.ones(2), tmp_path / "b.pt")
    assert (clock.since, clock.longest) == (None, 10.0)
    saves.track_saves(clock)  # a second job in the process wraps nothing twice
    torch.save(torch.ones(2), tmp_path / "c.pt")
    assert clock.longest == 10.0


def test_a_framework_method_counted_as_a_save_once_is_one_save(clock, tmp_path):
    class Trainer:
        def save_checkpoint(self, path):
            torch.save(torch.ones(2), path)
            (tmp_path / "done").write_text("")

    trainer = Trainer()
    saves.count_saves_of(trainer, "save_checkpoint")
    saves.count_saves_of(trainer, "save_checkpoint")
    trainer.save_checkpoint(tmp_path / "c.pt")
    assert (tmp_path / "done").exists() and clock.longest == 10.0


def test_a_save_on_another_thread_than_the_training_one_is_not_counted(clock, tmp_path):
    # a background writer (torch.distributed.checkpoint's async_save) holds no other rank
    writer = threading.Thread(target=torch.save, args=(torch.ones(2), tmp_path / "bg.pt"), name="writer")
    writer.start()
    writer.join(30)
    assert (tmp_path / "bg.pt").exists() and (clock.since, clock.longest) == (None, 0.0)


def test_outside_ftrun_nothing_is_counted(monkeypatch, tmp_path):
    monkeypatch.setattr(saves, "_clock", None)
    with saves.saving():
        torch.save(torch.ones(2), tmp_path / "a.pt")
    assert (tmp_path / "a.pt").exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, no group: DCP's own word
def test_torch_distributed_checkpoint_saves_are_counted_the_async_one_while_it_blocks(clock, tmp_path, monkeypatch):
    import sys

    import torch.distributed.checkpoint as dcp

    for name in saves.DCP_MODULES:  # put back after the test
        for function in saves.DCP_SAVES:
            monkeypatch.setattr(sys.modules[name], function, getattr(sys.modules[name], function))
    saves.track_checkpoint()  # imported after init(): wrapped at the first steps()

    class Writer(dcp.FileSystemWriter):
        """DCP's own file writer, noting whether the heartbeat would say the rank saves as DCP plans the save
        (before any file is written) and as it writes."""

        seen: list = []

        def prepare_local_plan(self, plan):
            self.seen.append(clock.since)
            return super().prepare_local_plan(plan)

        def write_data(self, plan, planner):
            self.seen.append(clock.since)
            return super().write_data(plan, planner)

    dcp.save({"weight": torch.arange(4.0)}, storage_writer=Writer(tmp_path / "sync"))
    assert len(Writer.seen) == 2 and None not in Writer.seen
    assert (clock.since, clock.longest) == (None, 10.0)  # torch.save inside it, if any, is part of the one save
    clock.longest = 0.0
    future = dcp.async_save({"weight": torch.arange(4.0)}, checkpoint_id=tmp_path / "async")
    assert (clock.since, clock.longest) == (None, 10.0)  # the staging the rank waits for; the writes go on behind
    future.result(timeout=60)
    assert clock.longest == 10.0
    loaded = {"weight": torch.zeros(4)}
    dcp.load(loaded, checkpoint_id=tmp_path / "async")
    assert loaded["weight"].tolist() == [0.0, 1.0, 2.0, 3.0]
