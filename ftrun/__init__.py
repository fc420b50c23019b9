"""ftrun: a fault-tolerant replacement for torchrun.

This package must stay cheap to import: the orphan guardian and the CLI's
argument parsing run without torch.
"""

__version__ = "0.1.0"
