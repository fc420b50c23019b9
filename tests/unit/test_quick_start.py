"""README.md's quick start, command by command, through the real command line: each launch with --dry-run
(the flags checked, the configuration built, the commands it would run printed, nothing started), each
``ftrun status`` parsed, each other word a file that is there. A flag renamed or a check made stricter
breaks this test rather than the first thing a new user types."""

from __future__ import annotations

import os
import re
import shlex
import stat
from pathlib import Path

import pytest

from ftrun.cli import _subcommands, main
from tests.conftest import ROOT

README = (ROOT / "README.md").read_text()
#: inside a Slurm allocation, as srun starts each task (tests/unit/test_slurm.py has the variables)
SLURM = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_JOB_NODELIST": "gpu[01-02]",
         "SLURM_STEP_NODELIST": "gpu[01-02]", "SLURM_NNODES": "2", "SLURM_NODEID": "0",
         "SLURM_TASKS_PER_NODE": "1(x2)"}


def quick_start(text: str) -> list[list[str]]:
    """The commands of the first ``sh`` block under ``## Quick start``, as a shell splits them (comments
    and line continuations gone)."""
    section = text.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"^```sh\n(.*?)^```", section, re.M | re.S)
    assert block, "README.md's quick start has no sh block"
    lines = block.group(1).replace("\\\n", " ").splitlines()
    return [words for words in (shlex.split(line, comments=True) for line in lines) if words]


COMMANDS = quick_start(README)


@pytest.fixture
def user_folder(tmp_path, monkeypatch):
    """A folder as the quick start assumes one: the repository's scripts/, the user's train.py, a program
    run.sh, a module mypkg.train and a hostfile; no Slurm and no PET_* variables unless a command sets them."""
    (tmp_path / "scripts").symlink_to(ROOT / "scripts")
    (tmp_path / "train.py").write_text("")
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "train.py").write_text("")
    run = tmp_path / "run.sh"
    run.write_text("#!/bin/sh\n")
    run.chmod(run.stat().st_mode | stat.S_IXUSR)
    (tmp_path / "hosts.txt").write_text("127.0.0.2 slots=8\n127.0.0.3 slots=8\n")  # no name to resolve
    for name in list(os.environ):
        if name.startswith(("SLURM_", "PET_", "TORCHELASTIC_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", os.environ.get("TORCH_CPP_LOG_LEVEL", "WARNING"))  # main() sets it
    monkeypatch.chdir(tmp_path)
    return tmp_path


def dry_run(argv: list[str], capsys) -> tuple[int, str]:
    """``ftrun --dry-run ARGV`` in this process: its exit code and output."""
    with pytest.raises(SystemExit) as ended:
        main(["--dry-run", *argv])
    captured = capsys.readouterr()
    return ended.value.code, captured.out + captured.err


def test_the_quick_start_has_its_commands():
    firsts = [words[0] for words in COMMANDS]
    assert firsts[:2] == ["bash", ".venv/bin/ftrun"] and len(COMMANDS) >= 8, firsts


@pytest.mark.parametrize("words", COMMANDS, ids=[" ".join(words)[:60] for words in COMMANDS])
def test_a_quick_start_command_runs_as_written(words, user_folder, capsys, monkeypatch):
    if words[0] == "bash":
        assert (ROOT / words[1]).is_file(), f"{words[1]} is not in the repository"
        return
    if words[0] == "srun":  # each task runs the ftrun command that follows srun's own flags
        words = words[words.index("ftrun"):]
        for name, value in SLURM.items():
            monkeypatch.setenv(name, value)
    assert Path(words[0]).name == "ftrun", f"the quick start's '{shlex.join(words)}' is not an ftrun command"
    subcommands = _subcommands()
    if words[1] in subcommands:  # reads a running job: its flags parsed and checked, nothing reached
        subcommands[words[1]].make_context(f"ftrun {words[1]}", words[2:])
        return
    code, output = dry_run(words[1:], capsys)
    assert code == 0, output
    script = next(word for word in words[1:] if word.endswith((".py", ".sh")) or word == "mypkg.train")
    assert script in output, output  # the command it would run, per rank or per host
