"""``import ftrun.elastic.lightning``: the name scripts import PyTorch Lightning's integration by. The code is
``ftrun/elastic/integrations/lightning.py``, and this name is that very module (one job, one ``Recovery``), so
that ``ftrun.elastic.lightning.Recovery()`` and ``ftrun.elastic.integrations.lightning.Recovery()`` are one.
"""

import sys

from ftrun.elastic.integrations import lightning

sys.modules[__name__] = lightning
