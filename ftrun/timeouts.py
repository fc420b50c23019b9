"""Every timeout that bounds a fault, in one view, checked against each other (``ftrun timeouts``, and at start).

A fault is seen, waited for and given up on by a chain of bounds that different parts own: the agents'
heartbeat and node timeouts, the controller's online window and repair deadline, the worker library's
collective timeout, gloo's, NCCL's and HCCL's own. Set one without the others and the chain contradicts
itself: a collective that times out before the stall is said, a repair deadline shorter than the time a
lost node takes to count lost. :func:`timeout_chain` lists them (pure: a launch configuration and the
environment in); :func:`contradictions` says each contradiction in one line, with what to change, and
also checks the job's measured step and checkpoint save times when it has them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from ftrun.contract import COLLECTIVE_TIMEOUT
from ftrun.detection.links import LINK_POLL

#: the collectives' own timeouts when nothing sets them: torch's default for gloo groups a script makes
#: itself (30 min), for NCCL's (10 min); CANN's defaults for HCCL's connection and execution
GLOO_DEFAULT, NCCL_DEFAULT = 1800.0, 600.0
HCCL_CONNECT_DEFAULT, HCCL_EXEC_DEFAULT = 120.0, 1836.0
#: the stall bound (the controller's StallWatch): STALL_FACTOR x the STALL_PERCENTILE of the last STALL_SAMPLES
#: step times, at least STALL_FLOOR seconds (a job's first steps, or one that takes a second a step, has no
#: narrower bound)
STALL_FACTOR, STALL_PERCENTILE, STALL_SAMPLES, STALL_FLOOR = 4.0, 0.9, 50, 10.0
#: while a rank saves a checkpoint (its heartbeat says so), the stall bound is SAVE_FACTOR x the longest save the
#: job measured, never under the step's; FIRST_SAVE seconds before any save was measured (a checkpoint of a large
#: model to shared storage takes tens of seconds, and the first one has nothing to go by)
SAVE_FACTOR, FIRST_SAVE = 2.0, 60.0


@dataclass(frozen=True)
class Bound:
    """One timeout: its name as the user sets it, its value, what it bounds, and where the value came from."""

    name: str
    seconds: float
    bounds: str
    #: a launch flag's (its value given or its default), ftrun's own, torch's default, or the variable that set it
    source: str = "launch flag"


def _env_seconds(env: Mapping[str, str], name: str, default: float) -> tuple[float, str]:
    text = env.get(name, "").strip()
    try:
        return (float(text), name) if text else (default, "CANN's default")
    except ValueError:
        return default, f"default ({name}={text!r} is no number)"


def timeout_chain(config, env: Mapping[str, str]) -> list[Bound]:
    """The bounds of a job launched with ``config`` (a ``LaunchConfig``) in environment ``env``, the fastest
    first as a fault meets them."""
    bounds = [
        Bound("data link seen dark", LINK_POLL, "a dark port on a node is seen (the OS's link state)", "ftrun"),
        Bound("--online-window", config.online_window, "a dark data link waits this long, with a spare, before "
                                                       "its node's ranks move there"),
        Bound("stall bound (at least)", STALL_FLOOR, "no step committed while every rank beats: said as a stall "
                                                    f"({STALL_FACTOR:g} x p90 of the job's step times, at least this)",
              "ftrun"),
        Bound("stall bound while saving", FIRST_SAVE, "a rank saving a checkpoint, before any save was measured "
                                                     f"(then {SAVE_FACTOR:g} x the longest save, at least the stall "
                                                     "bound)", "ftrun"),
        Bound("--heartbeat-timeout", config.heartbeat_timeout, "a rank's heartbeat stopped: hung, killed, replaced"),
        Bound("--node-timeout", config.node_timeout, "an agent's keepalive stopped: its node lost"),
        Bound("--repair-timeout", config.repair_timeout, "a process-level repair before job level (or a wait for a "
                                                         "dark link with no spare before the job ends)"),
        Bound("--stop-timeout", config.stop_timeout, "SIGTERM to SIGKILL when workers are stopped"),
        Bound("--store-timeout", config.store_timeout, "the control store away before ranks and the job give up"),
        Bound("--rdzv-timeout", config.rdzv_timeout, "the nodes gathering at the start"),
        Bound("collective_timeout (ftrun.elastic.init)", COLLECTIVE_TIMEOUT,
              "a group forming, and a gloo collective, under ftrun.elastic", "ftrun"),
    ]
    device = getattr(config, "device", "auto")
    if device in ("auto", "cpu"):
        bounds.append(Bound("gloo (torch's default)", GLOO_DEFAULT, "a collective of a gloo group a script "
                                                                  "makes itself", "torch"))
    if device in ("auto", "cuda"):
        bounds.append(Bound("NCCL (torch's default)", NCCL_DEFAULT, "an NCCL collective before the watchdog "
                                                                  "ends the process", "torch"))
    if device == "npu" or any(name in env for name in ("HCCL_CONNECT_TIMEOUT", "HCCL_EXEC_TIMEOUT")):
        seconds, source = _env_seconds(env, "HCCL_CONNECT_TIMEOUT", HCCL_CONNECT_DEFAULT)
        bounds.append(Bound("HCCL_CONNECT_TIMEOUT", seconds, "HCCL's links forming (each group, each repair)", source))
        seconds, source = _env_seconds(env, "HCCL_EXEC_TIMEOUT", HCCL_EXEC_DEFAULT)
        bounds.append(Bound("HCCL_EXEC_TIMEOUT", seconds, "an HCCL collective waiting for a peer", source))
    return bounds


def _named(bounds: list[Bound], name: str) -> Bound | None:
    return next((b for b in bounds if b.name == name), None)


def _collectives(bounds: list[Bound]) -> list[Bound]:
    """The collective timeouts: how long a rank waits in a collective for a peer."""
    return [b for b in bounds if b.name.startswith(("gloo", "NCCL", "HCCL_EXEC", "collective_timeout"))]


def save_contradictions(bounds: list[Bound], save_time: float | None) -> dict[str, str]:
    """Each collective timeout not longer than a checkpoint save of ``save_time`` seconds (the ranks that wait
    for the saving one meanwhile time out), by the bound's name, in one line with what to change."""
    return {c.name: f"{c.name} {c.seconds:g}s is shorter than a checkpoint save ({save_time:g}s measured): the "
                    f"ranks waiting for the saving one time out; raise it above {save_time:g}s"
            for c in _collectives(bounds) if save_time and c.seconds <= save_time}


def contradictions(bounds: list[Bound], step_time: float | None = None, save_time: float | None = None) -> list[str]:
    """Each contradiction in the chain, in one line with what to change. ``step_time`` and ``save_time``: the
    job's measured step time (a high percentile) and longest checkpoint save, when known."""
    found = []
    window, repair = _named(bounds, "--online-window"), _named(bounds, "--repair-timeout")
    node, stop = _named(bounds, "--node-timeout"), _named(bounds, "--stop-timeout")
    if window and repair and window.seconds >= repair.seconds:
        found.append(f"--online-window {window.seconds:g} is not shorter than --repair-timeout {repair.seconds:g}: a "
                     f"dark link's node would never move to a spare before job level; lower --online-window")
    if node and repair and node.seconds >= repair.seconds:
        found.append(f"--node-timeout {node.seconds:g} is not shorter than --repair-timeout {repair.seconds:g}: a "
                     f"repair that waits for a node lost meanwhile falls back to job level before the node counts "
                     f"lost; raise --repair-timeout above {node.seconds:g}")
    if stop and repair and stop.seconds >= repair.seconds:
        found.append(f"--stop-timeout {stop.seconds:g} is not shorter than --repair-timeout {repair.seconds:g}: a "
                     f"repair's stop may outlast its deadline; lower --stop-timeout")
    stall = max(STALL_FLOOR, STALL_FACTOR * step_time) if step_time else STALL_FLOOR
    for collective in _collectives(bounds):
        if collective.seconds <= stall:
            found.append(f"{collective.name} {collective.seconds:g}s is not longer than the stall bound "
                         f"{stall:g}s: a collective times out before the stall is said and the job repaired; "
                         f"raise it above {stall:g}s")
    return found + list(save_contradictions(bounds, save_time).values())


def table(bounds: list[Bound]) -> list[str]:
    """The chain as lines of text, one bound a line."""
    width = max(len(b.name) for b in bounds)
    return [f"{b.name:<{width}}  {b.seconds:>8g}s  {b.source:<22}  {b.bounds}" for b in bounds]
