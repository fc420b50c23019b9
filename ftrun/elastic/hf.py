"""``import ftrun.elastic.hf``: the name scripts import the Hugging Face Trainer's integration by. The code is
``ftrun/elastic/integrations/hf.py``, and this name is that very module (one job, one ``enable``), so that
``ftrun.elastic.hf.enable(trainer)`` and ``ftrun.elastic.integrations.hf.enable(trainer)`` are the same call.
"""

import sys

from ftrun.elastic.integrations import hf

sys.modules[__name__] = hf
