"""ftrun.elastic.lightning's part that needs no Lightning: a batch's data taken again after a repair. The
callback itself runs in tests/integration/test_frameworks.py."""

from __future__ import annotations

from ftrun.elastic.lightning import _Rewind


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
