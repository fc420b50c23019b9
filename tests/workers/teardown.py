"""How the test workers leave once their work is done."""

import os
import sys


def leave() -> None:
    """Exit 0 without the interpreter's teardown. Under a loaded machine torch 2.13 sometimes aborts while
    the interpreter shuts down, after all the work is done ("terminate called without an active
    exception", SIGABRT). The tests check ftrun, not torch's teardown."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
