"""Parts of the machine that some tests need (etcd, sshd, tmux, chromium, ip and network namespaces, root,
MindSpore, the frameworks) and what a test does without one: here it skips and says why (scripts/test.sh runs
pytest with -rs, so the reasons are in the log); on CI (``CI=true``), where scripts/test.sh installs every
part and runs as root, a part that is missing or fails to start is a failure, never a quiet skip that a count
hides."""

from __future__ import annotations

import importlib
import os
import shutil
import warnings
from types import ModuleType
from typing import NoReturn

import pytest

ON_CI = os.environ.get("CI") == "true"
#: FTRUN_TEST_MINDSPORE=0 leaves the MindSpore tests out (scripts/test.sh then installs no .msvenv)
MINDSPORE_WANTED = os.environ.get("FTRUN_TEST_MINDSPORE", "1") != "0"


class PartMissing(Warning):
    """A check inside a test was left out for want of a part (outside CI). Not a UserWarning, which
    pyproject.toml's filterwarnings hides."""


def unavailable(why: str, *, wanted: bool = True) -> NoReturn:
    """The test cannot run for want of a part: a skip saying why, or on CI a failure (unless the run
    left the part out on purpose: ``wanted`` False)."""
    if ON_CI and wanted:
        pytest.fail(f"{why} (CI installs every part the tests use: one that fails to start is a failure)",
                    pytrace=False)
    pytest.skip(why)


def module(name: str) -> ModuleType:
    """The Python module ``name`` (a framework a test drives), or the test skips (fails on CI)."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        unavailable(f"{name} cannot be imported here: {e}")


def tmux() -> str:
    """tmux's path, or the test skips (fails on CI)."""
    found = shutil.which("tmux")
    if not found:
        unavailable("tmux is not installed (scripts/test.sh installs it when run as root)")
    return found


def tmux_for_a_check(what: str) -> bool:
    """Whether a check inside a larger test can draw in tmux: on CI a missing tmux fails the test; elsewhere
    the check is left out with a warning that the run's summary shows, never silently."""
    if shutil.which("tmux"):
        return True
    if ON_CI:
        pytest.fail(f"tmux is not installed: {what} cannot be checked (CI installs it)", pytrace=False)
    warnings.warn(PartMissing(f"tmux is not installed: {what} was not checked"), stacklevel=2)
    return False
