"""A test that lacks a part of the machine goes through tests/parts.py (a skip here, a failure on CI): no test
decides on a missing part with a skip of its own, which CI would count and pass."""

from __future__ import annotations

import re

import pytest

from tests import parts
from tests.conftest import ROOT

#: a skip decided in a test file: pytest.skip(...), @pytest.mark.skipif(...), pytest.importorskip(...)
SKIP = re.compile(r"pytest\.(skip\(|mark\.skipif\(|importorskip\()")
#: the skips that decide on something else than a missing part, by file and what they say
NOT_A_PART = {
    ("tests/integration/test_torchrun_flags.py", "needs two CPUs"),  # the machine's size
    ("tests/integration/test_torchrun_flags.py", "no four free ports in a row"),  # ports others hold now
    ("tests/integration/test_mindspore.py", "ftrun's own python has mindspore"),  # a part too many
    ("tests/unit/test_gpu_check.py", "a GPU is here"),  # a part too many: the check would run
    ("tests/unit/test_docs.py", "groff is not installed"),  # a lint of the man page that CI does not install
}


def skips_outside_parts(root=ROOT) -> list[str]:
    """Every skip in ``root``/tests/ that is neither in tests/parts.py nor one of :data:`NOT_A_PART`."""
    found = []
    for path in sorted((root / "tests").rglob("*.py")):
        name = path.relative_to(root).as_posix()
        if name in {"tests/parts.py", "tests/unit/test_parts.py"}:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if SKIP.search(line) and not any(name == file and said in line for file, said in NOT_A_PART):
                found.append(f"{name}:{number}: {line.strip()}")
    return found


def test_every_skip_for_a_missing_part_goes_through_tests_parts():
    found = skips_outside_parts()
    assert not found, "skips that bypass tests/parts.py (use parts.unavailable or a helper there):\n" + "\n".join(found)


def test_the_skip_check_spots_a_skip_of_a_test_s_own(tmp_path):
    (tmp_path / "tests" / "unit").mkdir(parents=True)
    (tmp_path / "tests" / "unit" / "test_x.py").write_text(
        'import pytest\n\n\ndef test_x():\n    pytest.skip("etcd is not installed")\n')
    (tmp_path / "tests" / "parts.py").write_text('pytest.skip("the one place")\n')
    assert skips_outside_parts(tmp_path) == ['tests/unit/test_x.py:5: pytest.skip("etcd is not installed")']


def test_a_module_that_cannot_be_imported_skips_outside_ci(monkeypatch):
    monkeypatch.setattr(parts, "ON_CI", False)
    assert parts.module("json").dumps([]) == "[]"
    with pytest.raises(pytest.skip.Exception, match="no_such_framework cannot be imported"):
        parts.module("no_such_framework")


def test_a_module_that_cannot_be_imported_fails_on_ci(monkeypatch):
    monkeypatch.setattr(parts, "ON_CI", True)
    with pytest.raises(pytest.fail.Exception, match="CI installs every part"):
        parts.module("no_such_framework")
