"""The documentation keeps up with the code. The man page: every visible flag, config key, exit code and
worker variable of ``ftrun`` is documented there, and every example config loads and explains its keys.
README.md and docs/: the README starts with the two commands and stays short, every link resolves, every
flag, exit code and worker variable has its place in docs/, and no file tells session-by-session history."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
from pathlib import Path

import click
import pytest
import yaml

from ftrun import mindspore
from ftrun.agent.workers import GenerationEnv, WorkerPlacement, torch_npu_recovery_variables, worker_env
from ftrun.cli import _subcommands, launch_command
from ftrun.cli.cluster import ClusterPlan
from ftrun.cli.launch import ALIASES, NOT_IN_CONFIG
from ftrun.config import RDZV_BACKENDS, RECOVERY_LEVELS, STATUS_MODES, build_launch_config
from ftrun.contract import DeviceAssignment, SnapshotSettings, WorkerEnv
from ftrun.detection.table import load_fault_table
from ftrun.devices import DEVICE_KINDS
from ftrun.devices.cuda import CudaBackend
from ftrun.devices.npu import NpuBackend
from ftrun.errors import ExitCode, UsageError
from tests.conftest import ROOT

MAN_PAGE = (ROOT / "man" / "ftrun.1").read_text()
OPTIONS = [p for p in launch_command.params if isinstance(p, click.Option) and not p.hidden and p.name != "version"]
#: the keys a config file may hold: every value the launch command passes on (flags and the script's
#: arguments), as merge_config checks them
SUBCOMMANDS = sorted(_subcommands().items())
CONFIG_KEYS = sorted({p.name for p in launch_command.params if p.expose_value} - NOT_IN_CONFIG)
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
#: configs/ holds launch configs, and the fault-level table
FAULT_TABLE = ROOT / "configs" / "fault_levels.yaml"
#: sections that man-pages(7) orders so; the page's own topics (RECOVERY, LOGS, ...) sit in between
STANDARD_SECTIONS = ("NAME", "SYNOPSIS", "DESCRIPTION", "OPTIONS", "COMMANDS", "CONFIGURATION FILE", "ENVIRONMENT",
                     "EXIT STATUS", "FILES", "EXAMPLES", "SEE ALSO")


def section(title: str) -> str:
    """The man page's text from ``.SH title`` to the next ``.SH``."""
    match = re.search(rf'^\.SH "?{re.escape(title)}"?\n(.*?)(?=^\.SH |\Z)', MAN_PAGE, re.M | re.S)
    assert match, f"man/ftrun.1 has no {title} section"
    return match.group(1)


def mentions(text: str, name: str) -> bool:
    """``name`` (a variable or key) appears in the groff source ``text`` as a whole word."""
    return re.search(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])", text) is not None


def man_spelling(flag: str) -> str:
    """A regex for ``--flag-name`` as groff source spells it, and not as the start of a longer flag."""
    return re.escape(flag.replace("-", "\\-")) + r"(?!\\-|\w)"


@pytest.mark.parametrize("option", OPTIONS, ids=[o.name for o in OPTIONS])
def test_every_flag_has_an_entry_in_the_man_page(option):
    long_name = next(o for o in option.opts if o.startswith("--") and "_" not in o)
    assert re.search(man_spelling(long_name), MAN_PAGE), f"{long_name} is missing from man/ftrun.1"


@pytest.mark.parametrize("flag, choices", [("--recovery", RECOVERY_LEVELS), ("--rdzv-backend", RDZV_BACKENDS),
                                           ("--device", DEVICE_KINDS), ("--status", STATUS_MODES)])
def test_an_option_s_entry_lists_exactly_its_choices(flag, choices):
    tag = re.search(rf"^\\fB{man_spelling(flag)}\\fR (.*)$", section("OPTIONS"), re.M)
    assert tag, f"{flag} has no entry in OPTIONS"
    assert set(re.findall(r"\\fB(\w+)\\fR", tag.group(1))) == set(choices)


@pytest.mark.parametrize("name, command", SUBCOMMANDS, ids=[name for name, _ in SUBCOMMANDS])
def test_every_command_and_its_options_are_in_the_commands_section(name, command):
    text = section("COMMANDS")
    assert f"\\fBftrun {name}" in text and f"ftrun {name}" in section("SYNOPSIS")
    for param in command.params:
        if isinstance(param, click.Option) and not param.hidden:
            flag = next(o for o in param.opts if o.startswith("--") and "_" not in o)
            assert re.search(man_spelling(flag), text), f"ftrun {name} {flag} is missing from COMMANDS"


def test_the_standard_sections_come_in_the_usual_order():
    titles = [t.strip('"') for t in re.findall(r"^\.SH (.+)$", MAN_PAGE, re.M)]
    assert [t for t in titles if t in STANDARD_SECTIONS] == list(STANDARD_SECTIONS)


# -- config keys ---------------------------------------------------------------------------------------


def test_the_config_loader_accepts_exactly_these_keys(tmp_path):
    every_key = tmp_path / "every.yaml"
    every_key.write_text(yaml.safe_dump({key: "x" for key in CONFIG_KEYS}))
    values = launch_command.main(["--config", str(every_key)], prog_name="ftrun", standalone_mode=False)
    assert {ALIASES.get(key, key) for key in CONFIG_KEYS} <= values["given"]  # an alias sets its option
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("config: other.yaml\n")  # a real flag, but not one a file may set
    with pytest.raises(UsageError, match="unknown key 'config'"):
        launch_command.main(["--config", str(unknown)], prog_name="ftrun", standalone_mode=False)


@pytest.mark.parametrize("key", CONFIG_KEYS)
def test_every_config_key_is_listed_in_the_configuration_file_section(key):
    assert re.search(rf"\\fB{key}\\fR", section("CONFIGURATION FILE")), (
        f"config key '{key}' is missing from CONFIGURATION FILE in man/ftrun.1")


# -- exit codes ----------------------------------------------------------------------------------------


def documented_exit_codes() -> set[int]:
    return {int(code) for code in re.findall(r"^\.B (\d+)$", section("EXIT STATUS"), re.M)}


@pytest.mark.parametrize("code", list(ExitCode), ids=[c.name for c in ExitCode])
def test_every_exit_code_is_in_the_exit_status_section(code):
    assert int(code) in documented_exit_codes(), f"exit code {int(code)} ({code.name}) is not in EXIT STATUS"


def test_the_exit_status_section_lists_no_code_ftrun_does_not_use():
    assert documented_exit_codes() <= {int(c) for c in ExitCode}


# -- worker environment --------------------------------------------------------------------------------


def variables_set_for_workers(tmp_path: Path, monkeypatch) -> set[str]:
    """Every variable ftrun sets for a worker: what worker_env adds to an empty environment (with and
    without a device, rank tables and snapshots), plus those the agent writes as ``("NAME", value)`` pairs."""
    for name in list(os.environ):
        monkeypatch.delenv(name)
    script = tmp_path / "train.py"
    script.write_text("")
    config = build_launch_config({"script": str(script), "nproc_per_node": "2", "rdzv_endpoint": "head:29400",
                                  "device": "cpu"})
    generation = GenerationEnv(generation=1, restart_count=1, world_size=4, node_count=2, master_addr="head",
                               master_port=29501, control_store="head:29400", max_restarts=3)
    names = set(worker_env(config, WorkerPlacement(1, 3, 1, "node1"), generation, str(tmp_path / "error.json")))
    # with a device, both rank tables and the snapshots
    placed = WorkerPlacement(1, 3, 1, "node1", DeviceAssignment(5, 1), (NpuBackend.visibility_var, "4,5"))
    whole = dataclasses.replace(generation, ranktable="ranktable.json", hccl_ranktable="hccl.json",
                                snapshots=SnapshotSettings("/dev/shm/x", 10, 0, 1))
    names |= set(worker_env(config, placed, whole, str(tmp_path / "error.json")))
    for source in sorted((ROOT / "ftrun" / "agent").glob("*.py")):
        names |= set(re.findall(r'\(\s*"([A-Z][A-Z0-9_]+)",', source.read_text()))
    names |= {CudaBackend.visibility_var, NpuBackend.visibility_var}
    # the worker's contract in full: with a device, snapshots and a rank table
    names |= set(WorkerEnv(rank=3, local_rank=1, world_size=4, run_id="job", generation=1, control_store="head:29400",
                           replacement=False, heartbeat_timeout=30, ranktable="ranktable.json",
                           device=DeviceAssignment(5, 2), snapshots=SnapshotSettings("/dev/shm/x", 10, 0, 1),
                           control_store_file="/tmp/x/control_store", relay_dir="/tmp/x/repair").to_environ())
    # a MindSpore job's workers and scheduler (msrun's contract)
    scheduler = mindspore.Scheduler("head", 31000)
    names |= set(mindspore.worker_variables(scheduler, 4, 600, 3, 1)) | set(mindspore.scheduler_variables(scheduler, 4, 600))
    names |= set(mindspore.recovery_variables())
    names |= set(torch_npu_recovery_variables({}))  # under --recovery process
    return names


def test_every_variable_set_for_workers_is_in_the_worker_environment_section(tmp_path, monkeypatch):
    names = variables_set_for_workers(tmp_path, monkeypatch)
    # both ways of finding them found something: worker_env's own, and the agent's device and rank tables
    assert {"RANK", "FTRUN_CONTROL_STORE", "FTRUN_DEVICE_INDEX", "FTRUN_RANKTABLE", "RANK_TABLE_FILE"} <= names
    text = section("WORKER ENVIRONMENT")
    missing = sorted(name for name in names if not mentions(text, name))
    assert not missing, f"set for workers but not in WORKER ENVIRONMENT: {', '.join(missing)}"


def test_every_ftrun_variable_in_the_man_page_exists_in_the_code():
    code = "\n".join(p.read_text() for p in (ROOT / "ftrun").rglob("*.py"))
    named = set(re.findall(r"FTRUN_[A-Z][A-Z0-9_]*[A-Z0-9]", MAN_PAGE))
    assert named, "the man page names no FTRUN_* variable"
    stale = sorted(name for name in named if not mentions(code, name))
    assert not stale, f"man/ftrun.1 names variables ftrun neither reads nor sets: {', '.join(stale)}"


# -- example configs -----------------------------------------------------------------------------------


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_example_config_loads(path, tmp_path, monkeypatch):
    if path == FAULT_TABLE:
        assert load_fault_table(str(path)).files[-1] == str(path)
        return
    monkeypatch.chdir(ROOT)  # paths in the files are relative to the repository, as their usage lines run them
    script = tmp_path / "train.py"
    script.write_text("")
    values = launch_command.main(["--config", str(path), str(script)], prog_name="ftrun", standalone_mode=False)
    config = build_launch_config(values)
    assert config.nproc_per_node >= 1
    if values.get("hostfile"):
        for name in values.get("env") or ():
            if "=" not in name:  # a variable the file takes from the head node's shell
                monkeypatch.setenv(name, "set-for-the-test")
        assert ClusterPlan.from_values({**values, "rdzv_host": "head"}, launch_command).agents


#: a top-level key, in use or commented out (``# key: value``)
KEY_LINE = re.compile(r"^(#\s*)?([a-z_]+):(\s|$)")


def unexplained_keys(lines: list[str], known: set[str]) -> list[str]:
    """Keys with no comment of their own: neither at the end of their line nor in the comment right
    above them (a run of keys may share one). A section header (``# --- logs ---``) explains nothing."""
    def is_key(line: str) -> bool:
        match = KEY_LINE.match(line)
        return bool(match) and (not match.group(1) or match.group(2) in known)

    def has_own_comment(line: str) -> bool:
        return re.search(r"\s#\s", line.lstrip("#").strip()) is not None

    bare = []
    for number, line in enumerate(lines):
        if not is_key(line) or has_own_comment(line):
            continue
        above = number - 1
        while above >= 0 and is_key(lines[above]) and not has_own_comment(lines[above]):
            above -= 1  # keys in a run share the comment above the first
        comment = lines[above] if above >= 0 else ""
        if not comment.startswith("#") or is_key(comment) or "---" in comment:
            bare.append(f"line {number + 1}: {KEY_LINE.match(line).group(2)}")
    return bare


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_key_in_an_example_config_is_explained(path):
    bare = unexplained_keys(path.read_text().splitlines(), set(CONFIG_KEYS))
    assert not bare, f"{path.name}: keys without a comment: {'; '.join(bare)}"


def test_the_key_check_spots_a_bare_key():
    lines = ["# --- logs ---", "log_dir: logs", "", "# the budget", "max_restarts: 3", "recovery: job  # level",
             "tee: 3", "# the Python and folder on the hosts", "# remote_python: /usr/bin/python3",
             "# remote_cwd: /shared", "", "# remote_python: /opt/python"]
    assert unexplained_keys(lines, set(CONFIG_KEYS)) == ["line 2: log_dir", "line 7: tee", "line 12: remote_python"]


@pytest.mark.parametrize("path", sorted((ROOT / "configs").iterdir()), ids=lambda p: p.name)
def test_the_man_page_names_every_example_file(path):
    assert path.name.replace("-", "\\-") in section("FILES"), f"configs/{path.name} is not named in FILES"


@pytest.mark.skipif(not shutil.which("groff"), reason="groff is not installed")
def test_the_man_page_renders_without_warnings():
    result = subprocess.run(["groff", "-man", "-Tutf8", "-ww", "-z", str(ROOT / "man" / "ftrun.1")],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and not result.stderr, result.stderr


# -- README.md and docs/ -------------------------------------------------------------------------------

README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"
DOC_FILES = sorted(DOCS.glob("*.md"))
#: the README's first lines: the two commands that do everything on a fresh machine
TWO_COMMANDS = [
    "# ftrun",
    "",
    "```sh",
    "bash scripts/demo.sh   # sets up .venv, runs a 2-node x 2-rank CPU job under ftrun with the live status view, "
    "kills a rank, shows the recovery",
    "bash scripts/test.sh   # sets up .venv, lints (ruff) and type-checks (mypy) ftrun/, runs the whole test suite in "
    "two processes (what CI runs: .ci/run); arguments go to pytest",
    "```",
]
README_MAX_LINES = 300
#: what a file says when it tells how a figure or the code moved from one session to the next; history
#: belongs in commit messages
SESSION_HISTORY = re.compile(r"\b(this|last|previous|earlier|next) session\b|\bsessions? (before|ago)\b", re.I)
#: a Markdown link's target: [text](target)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def headings(text: str) -> set[str]:
    """The anchors GitHub makes for a Markdown text's headings (code blocks left out)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return {slug(title) for title in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def slug(title: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def broken_links(path: Path) -> list[str]:
    """Relative links in ``path`` to a file that does not exist, or to an anchor its file lacks."""
    text = path.read_text()
    broken = []
    for target in LINK.findall(re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        name, _, anchor = target.partition("#")
        linked = (path.parent / name).resolve() if name else path
        if not linked.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in headings(linked.read_text()):
            broken.append(f"{target} (no such heading)")
    return broken


def test_the_readme_starts_with_the_two_commands():
    assert README.splitlines()[:len(TWO_COMMANDS)] == TWO_COMMANDS


def test_ci_runs_the_readme_s_test_command():
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


def test_the_readme_is_at_most_300_lines():
    lines = len(README.splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move reference text to docs/"


def test_the_readme_links_every_docs_file_and_the_man_page():
    linked = {name for name in LINK.findall(README)}
    missing = [f"docs/{p.name}" for p in DOC_FILES if not any(t.split("#")[0] == f"docs/{p.name}" for t in linked)]
    assert not missing, f"README.md does not link {', '.join(missing)}"
    assert "man/ftrun.1" in linked


@pytest.mark.parametrize("path", [ROOT / "README.md", *DOC_FILES], ids=lambda p: p.name)
def test_every_relative_link_resolves(path):
    broken = broken_links(path)
    assert not broken, f"{path.name}: {'; '.join(broken)}"


def test_the_link_check_spots_a_missing_file_and_a_missing_heading(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## A section: `x`\n\n[ok](#a-section-x) [gone](nothing.md) [no](#elsewhere) "
                    "[web](https://example.com)\n```\n[in code](nowhere.md)\n```\n")
    assert broken_links(page) == ["nothing.md (no such file)", "#elsewhere (no such heading)"]


@pytest.mark.parametrize("path", [ROOT / "README.md", *DOC_FILES], ids=lambda p: p.name)
def test_no_file_tells_session_history(path):
    found = [line.strip() for line in path.read_text().splitlines() if SESSION_HISTORY.search(line)]
    assert not found, f"{path.name} tells history (it belongs in commit messages): {found}"


def test_the_history_check_spots_session_phrases():
    told = ["this session's table", "55 ms in the last session's", "14 runs in two sessions before"]
    assert all(SESSION_HISTORY.search(line) for line in told)
    assert not SESSION_HISTORY.search("an agent whose ssh session ends mid-job counts as a lost node")


def test_the_docs_are_the_files_the_readme_promises():
    names = {p.name for p in DOC_FILES}
    assert {"design.md", "worker-library.md", "parallelism.md", "snapshots.md", "detection.md", "scale.md",
            "benchmarks.md"} <= names


def test_the_design_has_the_sections_the_code_cites():
    design = (DOCS / "design.md").read_text()
    for title in ("The parts", "Generations", "Recovery levels", "The repair, step by step", "Fault sources",
                  "The worker environment", "Testing without accelerators"):
        assert slug(title) in headings(design), f"docs/design.md has no section '{title}'"
    code = "\n".join(p.read_text() for p in (ROOT / "ftrun").rglob("*.py"))
    for cited in re.findall(r'design\.md"?\s*"([^"]+)"', code, re.I):
        assert slug(cited) in headings(design), f"the code cites design.md \"{cited}\", which it lacks"


def test_the_gpu_figures_say_the_command_the_device_and_where_the_rest_is():
    readme = README.split("## Measured on a GPU", 1)[1].split("\n## ", 1)[0]
    assert "bash scripts/gpu_check.sh" in readme and "docs/benchmarks.md#measured-on-a-gpu" in readme
    assert "measured-on-a-gpu" in headings((DOCS / "benchmarks.md").read_text())
    gpu = (DOCS / "benchmarks.md").read_text().split("## Measured on a GPU", 1)[1]
    for fact in ("scripts/gpu_check.sh", "H100", "H200", "driver 580", "torch 2.11", "NCCL 2.28"):
        assert fact in gpu, fact


def test_the_readme_names_the_single_point_of_failure():
    assert "single point of failure" in README


def test_the_man_page_points_at_every_docs_file():
    text = section("SEE ALSO")
    missing = [p.name for p in DOC_FILES if p.name.replace("-", "\\-") not in text]
    assert not missing, f"man/ftrun.1 SEE ALSO does not name docs/{', docs/'.join(missing)}"


CLI_DOC = (DOCS / "cli.md").read_text()


@pytest.mark.parametrize("option", OPTIONS, ids=[o.name for o in OPTIONS])
def test_every_flag_is_in_the_command_line_reference(option):
    long_name = next(o for o in option.opts if o.startswith("--") and "_" not in o)
    assert re.search(rf"{re.escape(long_name)}(?![\w-])", CLI_DOC), f"{long_name} is missing from docs/cli.md"


@pytest.mark.parametrize("name, command", SUBCOMMANDS, ids=[name for name, _ in SUBCOMMANDS])
def test_every_command_and_its_options_are_in_the_command_line_reference(name, command):
    assert f"ftrun {name}" in CLI_DOC
    for param in command.params:
        if isinstance(param, click.Option) and not param.hidden:
            flag = next(o for o in param.opts if o.startswith("--") and "_" not in o)
            assert re.search(rf"{re.escape(flag)}(?![\w-])", CLI_DOC), f"ftrun {name} {flag} is not in docs/cli.md"


@pytest.mark.parametrize("code", list(ExitCode), ids=[c.name for c in ExitCode])
def test_every_exit_code_is_in_the_command_line_reference(code):
    assert re.search(rf"^\| {int(code)} \|", CLI_DOC, re.M), f"exit code {int(code)} is not in docs/cli.md"


def test_every_variable_set_for_workers_is_in_the_worker_library_reference(tmp_path, monkeypatch):
    text = (DOCS / "worker-library.md").read_text()
    missing = sorted(name for name in variables_set_for_workers(tmp_path, monkeypatch) if not mentions(text, name))
    assert not missing, f"set for workers but not in docs/worker-library.md: {', '.join(missing)}"


def test_every_module_the_docs_name_exists():
    named = {path for doc in [ROOT / "README.md", *DOC_FILES] for path in re.findall(r"ftrun/[\w/]+\.py", doc.read_text())}
    missing = sorted(path for path in named if not (ROOT / path).is_file())
    assert named and not missing, f"the docs name modules that are not there: {', '.join(missing)}"


def design_module_rows() -> list[tuple[list[str], list[str]]]:
    """docs/design.md's module table: each row's backticked names, of its first cell and of the whole row."""
    text = (DOCS / "design.md").read_text()
    lines = text[text.index("| module | holds |"):].splitlines()[2:]
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break
        first = line.split("|")[1]
        rows.append((re.findall(r"`([^`]+)`", first), re.findall(r"`([^`]+)`", line)))
    return rows


def named_in_the_design(module: str, rows: list[tuple[list[str], list[str]]]) -> bool:
    """``module`` (ftrun/x/y.py) has its row: its path in a row's first cell, or its file name in a row
    whose first cell names its folder or a module beside it (`ftrun/elastic/backends.py`, `ddp.py`)."""
    folder, name = module.rsplit("/", 1)
    for first, names in rows:
        if module in first:
            return True
        beside = any(n.startswith(folder + "/") and n.count("/") == module.count("/") for n in first)
        if beside and (name in names or module in names):
            return True
    return False


def modules_the_design_must_name() -> list[str]:
    """Every module under ftrun/, read from the tree at test time; a package's __init__.py only where it
    defines something, and no __main__.py."""
    found = []
    for path in sorted((ROOT / "ftrun").rglob("*.py")):
        if path.name == "__main__.py":
            continue
        if path.name == "__init__.py" and not re.search(r"^(def|class) ", path.read_text(), re.M):
            continue
        found.append(path.relative_to(ROOT).as_posix())
    return found


def test_every_module_is_in_the_design_s_module_table():
    rows = design_module_rows()
    missing = [module for module in modules_the_design_must_name() if not named_in_the_design(module, rows)]
    assert not missing, f"docs/design.md's module table does not name: {', '.join(missing)}"


def test_the_module_table_check_spots_a_missing_module():
    rows = [(["ftrun/elastic/backends.py", "ddp.py"], ["ftrun/elastic/backends.py", "ddp.py"]), (["ftrun/cli/"], ["ftrun/cli/", "top.py"])]
    assert named_in_the_design("ftrun/elastic/ddp.py", rows) and named_in_the_design("ftrun/cli/top.py", rows)
    assert not named_in_the_design("ftrun/elastic/groups.py", rows)
    assert not named_in_the_design("ftrun/top.py", rows)  # a name in a folder's row is that folder's
