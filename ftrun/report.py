"""The job report: one self-contained HTML page drawn from the event log (``ftrun.events``).

Inline CSS and SVG only, no script and no external URL, so the file opens offline and can be attached
to a ticket. Every string taken from the events is escaped: details carry worker output.
"""

from __future__ import annotations

import html
import math
import statistics
from collections import Counter
from collections.abc import Callable
from typing import Any

#: the timeline, in SVG user units (the SVG scales to the page's width)
WIDTH, HEIGHT = 1100, 300
LEFT, RIGHT, TOP, BOTTOM = 64, 24, 30, 46
X_TICKS, Y_TICKS = 10, 4
#: room above the fastest rate, so the line does not run along the plot's top edge
Y_HEADROOM = 1.1
FONT_SIZE, SMALL_FONT = 12, 10
MARKER_SIZE, MIN_BAND_WIDTH = 6, 2
#: the outline of a marker's flag from its top left corner: a triangle for a fault, a square for a lost node
FLAGS = {"fault": f"h{2 * MARKER_SIZE} l{-MARKER_SIZE},{2 * MARKER_SIZE} z",
         "node_lost": f"h{2 * MARKER_SIZE} v{2 * MARKER_SIZE} h{-2 * MARKER_SIZE} z"}
FAULT_COLOUR, LINE_COLOUR, GENERATION_COLOUR = "#d62728", "#1f6fb4", "#8c8c8c"
GRID_COLOUR, AXIS_COLOUR, TEXT_COLOUR = "#e6e6e6", "#999", "#444"
#: by repair level (a decision's ``level`` is one of these, or "grow" for a restart that repairs nothing)
REPAIR_COLOURS = {"online": "#27ae60", "process": "#f0a030", "job": "#9b59b6"}
OTHER_REPAIR_COLOUR, REPAIR_OPACITY = "#7f8c8d", 0.25
LEGEND = ((LINE_COLOUR, "throughput (steps/s)"), (FAULT_COLOUR, "fault (triangle) or node lost (square)"),
          *((colour, f"{level}-level repair") for level, colour in REPAIR_COLOURS.items()),
          (GENERATION_COLOUR, "generation start"))
MARKER_KINDS = ("fault", "node_lost")
#: a repair's phases in the order they happen, as a repair_done's ``durations`` name them (process level:
#: detect to rollback; job level: detect, stop, restart)
PHASES = ("detect", "stop", "env clear", "repair", "rollback", "restart")
STDERR_LINES_SHOWN = 20
#: belt and braces: even if something slipped through unescaped, the page may load and run nothing
CSP = "default-src 'none'; style-src 'unsafe-inline'"
#: an axis: a value (seconds, steps/s) to its SVG coordinate
Scale = Callable[[float], float]

CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px; color: #222; max-width: 1200px; }
h1 { font-size: 20px; margin: 0 0 12px; } h2 { font-size: 16px; margin: 28px 0 8px; } .ok { color: #1e8449; }
dl { display: grid; grid-template-columns: max-content auto; gap: 2px 18px; } dt { color: #666; } dd { margin: 0; }
dd, td.total { font-weight: 600; } .failed, .cause h2 { color: #c0392b; } .cause h2 { margin-top: 0; }
.cause { border-left: 4px solid #c0392b; background: #fdf2f1; padding: 10px 14px; margin-top: 18px; }
pre { background: #f4f4f4; padding: 8px; overflow-x: auto; font-size: 12px; margin: 4px 0 0; }
svg { width: 100%; height: auto; border: 1px solid #ddd; background: #fff; }
.legend { font-size: 13px; color: #555; margin-top: 4px; } .legend span { margin-right: 18px; }
.swatch { display: inline-block; width: 12px; height: 12px; vertical-align: -1px; margin-right: 5px; }
table { border-collapse: collapse; font-size: 13px; } th { background: #fafafa; } td.detail { white-space: normal; }
th, td { border-bottom: 1px solid #eee; padding: 3px 10px; text-align: left; vertical-align: top; white-space: nowrap; }
.num { text-align: right; font-variant-numeric: tabular-nums; } tr.repair_done td { background: #f3f8ee; }
tr.fault td, tr.node_lost td { background: #fdf2f1; }
"""


def html_report(events: list[dict], title: str = "") -> str:
    """The job's report as one HTML page: summary, root cause, timeline, repairs and events."""
    heading = title or f"ftrun job {_run_id(events)}"
    body = [_el("h1", _esc(heading)), _facts(events), _root_cause(events), _el("h2", "Timeline"), _timeline(events),
            _el("h2", "Repairs"), _repair_table(events), _el("h2", "Events"), _event_table(events)]
    head = (f"<meta charset='utf-8'><meta http-equiv='Content-Security-Policy' content=\"{CSP}\">"
            + _el("title", _esc(heading)) + _el("style", CSS))
    return f"<!DOCTYPE html>\n<html lang='en'><head>{head}</head>\n<body>\n" + "\n".join(body) + "\n</body></html>\n"


def _esc(value) -> str:
    return "" if value is None else html.escape(str(value))


def _el(tag: str, content: str = "", **attrs) -> str:
    """One element. ``content`` is HTML already (pass text through _esc); attribute values are escaped here.
    An attribute's name is its keyword with ``_`` as ``-`` (``class_`` is ``class``)."""
    names = "".join(f" {name.rstrip('_').replace('_', '-')}='{_esc(value)}'" for name, value in attrs.items())
    return f"<{tag}{names}>{content}</{tag}>"


def _number(value) -> float | None:
    """A finite number, or None: the events file may be cut short or edited by hand."""
    finite = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if finite else None


def _elapsed(event: dict) -> float:
    return max(0.0, _number(event.get("elapsed")) or 0.0)


def _of(events: list[dict], *kinds: str) -> list[dict]:
    return [e for e in events if e.get("kind") in kinds]


def _run_id(events: list[dict]) -> str:
    return str((_of(events, "job_started") or [{}])[0].get("run_id") or "?")


def _seconds(value: float | None) -> str:
    if value is None or value < 60:
        return "?" if value is None else f"{value:.2f} s"
    hours, rest = divmod(round(value), 3600)
    return (f"{hours}h " if hours else "") + f"{rest // 60}m {rest % 60}s"


def _known(value) -> str:
    return "?" if value is None else str(value)


def _outcome(finished: dict) -> tuple[str, str]:
    """What became of the job, and the CSS class that colours it."""
    if not finished:
        return "unfinished (no job_finished event)", ""
    if finished.get("exit_code") == 0:
        return "succeeded", "ok"
    why = finished.get("reason") or finished.get("detail") or ""  # the detail says "job failed (exit code N): reason"
    return f"failed, exit code {finished.get('exit_code')}: {why}", "failed"


def _facts(events: list[dict]) -> str:
    finished, started = (_of(events, "job_finished") or [{}])[-1], (_of(events, "job_started") or [{}])[0]
    repairs, duration = _of(events, "repair_done"), _number(finished.get("duration"))
    steps = [e["step"] for e in (*_of(events, "progress"), finished) if e.get("step") is not None]
    max_restarts = finished.get("max_restarts", started.get("max_restarts"))
    levels = Counter(str(r.get("level") or "?") for r in repairs)
    totals = [t for t in (_number(r.get("total")) for r in repairs) if t is not None]
    rows = [("run id", _run_id(events), ""), ("outcome", *_outcome(finished)),
            ("duration", _seconds(max(map(_elapsed, events), default=0.0) if duration is None else duration), ""),
            ("final step", steps[-1] if steps else "?", ""),
            ("restarts used", f"{_known(finished.get('restarts_used'))} of {_known(max_restarts)}", ""),
            ("faults", len(_of(events, "fault")), ""), ("nodes lost", len(_of(events, "node_lost")), ""),
            ("repairs", ", ".join(f"{n} {level}-level" for level, n in sorted(levels.items())) or "none", ""),
            ("median time to repair", _seconds(statistics.median(totals)) if totals else "-", "")]
    return _el("dl", "".join(_el("dt", _esc(name)) + _el("dd", _esc(value), class_=css) for name, value, css in rows))


def _root_cause(events: list[dict]) -> str:
    """A failed job's first fault with its evidence in full: the thing to read first."""
    finished, first = _of(events, "job_finished"), _of(events, "fault") or _of(events, "node_lost")
    if not finished or finished[-1].get("exit_code") == 0 or not first:
        return ""
    fault = first[0]
    evidence = fault.get("evidence") if isinstance(fault.get("evidence"), dict) else {}
    where = _el("small", f"(generation {_esc(fault.get('generation'))}, {_elapsed(fault):.3f} s)")
    tail = [str(line) for line in evidence.get("stderr_tail") or () if str(line).strip()][-STDERR_LINES_SHOWN:]
    shown = [("cause", evidence.get("cause")), ("error", evidence.get("error")), ("last stderr lines", "\n".join(tail))]
    parts = [_el("h2", "Root cause: the first fault"), _el("p", f"{_esc(fault.get('detail'))} {where}"),
             *(_el("p", f"{label}:") + _el("pre", _esc(text)) for label, text in shown if text)]
    return _el("section", "".join(parts), class_="cause")


def _nice_ticks(high: float, count: int) -> list[float]:
    """Round tick values from 0 up to at least ``high`` (an empty or flat range gets 0..1)."""
    high = high if high > 0 else 1.0
    magnitude = 10 ** math.floor(math.log10(high / count))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= high / count)
    return [i * step for i in range(math.ceil(high / step - 1e-9) + 1)]


def _scale(start: float, end: float, top: float) -> Scale:
    """Maps 0..top (top > 0) onto start..end in the SVG."""
    return lambda value: round(start + (end - start) * value / top, 2)


def _timeline(events: list[dict]) -> str:
    points = ((_elapsed(e), _number(e.get("steps_per_s"))) for e in _of(events, "progress"))
    rates = sorted((t, r) for t, r in points if r is not None and r >= 0)
    x_ticks = _nice_ticks(max(map(_elapsed, events), default=0.0), X_TICKS)
    y_ticks = _nice_ticks(max((r for _, r in rates), default=0.0) * Y_HEADROOM, Y_TICKS)
    x, y = _scale(LEFT, WIDTH - RIGHT, x_ticks[-1]), _scale(HEIGHT - BOTTOM, TOP, y_ticks[-1])
    parts = [_el("title", "throughput, faults and repairs over the job's elapsed time"), _grid(x, y, x_ticks, y_ticks),
             *_repair_bands(events, x), *_generation_ticks(events, x), _throughput(rates, x, y),
             *(_fault_marker(e, x) for e in _of(events, *MARKER_KINDS))]
    legend = "".join(_el("span", _el("i", class_="swatch", style=f"background:{colour}") + _esc(text))
                     for colour, text in LEGEND)
    return (_el("svg", "".join(parts), viewBox=f"0 0 {WIDTH} {HEIGHT}", role="img", font_size=FONT_SIZE,
                fill=TEXT_COLOUR) + _el("div", legend, class_="legend"))


def _grid(x: Scale, y: Scale, x_ticks: list[float], y_ticks: list[float]) -> str:
    bottom, right = HEIGHT - BOTTOM, WIDTH - RIGHT
    parts = [_el("line", x1=x(v), y1=TOP, x2=x(v), y2=bottom, stroke=GRID_COLOUR)
             + _el("text", f"{v:g}", x=x(v), y=bottom + 16, text_anchor="middle") for v in x_ticks]
    parts += [_el("line", x1=LEFT, y1=y(v), x2=right, y2=y(v), stroke=GRID_COLOUR)
              + _el("text", f"{v:g}", x=LEFT - 6, y=y(v) + 4, text_anchor="end") for v in y_ticks]
    parts += [_el("polyline", points=f"{LEFT},{TOP} {LEFT},{bottom} {right},{bottom}", fill="none", stroke=AXIS_COLOUR),
              _el("text", "elapsed (s)", x=(LEFT + right) / 2, y=HEIGHT - 6, text_anchor="middle"),
              _el("text", "steps/s", transform=f"translate(16 {(TOP + bottom) / 2}) rotate(-90)", text_anchor="middle")]
    return "".join(parts)


def _repair_bands(events: list[dict], x: Scale) -> list[str]:
    """A band per repair_done, from the first fault, loss or repair decision since the last repair (else its total).
    A decision to grow the job is no repair: no repair_done follows it."""
    bands, began = [], None
    for event in events:
        repair_decision = event.get("kind") == "decision" and event.get("level") in REPAIR_COLOURS
        if (event.get("kind") in MARKER_KINDS or repair_decision) and began is None:
            began = _elapsed(event)
        if event.get("kind") != "repair_done":
            continue
        end, level = _elapsed(event), str(event.get("level") or "?")
        by_total = end - (_number(event.get("total")) or 0.0)
        start, began = min(end, max(0.0, by_total if began is None else began)), None
        phases = ", ".join(f"{name} {_ms(s)} ms" for name, s in _phases(event).items())
        tip = f"{level}-level repair, {_seconds(_number(event.get('total')))}: {phases}"
        bands.append(_el("rect", _el("title", _esc(tip)), class_="repair-band", data_level=level, x=x(start),
                         y=TOP, width=max(round(x(end) - x(start), 2), MIN_BAND_WIDTH),
                         height=HEIGHT - TOP - BOTTOM, fill=REPAIR_COLOURS.get(level, OTHER_REPAIR_COLOUR),
                         fill_opacity=REPAIR_OPACITY))
    return bands


def _generation_ticks(events: list[dict], x: Scale) -> list[str]:
    ticks = []
    for event in _of(events, "generation_started"):
        at, generation = x(_elapsed(event)), event.get("generation")
        tip = f"generation {generation} starts ({event.get('level')}): {event.get('detail') or ''}"
        ticks.append(_el("g", _el("title", _esc(tip))
                         + _el("line", x1=at, y1=TOP, x2=at, y2=HEIGHT - BOTTOM, stroke=GENERATION_COLOUR,
                               stroke_dasharray="3 3")
                         + _el("text", _esc(f"g{generation}"), x=at + 3, y=HEIGHT - BOTTOM - 5, font_size=SMALL_FONT),
                         class_="generation-tick", fill=GENERATION_COLOUR))
    return ticks


def _throughput(rates: list[tuple[float, float]], x: Scale, y: Scale) -> str:
    if not rates:
        return _el("text", "no progress events", x=(LEFT + WIDTH - RIGHT) / 2, y=(TOP + HEIGHT - BOTTOM) / 2,
                   text_anchor="middle", fill=GENERATION_COLOUR)
    if len(rates) == 1:
        return _el("circle", cx=x(rates[0][0]), cy=y(rates[0][1]), r=3, fill=LINE_COLOUR)
    return _el("polyline", class_="throughput", points=" ".join(f"{x(t)},{y(r)}" for t, r in rates),
               fill="none", stroke=LINE_COLOUR, stroke_width=2)


def _fault_marker(event: dict, x: Scale) -> str:
    """A red line under a flag; a wide transparent line under it makes the tooltip easy to hover."""
    elapsed, kind = _elapsed(event), event.get("kind")
    tip = f"{kind} at {elapsed:.3f} s: {event.get('detail') or ''}"
    line: dict[str, Any] = {"x1": x(elapsed), "y1": TOP, "x2": x(elapsed), "y2": HEIGHT - BOTTOM}
    flag = f"M{x(elapsed) - MARKER_SIZE},{TOP - 2 * MARKER_SIZE} {FLAGS.get(kind, FLAGS['fault'])}"
    shapes = (_el("title", _esc(tip)) + _el("line", **line, stroke="transparent", stroke_width=10)
              + _el("line", **line, stroke=FAULT_COLOUR, stroke_width=2) + _el("path", d=flag, fill=FAULT_COLOUR))
    return _el("g", shapes, class_="fault-marker", data_kind=kind, data_rank=event.get("rank"),
               data_node=event.get("node"), data_elapsed=f"{elapsed:.3f}")


def _phases(event: dict) -> dict[str, float | None]:
    """The repair's phase durations in seconds, the known phases first and in order (``env_clear`` is ``env clear``)."""
    given = event.get("durations") if isinstance(event.get("durations"), dict) else {}
    durations = {str(name).replace("_", " "): _number(seconds) for name, seconds in given.items()}
    return {name: durations[name] for name in sorted(durations, key=_phase_order)}


def _phase_order(name: str) -> int:
    return PHASES.index(name) if name in PHASES else len(PHASES)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def _table(css: str, head: list[tuple[str, str]], rows: list[tuple[str, list[tuple[str, str]]]], empty: str) -> str:
    """A table from (text, CSS class) cells, one row per (row class, cells); ``empty`` when there are no rows."""
    if not rows:
        return _el("p", _esc(empty))
    lines = [_el("tr", "".join(_el("th", _esc(text), class_=cell_css) for text, cell_css in head))]
    lines += [_el("tr", "".join(_el("td", _esc(text), class_=cell_css) for text, cell_css in cells), class_=row_css)
              for row_css, cells in rows]
    return _el("table", "".join(lines), class_=css)


def _repair_table(events: list[dict]) -> str:
    repairs = _of(events, "repair_done")
    names = sorted(dict.fromkeys(name for event in repairs for name in _phases(event)), key=_phase_order)
    head = [("time (s)", "num"), ("generation", "num"), ("level", ""),
            *((f"{name} (ms)", "num") for name in [*names, "total"])]
    rows = [("", [(f"{_elapsed(e):.3f}", "num"), (e.get("generation"), "num"), (e.get("level"), ""),
                  *((_ms(_phases(e).get(name)), "num") for name in names), (_ms(_number(e.get("total"))), "num total")])
            for e in repairs]
    return _table("repairs", head, rows, "No repairs.")


def _event_table(events: list[dict]) -> str:
    head = [("time (s)", "num"), ("generation", "num"), ("kind", ""), ("node", "num"), ("host", ""), ("rank", "num"),
            ("detail", "")]
    rows = [(e.get("kind"), [(f"{_elapsed(e):.3f}", "num"), (e.get("generation"), "num"), (e.get("kind"), ""),
                             (e.get("node"), "num"), (e.get("host"), ""), (e.get("rank"), "num"),
                             (e.get("detail"), "detail")])
            for e in events if e.get("kind") != "progress"]
    return _table("events", head, rows, "No events.")
