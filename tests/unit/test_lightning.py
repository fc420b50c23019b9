"""ftrun.elastic.lightning's parts that need no Lightning: a step's data taken again after a repair, and a step's
micro-batches under ``accumulate_grad_batches``. The callback itself runs in tests/integration/test_frameworks.py."""

from __future__ import annotations

from types import SimpleNamespace

from ftrun.elastic.integrations.lightning import _RecoveryHooks, _Rewind


class Loader:
    """Like Lightning's CombinedLoader: ``next()`` goes on, ``iter()`` would start the epoch anew."""

    def __init__(self, count: int):
        self.items = iter(range(count))

    def __iter__(self):
        raise AssertionError("iter() starts the epoch anew")

    def __next__(self) -> int:
        return next(self.items)


class Fetcher:
    """Lightning's data fetcher, as far as the rewind reads it."""

    def __init__(self, count: int):
        self.iterator, self.fetched, self.done = Loader(count), 0, False

    def __next__(self) -> int:
        item = next(self.iterator)
        self.fetched += 1
        self.done = self.fetched >= 6
        return item


def test_a_rewound_batch_takes_what_it_fetched_again_then_goes_on():
    fetcher = Fetcher(6)
    assert next(fetcher) == 0
    rewind = _Rewind(fetcher)
    assert [next(fetcher), next(fetcher)] == [1, 2]  # the batch, and one fetched ahead
    rewind.rewind()
    assert fetcher.fetched == 1 and not fetcher.done
    assert [next(fetcher), next(fetcher), next(fetcher)] == [1, 2, 3]
    rewind.done()
    assert [next(fetcher), next(fetcher)] == [4, 5] and fetcher.done


def test_a_batch_that_ends_well_leaves_the_fetcher_on_its_own_iterator():
    fetcher = Fetcher(3)
    loader = fetcher.iterator
    rewind = _Rewind(fetcher)
    assert next(fetcher) == 0
    rewind.done()
    assert fetcher.iterator is loader and next(fetcher) == 1


class EpochLoop:
    """Lightning's training epoch loop, as far as a step's micro-batches use it: ``batches`` batches an epoch,
    ``accumulate`` a step (the epoch's last batch steps whatever is accumulated)."""

    def __init__(self, batches: int, accumulate: int):
        self.batches, self.accumulate, self.ready = batches, accumulate, 0
        self.done = False
        self.calls: list[tuple[str, int]] = []

    def advance(self, fetcher) -> None:
        self.ready += 1
        self.calls.append(("advance", self.ready))

    def _should_accumulate(self) -> bool:
        return self.ready % self.accumulate != 0 and self.ready < self.batches

    def on_advance_end(self, fetcher) -> None:
        self.calls.append(("advance_end", self.ready))

    def on_iteration_done(self) -> None:
        self.calls.append(("iteration_done", self.ready))


def step_of(loop: EpochLoop) -> list[tuple[str, int]]:
    """The calls one guarded step makes (the loop does the last batch's ``on_advance_end`` itself)."""
    hooks = _RecoveryHooks()
    hooks.progress = SimpleNamespace(trainer=SimpleNamespace(fit_loop=SimpleNamespace(epoch_loop=loop)))
    loop.calls = []
    hooks._optimizer_step(loop.advance, None)
    return loop.calls


def test_a_step_runs_its_micro_batches_as_the_epoch_loop_would_up_to_the_one_that_steps():
    loop = EpochLoop(batches=5, accumulate=2)
    first = [("advance", 1), ("advance_end", 1), ("iteration_done", 1), ("advance", 2)]
    assert step_of(loop) == first
    assert step_of(loop) == [(call, ready + 2) for call, ready in first]
    assert step_of(loop) == [("advance", 5)]  # the epoch's last batch steps alone


def test_without_accumulation_a_step_is_one_batch():
    loop = EpochLoop(batches=3, accumulate=1)
    assert [step_of(loop) for _ in range(3)] == [[("advance", 1)], [("advance", 2)], [("advance", 3)]]


def test_a_loop_done_mid_step_ends_the_step_there():
    loop = EpochLoop(batches=8, accumulate=4)
    loop.advance(None)
    loop.done = True  # early stopping asked for, say
    assert step_of(loop) == [("advance", 2)]


def test_the_trainers_checkpoint_is_one_save_its_file_write_after_torch_save_included(monkeypatch):
    # Lightning's torch.save writes into memory and the file is written after it: the whole of
    # trainer.save_checkpoint is the save, measured once
    from ftrun.elastic import saves
    from ftrun.elastic.integrations import lightning
    from ftrun.step_times import SaveClock

    readings = iter([0.0, 7.0])  # one save reads the clock twice; one counted twice would read it four times
    clock = SaveClock(clock=lambda: next(readings), wall=lambda: 100.0)
    monkeypatch.setattr(saves, "_clock", clock)
    monkeypatch.setattr(lightning, "job", SimpleNamespace(receives_state=False))
    seen = []
    trainer = SimpleNamespace(save_checkpoint=lambda path, weights_only=None: seen.append((path, clock.since)))
    hooks = _RecoveryHooks()
    hooks.setup(trainer, None, "fit")
    hooks.setup(trainer, None, "validate")  # each stage's setup
    trainer.save_checkpoint("last.ckpt")
    assert seen == [("last.ckpt", 100.0)] and (clock.since, clock.longest) == (None, 7.0)
