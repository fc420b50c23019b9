"""The man page keeps up with the flags: every visible option of ``ftrun`` is documented there."""

from __future__ import annotations

import re

import click
import pytest

from ftrun.cli import launch_command
from tests.conftest import ROOT

MAN_PAGE = (ROOT / "man" / "ftrun.1").read_text()
OPTIONS = [p for p in launch_command.params if isinstance(p, click.Option) and not p.hidden and p.name != "version"]


@pytest.mark.parametrize("option", OPTIONS, ids=[o.name for o in OPTIONS])
def test_every_flag_has_an_entry_in_the_man_page(option):
    long_name = next(o for o in option.opts if o.startswith("--") and "_" not in o)
    spelled = re.escape(long_name.replace("-", "\\-")) + r"(?!\\-|\w)"  # not the start of a longer flag
    assert re.search(spelled, MAN_PAGE), f"{long_name} is missing from man/ftrun.1"
