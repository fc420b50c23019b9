"""The text of ``ftrun top``'s panes, from plain data: no terminal, no store (tested on their own)."""

from __future__ import annotations

from rich.text import Text

from ftrun.live_view import EVENT_LABEL, EVENT_STYLE, HEALTH_STYLE, step_cell, step_times

RANK_COLUMNS = ("rank", "node", "host", "pid", "state", "step", "heartbeat", "restarts", "step time", "wait", "straggler")
#: a straggling node's cells
SLOW_STYLE = "bold magenta"
#: output lines shown in a rank's pane
OUTPUT_SHOWN = 20
#: a heartbeat older than this is shown in red
STALE_BEAT = 5.0

HELP = """\
ftrun top: keys
  j / k, ↓ / ↑   move between ranks (grouped by node)
  Enter          open the selected rank: its last output, step and heartbeat history, device, restarts
  s              the selected rank's Python stack (py-spy, or faulthandler under ftrun.elastic)
  e              the event log;  /  filters it (Escape clears)
  ?              this help
  q              leave the view (the job goes on)
actions (need the job's token, --token-file; each asks first and is logged with who asked):
  r              restart the selected rank through the process-level path, as a drill
  d              drain the selected rank's node: its ranks move to a spare, then the node leaves
  x              stop the job"""

ACTION_WORDS = {"r": "restart rank {rank} (a drill: one unit of the retry budget)",
                "d": "drain node {node} (its ranks move to a spare; the node leaves)",
                "x": "stop the job"}


#: how to get the token, as ``ftrun top`` says it, and as the controller's own view does (it holds the
#: job's token, so there it lacks one only when the job has none)
TOKEN_HINT = "start ftrun top with --token-file FILE"
JOB_TOKEN_HINT = "this job has none (start it with --token-file FILE)"


def refusal(key: str, hint: str = TOKEN_HINT) -> str:
    """The one line an action gets without the token."""
    return f"'{key}' changes the job and needs its token: {hint}"


def rank_rows(snapshot: dict) -> list[tuple[int, tuple[str | Text, ...]]]:
    """(rank, cells) per rank, by node then rank; the node and host of a straggling node highlighted; while the job
    stands still, a rank's state is the checkpoint it saves or the collective it waits in."""
    hosts = {n["node"]: n["host"] for n in snapshot.get("nodes", ()) if n["role"] == "active"}
    slow = {n["node"] for n in snapshot.get("nodes", ()) if n.get("straggler")}
    stalled = snapshot.get("phase") == "running" and bool(snapshot.get("stall"))
    rows: list[tuple[int, tuple[str | Text, ...]]] = []
    for rank in sorted(snapshot.get("ranks", ()), key=lambda r: (r.get("node", -1), r["rank"])):
        age = rank.get("heartbeat_age")
        state = "alive" if rank.get("alive", True) and rank.get("pid") else "down" if rank.get("pid") else "-"
        collective, saving = rank.get("collective"), rank.get("saving")
        if state == "alive" and stalled and saving is not None:  # while nothing moves: the save it makes
            state = f"saving {saving:.0f}s"
        elif state == "alive" and stalled and collective:  # or the collective it waits in
            state = f"in {collective['op']} {collective['for']:.0f}s"
        node, host = str(rank.get("node", "-")), hosts.get(rank.get("node"), "-")
        where: tuple[str | Text, ...] = ((Text(node, style=SLOW_STYLE), Text(host, style=SLOW_STYLE))
                                         if rank.get("node") in slow else (node, host))
        rows.append((rank["rank"], (
            str(rank["rank"]), *where, str(rank.get("pid", "-")),
            state, step_cell(rank),
            f"{age:.1f}s ago" if age is not None else "-", str(rank.get("restarts", 0)), *step_times(rank))))
    return rows



def node_of(snapshot: dict, rank: int) -> dict | None:
    """The active node row that holds ``rank`` (its agent, host, devices)."""
    row: dict | None = next((r for r in snapshot.get("ranks", ()) if r["rank"] == rank), None)
    if row is None or "node" not in row:
        return None
    return next((n for n in snapshot.get("nodes", ()) if n["node"] == row["node"] and n["role"] == "active"), None)


def rank_detail(snapshot: dict, rank: int, output: list[str], history: list, events: list[dict]) -> Text:
    """The opened rank: where it runs, its restarts and faults, its device, its step history, its output."""
    row: dict = next((r for r in snapshot.get("ranks", ()) if r["rank"] == rank), {})
    node = node_of(snapshot, rank) or {}
    text = Text(f"rank {rank}", style="bold")
    text.append(f" · node {node.get('node', '-')} ({node.get('host', '-')}) · pid {row.get('pid', '-')}"
                f" · restarts {row.get('restarts', 0)}\n")
    devices = node.get("devices") or []
    text.append("device  ", style="bold")
    if not devices:
        text.append("- (CPU)\n", style="dim")
    for device in devices:
        text.append(f"{device['index']}:{device['health']}", style=HEALTH_STYLE.get(device["health"], "yellow"))
        text.append(f" {device['reason']}  " if device.get("reason") else "  ")
    if devices:
        text.append("\n")
    faults = [e for e in events if e.get("rank") == rank and e["kind"] in ("fault", "operator")]
    for event in faults[-3:]:
        text.append(f"{EVENT_LABEL.get(event['kind'], event['kind'])}  ", style=EVENT_STYLE.get(event["kind"], "yellow"))
        text.append(f"+{event['elapsed']:.1f}s {event['detail']}\n")
    text.append_text(outside_line(row))
    text.append("history ", style="bold")
    if history:
        text.append("  ".join(f"+{t}s step {'-' if step is None else step} beat {'-' if age is None else f'{age:g}s'}"
                              for t, step, age in history[-6:]))
    else:
        text.append("-", style="dim")
    text.append("\n")
    text.append(f"last output (stdout and stderr, {min(len(output), OUTPUT_SHOWN)} of the last {len(output)} lines)\n",
                style="bold")
    for line in output[-OUTPUT_SHOWN:]:
        text.append(f"  {line}\n")
    text.rstrip()
    return text


def outside_line(rank: dict) -> Text:
    """What is seen of the rank from outside (any script): its CPU share and the last step its output said."""
    cpu, step, age = rank.get("cpu_s_per_s"), rank.get("output_step"), rank.get("output_step_age")
    if cpu is None and step is None:
        return Text()
    text = Text("outside ", style="bold")
    text.append(f"cpu {cpu:.2f} CPU-s/s" if cpu is not None else "cpu -")
    if step is not None:
        text.append(f" · step {step} from output, {age:.1f}s ago" if age is not None else f" · step {step} from output")
    return text.append("\n")


def stack_pane(rank: int, answer: dict | None) -> Text:
    if answer is None:
        return Text(f"rank {rank}: asking its agent for the stack…", style="dim")
    how = f" ({answer['how']})" if answer.get("how") else ""
    text = Text(f"rank {rank} stack{how}\n", style="bold")
    for line in answer.get("lines", ()):
        text.append(f"  {line}\n")
    text.rstrip()
    return text


def event_pane(events: list[dict], wanted: str = "", limit: int = 200) -> Text:
    """The event log, newest last; ``wanted``: only the events whose kind or detail holds it (any case)."""
    needle = wanted.lower()
    shown = [e for e in events if not needle or needle in e["kind"].lower() or needle in e["detail"].lower()]
    title = f"event log ({len(shown)} of {len(events)}" + (f" matching '{wanted}')" if wanted else ")")
    text = Text(title + "\n", style="bold")
    for event in shown[-limit:]:
        text.append(f"  {'+%.1fs' % event['elapsed']:>8}  ", style="dim")
        text.append(f"{EVENT_LABEL.get(event['kind'], event['kind']):<14}", style=EVENT_STYLE.get(event["kind"], ""))
        text.append(event["detail"] + "\n")
    text.rstrip()
    return text
