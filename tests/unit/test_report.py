"""The HTML job report: what it shows, that it escapes the events' strings, and that it never fails to draw."""

from __future__ import annotations

from html.parser import HTMLParser

import pytest

from ftrun.events import EventLog
from ftrun.messages import WorkerFailure
from ftrun.report import html_report

HOSTILE = "<script>alert(\"x\")</script> & 'quoted' \"double\""


class Page(HTMLParser):
    """The parsed page: every start tag with its attributes, the text, the header's facts (name: value) and
    each table's cells by its class."""

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict]] = []
        self.texts: list[str] = []
        self.tables: dict[str, list[list[str]]] = {}
        self.facts: dict[str, str] = {}
        self._rows: list[list[str]] = []
        self._fact: list[str] = []  # the header's <dt> or <dd> being read: ["dt" or "dd", name]
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        attributes = {name: value or "" for name, value in attrs}
        self.tags.append((tag, attributes))
        if tag == "table":
            self._rows = self.tables.setdefault(attributes.get("class", ""), [])
        elif tag == "tr":
            self._rows.append([])
        elif tag in ("td", "th"):
            self._rows[-1].append("")
        elif tag == "dt":
            self._fact = ["dt", ""]
        elif tag == "dd":
            self._fact = ["dd", self._fact[1]]
            self.facts[self._fact[1]] = ""

    def handle_data(self, data):
        self.texts.append(data)
        if self._rows and self._rows[-1]:
            self._rows[-1][-1] += data
        if self._fact[:1] == ["dt"]:
            self._fact[1] += data
        elif self._fact[:1] == ["dd"]:
            self.facts[self._fact[1]] += data

    def handle_endtag(self, tag):
        if tag == "table":
            self._rows = []
        elif tag == "dd":
            self._fact = []

    def with_class(self, name: str) -> list[dict]:
        return [attrs for _, attrs in self.tags if name in attrs.get("class", "").split()]

    @property
    def text(self) -> str:
        return "".join(self.texts)


def at(event: dict, elapsed: float) -> dict:
    """Pin an emitted event's time, so the timeline does not depend on how fast the test runs."""
    event["elapsed"] = elapsed
    return event


def job_events(detail: str = "worker died", failed: bool = False) -> list[dict]:
    """A job with a process-level repair of one fault, a lost node repaired at job level, then the end."""
    log = EventLog()
    at(log.emit("job_started", 0, "2 nodes x 2 ranks", run_id="run-42", world_size=4, nodes=2, spares=0), 0.0)
    at(log.emit("generation_started", 0, "4 workers", level="start", world_size=4), 0.5)
    for second in range(1, 30):
        at(log.emit("progress", 0, step=second * 10, steps_per_s=10.0 - (4.0 if 10 <= second <= 12 else 0.0)),
           float(second))
    failure = WorkerFailure(rank=3, local_rank=1, node_rank=1, host="node-b", pid=4242, exit_code=1,
                            stderr_tail=("Traceback (most recent call last):", f"RuntimeError: {detail}"),
                            error=f"RuntimeError: {detail}", generation=0, cause="exception", detail=detail)
    at(log.fault(failure), 10.0)
    at(log.emit("decision", 0, "replace rank 3", level="process", budget_left=2), 10.1)
    for offset, phase in enumerate(("stopping", "env_clear", "repair", "rollback", "running")):
        at(log.emit("phase", 0, phase, phase=phase), 10.2 + offset * 0.3)
    at(log.emit("repair_done", 0, "rank 3 replaced", level="process", total=1.8,
                durations={"detect": 0.05, "stop": 0.2, "env clear": 0.3, "repair": 1.0, "rollback": 0.25}), 11.8)
    at(log.emit("node_lost", 0, "node 0 keepalive silent for 5s", node=0, host="node-a"), 20.0)
    at(log.emit("decision", 0, "restart the job", level="job", budget_left=1), 20.2)
    at(log.emit("generation_started", 1, "4 workers", level="job", world_size=4), 23.0)
    at(log.emit("repair_done", 1, "job restarted", level="job", total=4.0,
                durations={"detect": 0.5, "stop": 1.5, "restart": 2.0}), 24.0)
    exit_code, reason = (1, f"rank 3 failed: {detail}") if failed else (0, "all workers exited 0")
    at(log.emit("job_finished", 1, reason, exit_code=exit_code, duration=30.0, step=290, restarts_used=1,
                max_restarts=3), 30.0)
    return log.events


def test_one_fault_marker_per_fault_and_lost_node():
    page = Page(html_report(job_events()))
    markers = page.with_class("fault-marker")
    assert [(m["data-kind"], m["data-rank"], m["data-elapsed"]) for m in markers] == [
        ("fault", "3", "10.000"), ("node_lost", "", "20.000")]


def test_repair_bands_span_from_the_fault_to_the_repair():
    page = Page(html_report(job_events()))
    bands = page.with_class("repair-band")
    assert [b["data-level"] for b in bands] == ["process", "job"]
    assert all(float(b["width"]) > 2 for b in bands)
    # the process repair runs from the fault at 10 s to 11.8 s; the job repair from 20 s to 24 s
    process, job = (float(b["width"]) for b in bands)
    assert job / process == pytest.approx(4.0 / 1.8, rel=0.02)


def test_a_decision_to_grow_the_job_starts_no_repair_band():
    grown = [{"kind": "decision", "level": "grow", "elapsed": 2.0}, {"kind": "generation_started", "elapsed": 3.0}]
    repaired = [{"kind": "fault", "elapsed": 8.0}, {"kind": "decision", "level": "job", "elapsed": 8.5},
                {"kind": "repair_done", "level": "job", "elapsed": 10.0}]
    band, = Page(html_report(grown + repaired)).with_class("repair-band")
    assert band == Page(html_report(repaired)).with_class("repair-band")[0]  # from the fault at 8 s, not from 2 s


def test_header_counts_repairs_and_the_median_time_to_repair():
    assert Page(html_report(job_events())).facts == {
        "run id": "run-42", "outcome": "succeeded", "duration": "30.00 s", "final step": "290",
        "restarts used": "1 of 3", "faults": "1", "nodes lost": "1", "repairs": "1 job-level, 1 process-level",
        "median time to repair": "2.90 s"}


def test_the_final_step_is_the_last_progress_step_when_the_job_ended_without_one():
    events = [{"kind": "progress", "elapsed": 1.0, "step": 70, "steps_per_s": 7.0},
              {"kind": "job_finished", "elapsed": 2.0, "exit_code": 0, "step": None}]
    assert Page(html_report(events)).facts["final step"] == "70"


def test_the_repair_table_breaks_each_repair_into_phases_in_ms():
    head, process, job = Page(html_report(job_events())).tables["repairs"]
    assert head == ["time (s)", "generation", "level", "detect (ms)", "stop (ms)", "env clear (ms)", "repair (ms)",
                    "rollback (ms)", "restart (ms)", "total (ms)"]
    assert process == ["11.800", "0", "process", "50", "200", "300", "1000", "250", "-", "1800"]
    assert job == ["24.000", "1", "job", "500", "1500", "-", "-", "-", "2000", "4000"]


def test_phase_names_with_underscores_share_a_column_with_the_spaced_ones():
    repairs = [{"kind": "repair_done", "durations": {"env_clear": 0.1, "drain": 0.2}},
               {"kind": "repair_done", "durations": {"env clear": 0.3, "detect": 0.4}}]
    head, *rows = Page(html_report(repairs)).tables["repairs"]
    assert head[3:] == ["detect (ms)", "env clear (ms)", "drain (ms)", "total (ms)"]
    assert [row[3:] for row in rows] == [["-", "100", "200", "-"], ["400", "300", "-", "-"]]


def test_the_event_table_lists_every_event_but_progress():
    events = job_events()
    head, *rows = Page(html_report(events)).tables["events"]
    assert head == ["time (s)", "generation", "kind", "node", "host", "rank", "detail"]
    assert [row[2] for row in rows] == [e["kind"] for e in events if e["kind"] != "progress"]
    assert next(row for row in rows if row[2] == "fault")[:6] == ["10.000", "0", "fault", "1", "node-b", "3"]


def test_a_failed_job_shows_the_first_fault_as_its_root_cause():
    page = Page(html_report(job_events(detail="CUDA error: out of memory", failed=True)))
    assert page.facts["outcome"] == "failed, exit code 1: rank 3 failed: CUDA error: out of memory"
    cause = page.text.split("Root cause")[1]
    assert "exception" in cause and "RuntimeError: CUDA error: out of memory" in cause
    assert "Traceback (most recent call last):" in cause
    assert page.text.index("Root cause") < page.text.index("Timeline")
    assert "Root cause" not in Page(html_report(job_events())).text  # a job that succeeded has none


def test_hostile_strings_in_events_are_escaped():
    # in text (details, stderr, the title) and in attributes (a repair's level, a fault's rank)
    events = [*job_events(detail=HOSTILE, failed=True), {"kind": "fault", "rank": HOSTILE, "elapsed": 1.0},
              {"kind": "repair_done", "level": HOSTILE, "elapsed": 2.0}]
    report = html_report(events, title=HOSTILE)
    page = Page(report)
    assert not [tag for tag, _ in page.tags if tag == "script"]
    assert "<script>" not in report and "alert(\"x\")" not in report
    assert HOSTILE in page.text  # shown to the reader as it was written
    assert page.with_class("fault-marker")[-1]["data-rank"] == HOSTILE
    assert page.with_class("repair-band")[-1]["data-level"] == HOSTILE


def test_no_external_urls():
    page = Page(html_report(job_events(failed=True)))
    for tag, attrs in page.tags:
        for name in ("src", "href", "xlink:href", "action"):
            assert not attrs.get(name, "").lower().startswith(("http://", "https://", "//")), (tag, attrs)
    assert "url(" not in html_report(job_events())


@pytest.mark.parametrize("events", [
    [],
    [{"kind": "job_started"}],
    [{"t": 1.0, "elapsed": 0.0, "kind": "fault", "detail": "at zero"}],
    [{"elapsed": 0, "kind": k, "steps_per_s": 0, "total": 0} for k in ("progress", "fault", "repair_done")],
    [{"elapsed": 5.0, "kind": "progress", "step": 1, "steps_per_s": None},
     {"elapsed": float("nan"), "kind": "progress", "steps_per_s": float("inf")},
     {"elapsed": "late", "kind": "repair_done", "durations": "none", "total": "?"},
     {"kind": "fault", "evidence": "not a dict"}, {"kind": "fault", "evidence": {"stderr_tail": None}},
     {"kind": "job_finished", "exit_code": 3}],
], ids=["empty", "one-event", "one-fault", "zero-duration", "malformed-fields"])
def test_degenerate_event_lists_still_draw(events):
    page = Page(html_report(events))
    assert [tag for tag, _ in page.tags].count("svg") == 1
    assert len(page.with_class("fault-marker")) == sum(e["kind"] in ("fault", "node_lost") for e in events)
