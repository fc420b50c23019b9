"""Hang detection: heartbeats for ranks under ftrun.elastic, output and CPU for the others."""

from ftrun.detection.hang import HangWatch


def test_rank_with_fresh_heartbeats_is_alive():
    watch = HangWatch(heartbeat_timeout=3)
    watch.restart(0, beats=0, now=0)
    for t in range(1, 20):
        assert watch.observe(0, beats=t, activity=(), now=t) == ""


def test_transition_beating_to_silent_past_the_timeout_is_a_hang():
    watch = HangWatch(heartbeat_timeout=3)
    watch.restart(0, beats=0, now=0)
    assert watch.observe(0, beats=1, activity=(), now=1) == ""
    assert watch.observe(0, beats=1, activity=(), now=3.9) == ""
    assert watch.observe(0, beats=1, activity=(), now=4.2) == "no heartbeat for 3.2s (--heartbeat-timeout 3)"


def test_rank_that_never_beat_is_not_judged_by_heartbeats():
    watch = HangWatch(heartbeat_timeout=3)  # still importing torch, or a script without the library
    watch.restart(0, beats=0, now=0)
    assert watch.observe(0, beats=0, activity=(), now=100) == ""


def test_replacement_inherits_the_counter_and_is_judged_from_its_own_first_beat():
    watch = HangWatch(heartbeat_timeout=3)
    watch.restart(1, beats=40, now=100)  # the old process beat 40 times
    assert watch.observe(1, beats=40, activity=(), now=110) == ""  # the new one has not beaten yet
    assert watch.observe(1, beats=41, activity=(), now=111) == ""
    assert watch.observe(1, beats=41, activity=(), now=114.5).startswith("no heartbeat for 3.5s")


def test_cpu_activity_does_not_hide_a_missing_heartbeat():
    watch = HangWatch(heartbeat_timeout=3, hang_timeout=60)
    watch.restart(0, beats=0, now=0)
    watch.observe(0, beats=1, activity=(5, 0, 1.0), now=1)
    assert watch.observe(0, beats=1, activity=(6, 0, 2.0), now=5).startswith("no heartbeat")


def test_stopped_plain_script_silent_past_the_hang_timeout_is_a_hang():
    watch = HangWatch(heartbeat_timeout=3, hang_timeout=2)
    watch.restart(0, beats=0, now=0)
    assert watch.observe(0, beats=0, activity=(3, 0, 0.5), now=1, stopped=True) == ""
    assert watch.observe(0, beats=0, activity=(3, 0, 0.5), now=2.5, stopped=True) == ""
    assert watch.observe(0, beats=0, activity=(3, 0, 0.5), now=3.2, stopped=True) == (
        "stopped, with no output and no CPU progress for 2.2s (--hang-timeout 2)"
    )


def test_sleeping_plain_script_gets_more_time_than_a_stopped_one():
    watch = HangWatch(heartbeat_timeout=3, hang_timeout=2)  # it may be waiting for the stopped one
    watch.restart(0, beats=0, now=0)
    watch.observe(0, beats=0, activity=(3, 0, 0.5), now=1)
    assert watch.observe(0, beats=0, activity=(3, 0, 0.5), now=3.2) == ""
    assert watch.observe(0, beats=0, activity=(3, 0, 0.5), now=4.7) == (
        "no output and no CPU progress for 3.7s (--hang-timeout 2)"
    )


def test_plain_script_that_prints_or_computes_is_alive():
    watch = HangWatch(heartbeat_timeout=3, hang_timeout=2)
    watch.restart(0, beats=0, now=0)
    for t in range(1, 10):
        assert watch.observe(0, beats=0, activity=(t, 0, 0.5), now=t) == ""  # output only
    for t in range(10, 20):
        assert watch.observe(0, beats=0, activity=(9, 0, float(t)), now=t) == ""  # CPU only


def test_hang_timeout_off_never_judges_a_plain_script():
    watch = HangWatch(heartbeat_timeout=3, hang_timeout=0)
    watch.restart(0, beats=0, now=0)
    assert watch.observe(0, beats=0, activity=(), now=1e6) == ""


def test_plain_script_without_py_spy_gets_no_stack_dump_and_says_how_to_get_one(monkeypatch, caplog):
    import types

    from ftrun.agent import stacks

    monkeypatch.setattr(stacks.shutil, "which", lambda name: None)
    worker = types.SimpleNamespace(pid=2**22 + 1, placement=types.SimpleNamespace(rank=1))  # no such process
    stacks.dump_stack(worker, uses_library=False)
    assert any("rank 1: no stack dump (install py-spy" in r.getMessage() for r in caplog.records)
