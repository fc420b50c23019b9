"""The ``ftrun`` command line."""

from __future__ import annotations

import dataclasses
import logging
import os
import select
import socket
import sys
import time
from typing import TYPE_CHECKING

import click

from ftrun.cli.console import ConsoleLogHandler, abort, say
from ftrun.cli.launch import GroupedCommand, accepted_only_notes, launch_options, merge_config, naming_variables, set_by_variables
from ftrun.errors import ExitCode, FtrunError

if TYPE_CHECKING:  # the launch's modules load only when a job runs
    from ftrun.agent.agent import JobOutcome
    from ftrun.head.sessions import HeadOutcome

HELP = """Launch a distributed PyTorch job that survives faults: a drop-in for torchrun.

\b
  ftrun --standalone --nproc-per-node 4 train.py --lr 3e-4
  ftrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint head:29400 --max-restarts 3 train.py
  ftrun --hostfile hosts.txt --recovery process train.py      # from a head node: one agent per host over ssh
  srun --ntasks-per-node=1 ftrun --nproc-per-node 8 train.py  # in a Slurm allocation
  ftrun probe          # this node's devices and their health (ftrun probe --help)
  ftrun status --rdzv-endpoint head:29400 --watch   # a running job's nodes, ranks and repairs
  ftrun top --rdzv-endpoint head:29400     # the same, interactive: a rank's output and stack, drills
  ftrun report logs/RUN_ID/events.jsonl --html job.html   # a finished job's summary and timeline
  ftrun timeouts --nnodes 2 --repair-timeout 30 train.py   # every timeout that bounds a fault, checked
"""


@click.command(cls=GroupedCommand, help=HELP, context_settings={"allow_interspersed_args": False, "max_content_width": 110})
@launch_options
@click.pass_context
def launch_command(ctx: click.Context, **params):
    return merge_config(ctx, params)


def _subcommands() -> dict[str, click.Command]:
    """Words that name a command rather than a script (run a script named so as ./probe)."""
    from ftrun.cli.probe import probe_command
    from ftrun.cli.status import report_command, status_command
    from ftrun.cli.timeouts import timeouts_command
    from ftrun.cli.top import top_command

    return {"probe": probe_command, "doctor": probe_command, "status": status_command, "report": report_command,
            "top": top_command, "timeouts": timeouts_command}


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    _quiet_torch_cpp_logs()
    _setup_logging()
    subcommands = _subcommands()
    command: click.Command = launch_command
    prog = "ftrun"
    if argv and argv[0] in subcommands:
        command, prog = subcommands[argv[0]], f"ftrun {argv[0]}"
        argv = argv[1:]
    try:
        values = command.main(argv, prog_name=prog, standalone_mode=False)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.exceptions.Abort:
        abort("interrupted", ExitCode.INTERRUPTED)
    except click.BadParameter as e:
        flag = next((o for o in e.param.opts if o.startswith("--")), "") if e.param else ""
        variable = set_by_variables(e.ctx).get(flag) if e.ctx else None
        if variable:  # PET_MAX_RESTARTS=abc: name the variable, not a flag the user never typed
            e.param_hint = f"'{variable}'"
        abort(e.format_message().replace("\n", " "), ExitCode.USAGE)
    except click.ClickException as e:
        abort(e.format_message().replace("\n", " "), ExitCode.USAGE)
    except FtrunError as e:
        abort(e.message, e.exit_code)
    if isinstance(values, int):  # --help / --version under standalone_mode=False, or a subcommand's code
        sys.exit(values)
    sys.exit(run_launch(values, argv))


def run_launch(values: dict, argv: list[str] | None = None) -> int:
    """The job (or this node's part of it), from the launch's ``values``; ``argv``, the words they came from
    (what a host's session keeper starts its detached agent with)."""
    from ftrun.agent.agent import Agent
    from ftrun.cli import cluster, msrun
    from ftrun.config import build_launch_config

    for note in accepted_only_notes(values):
        say(f"ftrun: {note}")
    variables = values.get("variables", {})  # an error about a value a PET_* variable gave names it
    try:
        values, notes = msrun.translate(values)
        for note in notes:
            say(f"ftrun: {note}")
        values = cluster.apply_slurm(values)
        if values.get("print_hosts"):
            return cluster.print_hosts(values)
        if values.get("dry_run"):
            return cluster.dry_run(values, launch_command)
        outcome: JobOutcome | HeadOutcome
        if values.get("hostfile"):
            msrun.refuse_head_node(values)
            outcome = cluster.run_cluster(values, launch_command)
            if outcome.following:  # etcd: the job runs on without this head's sessions (or never had them)
                return cluster.follow_run(outcome)
        else:
            config = build_launch_config(values)
            if config.head_managed:
                config = dataclasses.replace(config, token=read_session_token())
                if config.etcd is not None and values.get("ssh_agent"):
                    return keep_agent_session(config, argv if argv is not None else sys.argv[1:])
            for note in msrun.framework_notes(values, config):
                say(f"ftrun: {note}")
            for line in timeout_contradictions(config):
                say(f"ftrun: timeouts contradict: {line}", style="bold yellow")
            if values.get("slurm"):
                say(f"ftrun: {values['slurm'].describe()[0]}")
            agent = Agent(config)
            agent.install_signal_handlers()
            if values.get("ssh_agent"):  # not a detached one (etcd): it outlives its session
                agent.watch_session()
            outcome = agent.run()
    except FtrunError as e:
        abort(naming_variables(e.message, variables), e.exit_code)
    except KeyboardInterrupt:
        abort("interrupted", ExitCode.INTERRUPTED)
    return report_outcome(outcome.exit_code, outcome.reason, outcome.controller)


def timeout_contradictions(config) -> list[str]:
    """The launch's timeouts that contradict each other (``ftrun timeouts`` shows the whole chain)."""
    from ftrun.timeouts import contradictions, timeout_chain

    return contradictions(timeout_chain(config, os.environ))


#: what FTRUN_LOG_LEVEL may say
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
#: how long an agent started over ssh waits for the head node's first line (the job's token)
SESSION_TOKEN_DEADLINE = 30.0


def read_session_token() -> bytes:
    """The job's secret, the first line the head node writes to this agent's ssh session. Read from
    the bare descriptor, a byte at a time, so that nothing after it is taken from the session watch."""
    fd = sys.stdin.fileno()
    line = b""
    deadline = time.monotonic() + SESSION_TOKEN_DEADLINE
    while not line.endswith(b"\n"):
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(fd, 1) if ready else b""
        if not chunk:
            raise FtrunError("the head node's session sent no token (started by hand with --ssh-agent?)",
                             ExitCode.RENDEZVOUS)
        line += chunk
    return line.strip()


def keep_agent_session(config, argv: list[str]) -> int:
    """A host's ssh session under --rdzv-backend etcd: its agent detached, followed while the head is there
    (``ftrun.head.session_keeper``)."""
    from ftrun.head.session_keeper import detached_argv, keep_session, log_paths

    paths = log_paths(config.log_dir, config.run_id, config.log_layout, config.local_addr or socket.gethostname())
    return keep_session(detached_argv(argv), config.token, paths)


def report_outcome(exit_code: int, reason: str, controller) -> int:
    """The job summary where the controller ran; elsewhere one line when this node stopped on an error."""
    from ftrun.summary import job_summary

    if controller is not None and controller.view is not None:
        style = "green" if controller.view.exit_code == ExitCode.OK else "bold red"
        for line in job_summary(controller.events.events):
            say(f"ftrun: {line}", style=style)
        return exit_code
    if exit_code != ExitCode.OK:
        say(f"ftrun: job stopped (exit code {exit_code}): {reason}", style="bold red")
    return exit_code


def _quiet_torch_cpp_logs() -> None:
    # torch's C++ side prints stack traces for every store retry; the agent reports in one line.
    # Workers get the user's own setting back (ftrun.agent.workers.worker_env).
    if "TORCH_CPP_LOG_LEVEL" in os.environ:
        os.environ.setdefault("FTRUN_SAVED_TORCH_CPP_LOG_LEVEL", os.environ["TORCH_CPP_LOG_LEVEL"])
    os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"


def _setup_logging() -> None:
    root = logging.getLogger("ftrun")
    if not any(isinstance(h, ConsoleLogHandler) for h in root.handlers):
        root.addHandler(ConsoleLogHandler())
    level = os.environ.get("FTRUN_LOG_LEVEL", "INFO").strip().upper()
    if level not in LOG_LEVELS:
        root.setLevel("INFO")
        abort(f"FTRUN_LOG_LEVEL must be one of {', '.join(LOG_LEVELS)}, got '{level}'", ExitCode.USAGE)
    root.setLevel(level)
    root.propagate = False
