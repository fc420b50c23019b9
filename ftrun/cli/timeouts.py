"""``ftrun timeouts``: every timeout that bounds a fault, for the launch command line it is given."""

from __future__ import annotations

import os

import click

from ftrun.cli.console import say
from ftrun.errors import ExitCode

TIMEOUTS_HELP = """Show every timeout that bounds a fault for a launch, checked against each other.

\b
  ftrun timeouts --nnodes 2 --nproc-per-node 8 --recovery process --repair-timeout 30 train.py
  ftrun timeouts --save-time 400 --step-time 2.5 --nnodes 2 train.py

Give it the launch's own command line (with `timeouts` after `ftrun`): nothing is started. Each
contradiction is one line saying what to change; the launch says the same lines at its start (and
the controller once more against the job's measured step and save times). --step-time and
--save-time (before the script) check the chain against a job's own figures now.
Exits 0, 1 when the chain contradicts itself, 2 on bad input.
"""

#: a figure of the job's own: seconds, above 0
SECONDS = click.FloatRange(min=0, min_open=True)


@click.command(help=TIMEOUTS_HELP, context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False,
                                                    "max_content_width": 110})
@click.option("--step-time", "--step_time", type=SECONDS, default=None, metavar="SECONDS",
              help="The job's step time (a high percentile), which sets the stall bound.")
@click.option("--save-time", "--save_time", type=SECONDS, default=None, metavar="SECONDS",
              help="The job's longest checkpoint save: every collective timeout must outlast it.")
@click.argument("launch", nargs=-1, type=click.UNPROCESSED)
def timeouts_command(step_time: float | None, save_time: float | None, launch: tuple[str, ...]) -> int:
    from ftrun.cli import launch_command
    from ftrun.config import build_launch_config
    from ftrun.timeouts import contradictions, table, timeout_chain

    values = launch_command.main(list(launch), prog_name="ftrun timeouts", standalone_mode=False)
    if isinstance(values, int):  # --help
        return values
    bounds = timeout_chain(build_launch_config(values), os.environ)
    for line in table(bounds):
        say(line)
    found = contradictions(bounds, step_time=step_time, save_time=save_time)
    for line in found:
        say(f"ftrun: timeouts contradict: {line}", style="bold red")
    if not found:
        say("ftrun: no timeout contradicts another", style="green")
    return ExitCode.JOB_FAILED if found else ExitCode.OK
