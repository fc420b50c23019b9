"""A MindSpore rank's state in ftrun's snapshots: numpy arrays by parameter name, and ``.ckpt`` files for
its checkpoints (``ftrun/elastic/arrays.py`` is the same for torch tensors)."""

from __future__ import annotations

import collections
import os
import tempfile

from ftrun.snapshots.rank import ArrayKind


class MindSporeArrays(ArrayKind):
    """A MindSpore rank's state: numpy arrays by parameter name; its checkpoint files are ``.ckpt``."""

    def load_checkpoint(self, data: bytes, path: str) -> dict:
        import mindspore

        if os.path.exists(path):
            return _arrays(mindspore.load_checkpoint(path))
        with tempfile.NamedTemporaryFile(suffix=".ckpt") as f:  # another node's, fetched from its agent
            f.write(data)
            f.flush()
            return _arrays(mindspore.load_checkpoint(f.name))


def _arrays(parameters: dict) -> dict:
    return collections.OrderedDict((name, parameter.asnumpy()) for name, parameter in parameters.items())
