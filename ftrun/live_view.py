"""Showing the job's status snapshot (``ftrun.controller.board``): the live view, plain lines, JSON.

The live view (``--status live``, or auto on a terminal, where ``ftrun.top_view.attached``'s interactive view
does not run: the input is not the terminal, or an install lost textual) is a rich ``Live`` redrawn a few
times a second on the controller's terminal; lines printed meanwhile (ftrun's own, and worker output, which
``ftrun.agent.output`` writes through ``sys.stdout``) scroll above it instead of tearing it. ``ftrun
status`` renders the same snapshot read from the store.
"""

from __future__ import annotations

import sys
import threading
from typing import Callable

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

#: redraws per second of the live view
REFRESH_PER_SECOND = 2
#: plain mode: a progress line this often (seconds)
PLAIN_EVERY = 30.0
#: below this width the node table drops its device column
NARROW = 90
#: characters of the job line's progress bar (when the script told the total)
BAR_WIDTH = 20
PHASE_TRACK = ("stopping", "env_clear", "repair", "rollback")
PHASE_STYLE = {"running": "bold green", "exiting": "bold", "done": "bold"}
HEALTH_STYLE = {"ok": "green", "resetting": "yellow", "preseparated": "yellow", "isolated": "bold red"}
#: the event kinds as the view names them
EVENT_LABEL = {"generation_started": "generation", "node_lost": "node lost", "repair_done": "repaired",
               "repair_failed": "repair failed", "job_finished": "finished", "job_started": "started"}
EVENT_STYLE = {"fault": "red", "node_lost": "red", "repair_failed": "bold red", "repair_done": "green",
               "decision": "yellow", "takeover": "cyan", "controller_moved": "cyan", "resized": "cyan", "job_finished": "bold",
               "operator": "magenta", "straggler": "magenta", "straggler_gain": "green"}


def render(snapshot: dict, width: int = 120, height: int = 40) -> RenderableType:
    """The whole view: the job line, one row per node, the ranks when they fit, the last events."""
    if not snapshot:
        return Text("ftrun: waiting for the nodes to gather (rendezvous)…", style="dim")
    parts: list[RenderableType] = [job_line(snapshot, width), *stall_lines(snapshot), *straggler_lines(snapshot)]
    if snapshot["phase"] in PHASE_TRACK:
        parts.append(phase_track(snapshot, width))
    parts.append(node_table(snapshot, width))
    events = snapshot.get("events") or []
    room = height - len(snapshot["nodes"]) - len(events) - 10
    if snapshot["ranks"] and len(snapshot["ranks"]) <= room:
        parts.append(rank_table(snapshot))
    if events:
        parts.append(event_lines(events, width))
    return Group(*parts)


def job_line(s: dict, width: int = 120) -> Text:
    """The most telling first, so that a narrow terminal cuts the least: where the job stands, its
    progress, its budget, then the rest."""
    phase = s["phase"]
    line = Text("ftrun ", style="bold")
    line.append(f"run {s['run_id']} · generation {s['generation']} · ")
    label = phase.replace("_", " ").upper()
    if phase == "running" and s.get("stall"):  # never "running" while nothing moves
        label = f"STALLED {s['stall']['for']:.0f}s: {s['stall']['reason']}"
    if phase in PHASE_TRACK:
        label = f"{s['level'].upper()}-LEVEL REPAIR: {phase.replace('_', ' ')} ({s['phase_for']:.1f}s)"
    line.append(label, style="bold red" if s.get("stall") and phase == "running" else PHASE_STYLE.get(phase, "bold yellow"))
    if s.get("exit_code") is not None:
        style = "bold green" if s["exit_code"] == 0 else "bold red"
        line.append(f" · exit code {s['exit_code']}", style=style)
    if s["step"] is not None and s.get("total_steps"):
        line.append(f" · step {s['step']}/{s['total_steps']} ")
        line.append_text(progress_bar(s["step"], s["total_steps"]))
        line.append(f" {s['steps_per_s']:.1f} steps/s")
        if s.get("eta_s") is not None:
            line.append(f" · ETA {_clock(s['eta_s'])}")
    elif s["step"] is not None:
        line.append(f" · step {s['step']} · {s['steps_per_s']:.1f} steps/s")
    elif s.get("output_step") is not None:  # a script without the worker library: the step its output says
        line.append(f" · step {s['output_step']} (from output) · {s['output_steps_per_s']:.1f} steps/s")
    line.append(_saved(s))
    if s.get("controller"):  # --rdzv-backend etcd: the controller may move
        moves = s["controller"]["moves"]
        line.append(f" · controller on {s['controller']['host']}" + (f" (moved {moves}x)" if moves else ""))
    left = s["max_restarts"] - s["restarts_used"]
    line.append(f" · budget {left}/{s['max_restarts']} left · up {_clock(s['elapsed'])}")
    line.append(f" · {s['recovery']}-level recovery")
    line.truncate(width, overflow="ellipsis")
    return line


def stall_lines(s: dict) -> list[Text]:
    """While the job stands still (or a data link is dark): which ranks wait in which collective, one line."""
    stall = s.get("stall") or {}
    if s.get("phase") != "running" or not stall.get("ranks"):
        return []
    return [Text(f"  waiting: {stall['ranks']}", style="bold red", overflow="ellipsis", no_wrap=True)]


def straggler_lines(s: dict) -> list[Text]:
    """One line per rank named a straggler (none when there is none)."""
    return [Text(f"  straggler: {line}", style="bold magenta", overflow="ellipsis", no_wrap=True)
            for line in s.get("stragglers") or ()]


def progress_bar(done: int, total: int, width: int = BAR_WIDTH) -> Text:
    """A bar drawn as rich's progress bar column draws one: the done part green, the rest dim."""
    filled = min(width, max(0, round(width * done / total)))
    bar = Text("━" * filled, style="green")
    bar.append("━" * (width - filled), style="grey23")
    return bar


def phase_track(s: dict, width: int = 120) -> Text:
    """stopping ▸ env clear ▸ repair ▸ rollback, the current phase highlighted."""
    text = Text("  ")
    current = PHASE_TRACK.index(s["phase"])
    for index, phase in enumerate(PHASE_TRACK):
        style = "bold reverse yellow" if index == current else ("green" if index < current else "dim")
        text.append(f" {phase.replace('_', ' ')} ", style=style)
        if index < len(PHASE_TRACK) - 1:
            text.append(" ▸ ", style="dim")
    if s["reason"]:
        text.append(f"  {s['reason']}", style="yellow")
    text.truncate(width, overflow="ellipsis")
    return text


def node_table(s: dict, width: int) -> Table:
    table = Table(box=None, pad_edge=False, header_style="bold", expand=False)
    columns = ["node", "host", "role", "state", "ranks", "warm"] + (["devices"] if width >= NARROW else [])
    for name in columns:
        table.add_column(name, overflow="fold")
    for node in s["nodes"]:
        state_style = "red" if node["state"] in ("lost", "vacant") else "yellow" if node["state"] != "running" else ""
        ranks = f"{node['ranks_alive']}/{node['ranks_total']}" if node["role"] == "active" else "-"
        short = node["state"] in ("running", "repairing", "waiting") and node["ranks_alive"] < node["ranks_total"]
        ranks_style = "red" if short else ""
        cells = [str(node["node"]) if node["node"] >= 0 else "-", node["host"], node["role"],
                 Text(node["state"], style=state_style), Text(ranks, style=ranks_style), str(node["standbys"])]
        if width >= NARROW:
            cells.append(_devices(node["devices"]))
        table.add_row(*cells, style="bold magenta" if node.get("straggler") else "")
    return table


def rank_table(s: dict) -> Table:
    table = Table(box=None, pad_edge=False, header_style="bold")
    for name in ("rank", "node", "pid", "step", "heartbeat", "restarts", "step time", "wait", "straggler"):
        table.add_column(name, justify="right")
    for rank in s["ranks"]:
        age = rank.get("heartbeat_age")
        beat = Text(f"{age:.1f}s ago" if age is not None else "-", style="red" if age and age > 5 else "")
        alive = rank.get("alive", True)
        table.add_row(str(rank["rank"]), str(rank.get("node", "-")),
                      Text(str(rank.get("pid", "-")), style="" if alive else "red strike"),
                      step_cell(rank), beat, str(rank.get("restarts", 0)), *step_times(rank))
    return table


def step_times(rank: dict) -> tuple[str, str, str]:
    """A rank's median step time, its wait inside collectives and its straggler score (its compute time over the
    job's median; its CPU time over the job's median from outside, said "cpu"), "-" where it has none."""
    score = rank.get("straggler_score")
    outside = " cpu" if rank.get("straggler_view") == "outside" else ""
    return (f"{rank['step_s']:.3f}s" if rank.get("step_s") is not None else "-",
            f"{rank['wait_s']:.3f}s" if rank.get("wait_s") is not None else "-",
            f"{score:.1f}x{outside}" if score is not None else "-")


def step_cell(rank: dict) -> str:
    """A rank's committed step (the worker library's), else the last step its output said, said "(output)"."""
    if rank.get("step") is not None:
        return str(rank["step"])
    return f"{rank['output_step']} (output)" if rank.get("output_step") is not None else "-"


def event_lines(events: list[dict], width: int) -> Text:
    text = Text("last events\n", style="bold")
    for event in events:
        text.append(f"  {'+%.1fs' % event['elapsed']:>8}  ", style="dim")
        text.append(f"{EVENT_LABEL.get(event['kind'], event['kind']):<14}", style=EVENT_STYLE.get(event["kind"], ""))
        detail = event["detail"]
        room = max(20, width - 28)
        text.append((detail if len(detail) <= room else detail[:room - 1] + "…") + "\n")
    text.rstrip()
    return text


def moved_line(host: str) -> str:
    """What a view (``ftrun status --watch``, ``ftrun top``) says once when its store went and etcd named the
    controller's new one, on ``host``, which it reads from now on."""
    return f"the controller moved to {host}; following it"


def plain_line(s: dict) -> str:
    """One line: for logs, and for ``--status plain``'s progress report."""
    alive = sum(n["ranks_alive"] for n in s["nodes"] if n["role"] == "active")
    step = ""
    if s["step"] is not None:
        total = f"/{s['total_steps']}" if s.get("total_steps") else ""
        eta = f", ETA {_clock(s['eta_s'])}" if s.get("eta_s") is not None else ""
        step = f", step {s['step']}{total} ({s['steps_per_s']:.1f} steps/s{eta})"
    elif s.get("output_step") is not None:
        step = f", step {s['output_step']} from output ({s['output_steps_per_s']:.1f} steps/s)"
    spares = sum(1 for n in s["nodes"] if n["role"] == "spare")
    step += _saved(s).replace(" · ", ", ")
    if s.get("controller"):
        step += f", controller on {s['controller']['host']}"
    phase = s["phase"].replace("_", " ")
    if s["phase"] == "running" and s.get("stall"):
        where = f"; {s['stall']['ranks']}" if s["stall"].get("ranks") else ""
        phase = f"stalled for {s['stall']['for']:.0f}s ({s['stall']['reason']}{where})"
    return (f"generation {s['generation']}, {phase}{step}, {alive}/{s['world_size']} ranks "
            f"alive, {spares} spare{'s' if spares != 1 else ''}, budget {s['max_restarts'] - s['restarts_used']}/"
            f"{s['max_restarts']} left, up {_clock(s['elapsed'])}")


def _saved(s: dict) -> str:
    """Where a restart would resume: the step the snapshots hold for every rank, and the newest on disk."""
    restorable, checkpoint = s.get("restorable_step"), s.get("checkpoint_step")
    text = f" · restorable at step {restorable}" if restorable is not None else ""
    return text + (f" · checkpoint step {checkpoint}" if checkpoint is not None else "")


def _devices(devices: list[dict]) -> Text:
    if not devices:
        return Text("-", style="dim")
    text = Text()
    for device in devices:
        text.append(f"{device['index']}:{device['health']} ", style=HEALTH_STYLE.get(device["health"], "yellow"))
    return text


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def live_wanted(mode: str) -> bool:
    """--status auto: the live view when both output streams are terminals."""
    return mode == "live" or (mode == "auto" and sys.stdout.isatty() and sys.stderr.isatty())


class StatusView:
    """The controller's terminal: the live view, or a plain progress line now and then.

    ``source`` returns the latest snapshot ({} while the rendezvous runs); it is read from the view's
    own thread, so the controller never waits on the terminal.
    """

    def __init__(self, source: Callable[[], dict], mode: str, console: Console):
        self.source = source
        self.mode = "live" if live_wanted(mode) else mode if mode != "auto" else "plain"
        self.console = console
        self._live: Live | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.mode == "live":
            if not self.console.is_terminal:  # --status live into a pipe or a file: draw anyway
                self.console = Console(file=sys.stderr, force_terminal=True, width=self.console.width)
            self._live = Live(get_renderable=self._render, console=self.console, refresh_per_second=REFRESH_PER_SECOND,
                              redirect_stdout=True, redirect_stderr=True, transient=False)
            self._live.start()
        elif self.mode == "plain":
            self._thread = threading.Thread(target=self._plain, name="ftrun-status", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Leave the last view on the screen (the summary prints below it)."""
        self._stop.set()
        if self._live is not None:
            self._live.stop()
            self._live = None

    def _render(self) -> RenderableType:
        return render(self.source(), self.console.width, self.console.height)

    def _plain(self) -> None:
        while not self._stop.wait(PLAIN_EVERY):
            snapshot = self.source()
            if snapshot and snapshot["phase"] not in ("exiting", "done"):
                self.console.print(f"ftrun: {escape(plain_line(snapshot))}", highlight=False)


def status_view(controller, mode: str) -> StatusView:
    """Start the view of ``controller``'s status (a ``Controller``) on ftrun's console."""
    from ftrun.cli.console import console

    view = StatusView(lambda: controller.status, mode, console)
    view.start()
    return view
