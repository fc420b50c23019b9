"""docs/integrations.md's checklist for a new framework, held true: every integration has its row, drives the
job's step protocol and nothing of the repair by hand, and has its test worker; the names scripts import are
the integrations' modules themselves; a warm standby knows each by the name a script may write."""

from __future__ import annotations

import importlib
import re

import pytest

from ftrun.agent.standby import FRAMEWORK_IMPORTS
from tests.conftest import ROOT

DOC = (ROOT / "docs" / "integrations.md").read_text()
FOLDER = ROOT / "ftrun" / "elastic" / "integrations"
#: the folder's modules that are no framework's
SHARED = {"__init__.py", "shared.py"}
#: the dance by hand that the protocol replaces
BY_HAND = ("__enter__(", "__exit__(", ".guard()", "next(self._steps", ".steps(")


def rows() -> list[tuple[str, str, str, str]]:
    """The checklist's table: framework, module, what scripts import, test worker."""
    text = DOC[DOC.index("## A new framework"):]
    table = text[text.index("| framework | module |"):].splitlines()[2:]
    found = []
    for line in table:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        found.append((cells[0], *(re.search(r"`([^`]+)`", cell).group(1) for cell in cells[1:4])))
    return found


ROWS = rows()


def test_the_table_reads_and_names_every_integration_in_the_folder():
    listed = {module for _, module, _, _ in ROWS}
    assert "ftrun/elastic/integrations/hf.py" in listed  # the check reads the right table
    in_folder = {f"ftrun/elastic/integrations/{path.name}" for path in FOLDER.glob("*.py") if path.name not in SHARED}
    assert not in_folder - listed, f"docs/integrations.md's checklist table lacks {sorted(in_folder - listed)}"


def protocol_faults(module: str, source: str) -> list[str]:
    """What ``module``'s ``source`` lacks of the step protocol, or does by hand instead (empty: nothing)."""
    calls = ("end_step(",) if "mindspore" in module else ("start_steps(", "begin_step(", "end_step(")
    faults = [f"does not call {call}" for call in calls if f".{call}" not in source]
    if module.startswith("ftrun/elastic/integrations/"):
        faults += [f"drives the job by hand ({dance})" for dance in BY_HAND if dance in source]
    return faults


@pytest.mark.parametrize("framework, module, imported, worker", ROWS, ids=[row[0] for row in ROWS])
def test_each_integration_drives_the_step_protocol_and_has_its_test_worker(framework, module, imported, worker):
    assert not protocol_faults(module, (ROOT / module).read_text()), f"{module}: use the step protocol"
    assert (ROOT / worker).is_file(), f"{framework}: no test worker {worker}"
    assert imported in (ROOT / worker).read_text(), f"{worker} does not import {imported}"


def test_the_check_spots_an_integration_that_drives_the_guard_by_hand():
    by_hand = "self._steps = job.steps(total)\nnext(self._steps)\njob.guard().__enter__()\njob.end_step()\n"
    assert protocol_faults("ftrun/elastic/integrations/deepspeed.py", by_hand) == [
        "does not call start_steps(", "does not call begin_step(", "drives the job by hand (__enter__()",
        "drives the job by hand (.guard())", "drives the job by hand (next(self._steps)",
        "drives the job by hand (.steps()"]
    protocol = "job.start_steps(total)\njob.begin_step()\noutcome = job.end_step(error)\n"
    assert protocol_faults("ftrun/elastic/integrations/deepspeed.py", protocol) == []


@pytest.mark.parametrize("short, full", [("ftrun.elastic.hf", "ftrun.elastic.integrations.hf"),
                                         ("ftrun.elastic.lightning", "ftrun.elastic.integrations.lightning")])
def test_the_name_a_script_imports_is_the_integration_itself(short, full):
    assert importlib.import_module(short) is importlib.import_module(full)


def test_a_warm_standby_knows_each_integration_by_both_its_names():
    for _, module, imported, _ in ROWS:
        if module.startswith("ftrun/elastic/integrations/"):
            full = module.removesuffix(".py").replace("/", ".")
            assert imported in FRAMEWORK_IMPORTS and full in FRAMEWORK_IMPORTS, module
            assert FRAMEWORK_IMPORTS[imported] == FRAMEWORK_IMPORTS[full]
