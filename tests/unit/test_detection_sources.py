"""The detection seam (ftrun/detection/sources.py) and its first sources: what each poll returns, the node's
sources polled as one, a slow source polled in the background, the fault table's sections by source."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from ftrun.detection.device_tool import DeviceToolSource
from ftrun.detection.hang import HangWatch
from ftrun.detection.sources import Background, HealthEvent, NodeHealth, RankSigns
from ftrun.detection.table import CODE_SECTIONS, SECTIONS, Escalation, FaultLevel, load_fault_table
from ftrun.devices import Device, DeviceReading, DeviceToolError, Health

TABLE = load_fault_table()
L = FaultLevel


def reading(index: int, health: Health = Health.OK, *codes: str) -> DeviceReading:
    return DeviceReading(Device(index, "910B2", f"npu {index} chip 0"), health, codes)


class ScriptedBackend:
    """A device backend whose polls return (or raise) what the test lists, one entry a poll."""

    kind = "npu"
    visibility_var = "ASCEND_RT_VISIBLE_DEVICES"

    def __init__(self, *polls):
        self.polls = list(polls)

    def discover(self) -> list[Device]:
        return []

    def poll(self) -> list[DeviceReading]:
        answer = self.polls.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def reset(self, index: int) -> None:
        raise DeviceToolError("not here")


class ListedSource:
    """A source that returns its events once, and remembers what it was asked."""

    def __init__(self, name: str, *events: HealthEvent):
        self.name = name
        self.events = list(events)
        self.asked: list[tuple[float, tuple]] = []

    def poll(self, now: float, ranks=()) -> list[HealthEvent]:
        self.asked.append((now, tuple(ranks)))
        found, self.events = self.events, []
        return found


def device_source(*polls) -> DeviceToolSource:
    return DeviceToolSource(ScriptedBackend(*polls), TABLE, Escalation.from_table(TABLE))


# -- the events --------------------------------------------------------------------------------------


@pytest.mark.parametrize("event, said", [
    (HealthEvent("npu", "code 8C03A000", L.RESTART_NPU, device=1, reading=reading(1, Health.ALARM, "8C03A000")),
     "device 1 (npu 1 chip 0): code 8C03A000 -> RestartNPU"),
    (HealthEvent("npu", "health OK", None, device=1, reading=reading(1)), "device 1 (npu 1 chip 0): health OK -> healthy"),
    (HealthEvent("hang", "no heartbeat for 31.0s", rank=5), "rank 5: no heartbeat for 31.0s"),
])
def test_an_event_describes_itself_by_what_it_is_about(event, said):
    assert event.describe() == said


def test_an_event_is_frozen():
    with pytest.raises(AttributeError):
        HealthEvent("hang", "x", rank=0).rank = 1  # type: ignore[misc]


# -- the sources ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("polls, expected", [
    # healthy when first seen: no news; then a change is one event, named by the backend's kind
    ([[reading(0)], [reading(0, Health.ALARM, "80E01801")]], [[], [("npu", 0, L.RESTART_BUSINESS, "code 80E01801")]]),
    # an unreadable tool says nothing, and the devices' health is judged again once it answers
    ([DeviceToolError("npu-smi not found on PATH"), [reading(0, Health.CRITICAL)]],
     [[], [("npu", 0, L.RESTART_NPU, "health Critical")]]),  # a reset first: no table names its fault
    # back to healthy is news too
    ([[reading(0, Health.ALARM, "80E01801")], [reading(0)], [reading(0)]],
     [[("npu", 0, L.RESTART_BUSINESS, "code 80E01801")], [("npu", 0, None, "health OK")], []]),
])
def test_transition_of_a_device_tool_source_poll_by_poll(polls, expected):
    source = device_source(*polls)
    found = [[(e.source, e.device, e.level, e.reason) for e in source.poll(now=float(t))] for t in range(len(polls))]
    assert found == expected


def test_a_device_tool_that_stays_unreadable_is_one_warning_and_its_return_one_note(caplog):
    error = DeviceToolError("npu-smi info did not answer within 10s")
    source = device_source(error, error, [reading(0)])
    with caplog.at_level(logging.INFO, logger="ftrun.detection.device_tool"):
        assert [source.poll(now=t) for t in (0.0, 1.0, 2.0)] == [[], [], []]
    assert [r.getMessage() for r in caplog.records] == [
        "device health unknown: npu-smi info did not answer within 10s; still watching exit codes and heartbeats",
        "device health readable again"]


HEARTBEAT = 3.0


@pytest.mark.parametrize("signs, now, hung", [
    # beating: alive; the counter stopped past --heartbeat-timeout: hung, once
    ([RankSigns(0, beats=5)], 2.0, []),
    ([RankSigns(0, beats=4)], 4.0, [(0, "no heartbeat for 4.0s (--heartbeat-timeout 3)")]),
    # never beat since its process started: not judged by heartbeats
    ([RankSigns(1, beats=0)], 100.0, []),
    # only the ranks handed in are judged
    ([], 100.0, []),
])
def test_the_hang_watch_judges_the_ranks_it_is_handed(signs, now, hung):
    watch = HangWatch(heartbeat_timeout=HEARTBEAT)
    watch.restart(0, 0, now=0.0)
    watch.restart(1, 0, now=0.0)
    watch.poll(0.0, [RankSigns(0, beats=4)])
    found = watch.poll(now, signs)
    assert [(e.source, e.rank, e.level, e.reason) for e in found] == [("hang", r, None, why) for r, why in hung]


def test_a_rank_reported_hung_is_reported_once_and_judged_again_after_a_restart():
    watch = HangWatch(heartbeat_timeout=HEARTBEAT)
    watch.restart(0, 0, now=0.0)
    watch.poll(0.0, [RankSigns(0, beats=1)])
    assert len(watch.poll(4.0, [RankSigns(0, beats=1)])) == 1
    assert watch.poll(5.0, [RankSigns(0, beats=1)]) == []  # forgotten: a new process will take the rank
    watch.restart(0, 1, now=5.0)
    assert watch.poll(6.0, [RankSigns(0, beats=2)]) == []


# -- the node's sources as one -------------------------------------------------------------------------


def test_the_node_s_sources_are_polled_in_order_with_the_ranks_signs():
    first = ListedSource("hang", HealthEvent("hang", "a", rank=0))
    second = ListedSource("npu", HealthEvent("npu", "b", L.SEPARATE, device=3), HealthEvent("npu", "c", None, device=4))
    health = NodeHealth([first, second])
    signs = [RankSigns(0, 7)]
    assert [e.reason for e in health.poll(12.0, signs)] == ["a", "b", "c"]
    assert health.poll(13.0) == []
    assert first.asked == second.asked == [(12.0, (RankSigns(0, 7),)), (13.0, ())]


def test_a_node_without_sources_finds_nothing():
    assert NodeHealth().poll(1.0, [RankSigns(0, 1)]) == []


def test_a_background_source_is_polled_in_its_own_thread_and_never_waits():
    release = threading.Event()

    class Slow(ListedSource):
        def poll(self, now, ranks=()):
            release.wait(10)  # a hung tool
            return super().poll(now, ranks)

    slow = Slow("npu", HealthEvent("npu", "code 8C03A000", L.RESTART_NPU, device=0))
    background = Background(slow, interval=0.01)
    health = NodeHealth([background])
    health.start()
    try:
        begun = time.monotonic()
        assert health.poll(1.0, [RankSigns(0, 1)]) == []  # the tool hangs: nothing yet, and no wait
        assert time.monotonic() - begun < 1.0
        assert background._thread.name == "ftrun-health-npu" and background._thread.daemon
        release.set()
        deadline = time.monotonic() + 10
        found: list[HealthEvent] = []
        while not found and time.monotonic() < deadline:
            found = health.poll(2.0)
            time.sleep(0.01)
        assert [e.reason for e in found] == ["code 8C03A000"]
        assert all(ranks == () for _, ranks in slow.asked)  # the ranks' signs stay with the agent's own turn
    finally:
        health.stop()
    background._thread.join(timeout=5)
    assert not background._thread.is_alive()


# -- the fault table by source -------------------------------------------------------------------------


def test_every_source_with_codes_has_a_section_of_the_file_and_of_the_table():
    assert {s.section for s in CODE_SECTIONS} <= set(SECTIONS)
    assert set(TABLE.codes) == {s.source for s in CODE_SECTIONS}


@pytest.mark.parametrize("code, source, spelled, level", [
    ("80e01801", "npu", "80E01801", L.RESTART_BUSINESS),
    ("XID 79", "cuda", "xid-79", L.SEPARATE),
    ("79", "cuda", "xid-79", L.SEPARATE),
    ("gpu-lost", "cuda", "gpu-lost", L.SEPARATE),
])
def test_a_code_is_found_in_its_source_s_section_as_that_source_spells_it(code, source, spelled, level):
    section = next(s for s in CODE_SECTIONS if s.source == source)
    assert section.spell(code) == spelled
    assert TABLE.codes[source][spelled] is level
    assert TABLE.level_of_code(code) is level


def test_a_code_no_source_lists_has_no_level():
    assert TABLE.level_of_code("12345678") is None
