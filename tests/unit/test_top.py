"""ftrun top's pure parts: the operator's requests in the recovery policy, the panes' text, and the
application's keys driven by textual's pilot against a fake store."""

from __future__ import annotations

import asyncio
import os

import pytest

from ftrun.agent.stacks import current_thread_first
from ftrun.controller.states import JobView, Level, Phase
from ftrun.controller.policy import on_operator, operator_refusal
from ftrun.errors import ExitCode
from ftrun.messages import CommandKind, OperatorAction, OperatorRequest
from ftrun.top_view import panes

RESTART = OperatorRequest(OperatorAction.RESTART, "ana@laptop", rank=3)
DRAIN = OperatorRequest(OperatorAction.DRAIN, "ana@laptop", node_rank=1)
STOP = OperatorRequest(OperatorAction.STOP, "ana@laptop")


def process_view(**fields):
    fields = {"library_ranks": 4, "max_restarts": 3, **fields}
    return JobView(node_count=2, world_size=4, recovery=Level.PROCESS, **fields)


# --- the policy ----------------------------------------------------------------------------------------------

def test_transition_running_to_stopping_on_a_restart_drill_replaces_only_that_rank():
    view, commands = on_operator(process_view(), RESTART, node_rank=1, local_rank=1, host="h1", pid=42, at=1234.5)
    assert (view.phase, view.level, view.generation, view.restarts_used) == (Phase.STOPPING, Level.PROCESS, 1, 1)
    assert [(c.kind, c.ranks) for c in commands] == [(CommandKind.REPLACE, (3,))]
    drill = view.failures[-1]
    # dated by the controller: the repair's time is measured from it (0 made it "1795518353s")
    assert (drill.rank, drill.node_rank, drill.pid, drill.cause, drill.timestamp) == (3, 1, 42, "drill", 1234.5)
    assert "restart drill asked by ana@laptop from ftrun top" in drill.describe()


def test_transition_running_to_exiting_when_the_operator_stops_the_job():
    view, commands = on_operator(process_view(), STOP)
    assert (view.phase, view.exit_code) == (Phase.EXITING, ExitCode.INTERRUPTED)
    assert "stopped by ana@laptop" in view.reason and commands[0].kind is CommandKind.EXIT


def test_a_drain_hands_the_node_to_the_spare_and_replaces_its_ranks_at_process_level():
    view, commands = on_operator(process_view(), DRAIN, spare="spare-1", ranks=(2, 3))
    assert [c.kind for c in commands] == [CommandKind.TAKEOVER, CommandKind.REPLACE]
    assert commands[0].agent_id == "spare-1" and commands[1].ranks == (2, 3)
    assert "drained (asked by ana@laptop" in view.reason


@pytest.mark.parametrize("name, request_, view, signed, spare, words", [
    ("unsigned", RESTART, process_view(), False, "", "has no token"),
    ("repairing", RESTART, process_view().move(Phase.STOPPING), True, "", "a repair is under way"),
    ("no-budget", RESTART, process_view(restarts_used=3), True, "", "budget is spent"),
    ("no-such-rank", OperatorRequest(OperatorAction.RESTART, "a", rank=9), process_view(), True, "", "no rank 9"),
    ("no-spare", DRAIN, process_view(), True, "", "no idle spare"),
    ("no-such-node", OperatorRequest(OperatorAction.DRAIN, "a", node_rank=5), process_view(), True, "s", "no node 5"),
    ("ending", STOP, process_view().move(Phase.EXITING), True, "", "the job is ending"),
], ids=lambda value: value if isinstance(value, str) and " " not in value else None)
def test_operator_requests_refused(name, request_, view, signed, spare, words):
    assert words in operator_refusal(view, request_, signed, spare)


@pytest.mark.parametrize("request_", [RESTART, STOP])
def test_operator_requests_accepted(request_):
    assert operator_refusal(process_view(), request_, True) == ""


def test_a_stop_is_taken_during_a_repair():
    assert operator_refusal(process_view().move(Phase.STOPPING), STOP, True) == ""


# --- the panes -------------------------------------------------------------------------------------------------

SNAPSHOT = {
    "run_id": "train7", "time": 0, "elapsed": 12.0, "generation": 0, "phase": "running", "level": "", "phase_for": 3.0,
    "recovery": "process", "restarts_used": 0, "max_restarts": 3, "world_size": 4, "step": 41, "steps_per_s": 9.5,
    "total_steps": None, "eta_s": None, "reason": "", "exit_code": None, "events": [],
    "nodes": [{"node": n, "host": f"gpu{n}", "agent": f"agent{n}", "role": "active", "state": "running",
               "ranks_total": 2, "ranks_alive": 2, "standbys": 0,
               "devices": [{"index": 0, "health": "isolated" if n else "ok", "reason": "UCE 0x80E01801" if n else ""}]}
              for n in (0, 1)],
    "ranks": [{"rank": r, "node": r // 2, "pid": 100 + r, "alive": True, "restarts": int(r == 3), "step": 41 + r % 2,
               "heartbeat_age": 0.4} for r in (2, 0, 3, 1)],
}


def test_rank_rows_by_node_then_rank():
    rows = panes.rank_rows(SNAPSHOT)
    assert [rank for rank, _ in rows] == [0, 1, 2, 3]
    assert rows[3][1] == ("3", "1", "gpu1", "103", "alive", "42", "0.4s ago", "1", "-", "-", "-")


def test_rank_detail_shows_output_history_device_and_faults():
    events = [{"kind": "fault", "rank": 3, "elapsed": 5.0, "detail": "rank 3 killed by SIGKILL"},
              {"kind": "fault", "rank": 2, "elapsed": 6.0, "detail": "rank 2 exit code 1"}]
    text = panes.rank_detail(SNAPSHOT, 3, [f"line {i}" for i in range(30)], [[10, 40, 0.2], [12, 42, 0.4]], events).plain
    assert "rank 3 · node 1 (gpu1) · pid 103 · restarts 1" in text
    assert "0:isolated UCE 0x80E01801" in text
    assert "+12s step 42 beat 0.4s" in text
    assert "rank 3 killed by SIGKILL" in text and "rank 2" not in text
    assert "line 29" in text and "line 9\n" not in text  # the last 20 of the 30 lines
    assert "20 of the last 30 lines" in text


def test_event_pane_filters_by_kind_or_detail():
    events = [{"kind": "fault", "elapsed": 1.0, "detail": "rank 3 killed"},
              {"kind": "repair_done", "elapsed": 2.0, "detail": "generation 1 resumed"},
              {"kind": "operator", "elapsed": 0.5, "detail": "ana asked for a restart drill of rank 3"}]
    assert "3 of 3" in panes.event_pane(events).plain
    shown = panes.event_pane(events, "REPAIR").plain
    assert "1 of 3 matching 'REPAIR'" in shown and "resumed" in shown and "killed" not in shown
    assert "drill" in panes.event_pane(events, "drill").plain


def test_stack_pane_before_and_after_the_answer():
    assert "asking its agent" in panes.stack_pane(3, None).plain
    assert "rank 3 stack (py-spy)\n  Thread 1 (active): MainThread" in panes.stack_pane(
        3, {"how": "py-spy", "lines": ["Thread 1 (active): MainThread"]}).plain


def test_faulthandler_dump_gets_the_current_thread_first():
    dump = ["Thread 0x1 (most recent call first):", '  File "a.py", line 1 in beat', "",
            "Current thread 0x2 (most recent call first):", '  File "train.py", line 9 in main']
    assert current_thread_first(dump)[:2] == ["Current thread 0x2 (most recent call first):",
                                              '  File "train.py", line 9 in main']


# --- the application, through textual's pilot -----------------------------------------------------------------

class FakeSource:
    """The store as JobSource shows it, in memory; what the view asks for is recorded."""

    def __init__(self, has_token: bool):
        self.has_token = has_token
        self.events: list[dict] = [{"kind": "job_started", "elapsed": 0.0, "detail": "2 nodes, 4 ranks", "rank": None}]
        self.asked: list[tuple] = []
        self.stacks: list[tuple[str, int]] = []

    def snapshot(self):
        return SNAPSHOT

    def read_events(self):
        return self.events

    def output(self, agent_id):
        return {"3": ["rank 3 step 41 loss 0.5"]} if agent_id == "agent1" else {}

    def history(self):
        return {}

    def ask_for_stack(self, agent_id, rank):
        self.stacks.append((agent_id, rank))
        return "n1"

    def stack(self, rank, nonce):
        return {"nonce": nonce, "how": "py-spy", "lines": ["main (train.py:9)"]}

    def ask(self, action, rank=-1, node_rank=-1):
        self.asked.append((action, rank, node_rank))


async def press_each(pilot, keys) -> None:
    """Press ``keys`` one by one, letting the view settle before and after each."""
    await pilot.pause()
    for key in keys:
        await pilot.press(key)
        await pilot.pause()


def drive(source: FakeSource, *keys: str) -> str:
    """Press ``keys`` in the view of ``source``; the pane's text and the message line afterwards."""
    from textual.widgets import Static

    from ftrun.top_view.app import TopApp

    async def run() -> str:
        app = TopApp(source)  # type: ignore[arg-type]
        async with app.run_test(size=(120, 40)) as pilot:
            await press_each(pilot, keys)
            body = str(app.query_one("#body", Static).render())
            return body + "\n" + str(app.query_one("#message", Static).render())

    return asyncio.run(run())


def test_app_opens_the_selected_rank_with_its_output():
    shown = drive(FakeSource(False), "j", "j", "j", "enter")
    assert "rank 3 · node 1 (gpu1)" in shown and "rank 3 step 41 loss 0.5" in shown


def test_app_asks_the_ranks_agent_for_its_stack():
    source = FakeSource(False)
    shown = drive(source, "down", "s")
    assert source.stacks == [("agent0", 1)] and "main (train.py:9)" in shown


def test_app_refuses_an_action_without_the_token_in_one_line():
    source = FakeSource(False)
    shown = drive(source, "r")
    assert panes.refusal("r") in shown and source.asked == []


def test_app_restart_asks_first_and_sends_on_yes_only():
    source = FakeSource(True)
    drive(source, "j", "r", "n")
    assert source.asked == []
    shown = drive(source, "j", "j", "j", "r", "y")
    assert source.asked == [(OperatorAction.RESTART, 3, 1)] and "asked the controller to restart rank 3" in shown


def test_app_drain_and_stop_name_the_node_and_the_job():
    source = FakeSource(True)
    drive(source, "d", "y")
    drive(source, "x", "y")
    assert source.asked == [(OperatorAction.DRAIN, 0, 0), (OperatorAction.STOP, 0, 0)]


def test_app_event_log_with_a_filter_and_help():
    source = FakeSource(False)
    source.events.append({"kind": "fault", "elapsed": 1.0, "detail": "rank 3 killed by SIGKILL", "rank": 3})
    assert "matching 'sig'" in drive(source, "e", "slash", "s", "i", "g", "enter")
    assert "leave the view (the job goes on)" in drive(source, "question_mark")


def test_app_filter_takes_what_is_typed_right_behind_the_slash():
    """A fast typist's letters arrive before the box has the focus: they go into it, and none of them (the
    "r" here) acts on the table."""
    from textual.widgets import Input

    from ftrun.top_view.app import TopApp

    async def run() -> tuple[str, bool, str]:
        source = FakeSource(True)
        app = TopApp(source)  # type: ignore[arg-type]
        async with app.run_test(size=(120, 40)) as pilot:
            await press_each(pilot, ["e"])
            for key in ("slash", "r", "e", "p", "enter"):  # no pause between them
                app.simulate_key(key)
            await pilot.pause()
            box = app.query_one("#filter", Input)
            return box.value, bool(box.display), type(app.screen).__name__ + repr(source.asked)

    assert asyncio.run(run()) == ("rep", False, "Screen[]")


# --- the same view on the controller's own terminal ------------------------------------------------------------

def drive_controller_view(source: FakeSource, *keys: str, close_lifeline: bool = False) -> tuple[int | None, str]:
    """Press ``keys`` in the controller's view (then close its lifeline); its exit status (None while it
    runs on) and the message line."""
    from textual.widgets import Static

    from ftrun.top_view.app import ControllerTopApp

    async def run() -> tuple[int | None, str]:
        read, write = os.pipe()
        app = ControllerTopApp(source, read)  # type: ignore[arg-type]  (the app closes ``read``)
        try:
            async with app.run_test(size=(120, 40)) as pilot:
                await press_each(pilot, keys)
                message = str(app.query_one("#message", Static).render())
                if close_lifeline:
                    os.close(write)
                    write = -1
                    for _ in range(100):  # the lifeline's thread asks the app to leave
                        if app.return_code is not None:
                            break
                        await asyncio.sleep(0.05)
                return app.return_code, message
        finally:
            if write >= 0:
                os.close(write)

    return asyncio.run(run())


def test_controller_view_ctrl_c_leaves_with_the_status_that_stops_the_job():
    code, _ = drive_controller_view(FakeSource(True), "ctrl+c")
    assert code == ExitCode.INTERRUPTED


def test_controller_view_leaves_when_the_controller_closes_its_lifeline():
    code, _ = drive_controller_view(FakeSource(True), close_lifeline=True)
    assert code == 0


def test_controller_view_without_a_token_says_the_job_has_none():
    _, message = drive_controller_view(FakeSource(False), "r")
    assert message == panes.refusal("r", panes.JOB_TOKEN_HINT) and "start it with --token-file" in message


@pytest.mark.parametrize(("mode", "terminals", "wanted"), [
    ("auto", (True, True, True), True),
    ("live", (True, True, True), True),
    ("auto", (False, True, True), False),  # < /dev/null: the live view that takes no keys
    ("live", (True, False, True), False),  # --status live into a file: drawn anyway, without keys
    ("plain", (True, True, True), False),
    ("off", (True, True, True), False),
])
def test_interactive_view_is_wanted_on_a_terminal_only(mode, terminals, wanted):
    from ftrun.top_view.attached import interactive_wanted

    assert interactive_wanted(mode, terminals) is wanted


def test_controller_view_without_textual_says_how_to_get_it_once_and_keeps_the_live_view(monkeypatch, capsys):
    from types import SimpleNamespace

    from ftrun.top_view import attached

    started = []
    monkeypatch.setattr(attached, "interactive_wanted", lambda mode: True)
    monkeypatch.setattr(attached, "textual_installed", lambda: False)
    monkeypatch.setattr(attached, "status_view", lambda controller, mode: started.append(mode) or "the live view")
    controller = SimpleNamespace(status={}, store=SimpleNamespace(endpoint="h:1"), keys=SimpleNamespace(run_id="r"))
    assert attached.controller_view(controller, "auto", b"token") == "the live view" and started == ["auto"]
    said = capsys.readouterr().err.strip().splitlines()
    assert said == [attached.INSTALL_HINT] and "pip install 'textual>=8.0'" in said[0]


# --- a store that moves with the controller (--rdzv-backend etcd) ---------------------------------------------

class MovingSource(FakeSource):
    """A store that stops answering; ``follow`` finds the controller on ``host`` ("": none came)."""

    def __init__(self, follows: bool, host: str):
        super().__init__(False)
        self.follows, self.host = follows, host
        self.looks = 0

    def snapshot(self):
        from ftrun.store import StoreUnavailable

        if not self.looks or not self.host:
            raise StoreUnavailable("the control store at 127.0.0.2:29500 stopped answering")
        return {**SNAPSHOT, "step": 99, "controller": {"host": self.host, "moves": 1}}

    def follow(self):
        self.looks += 1
        return self.host


def watch_the_store_go(source: MovingSource) -> tuple[str, str]:
    """The view of ``source`` until it has looked for the controller: its message line and its job line."""
    from textual.widgets import Static

    from ftrun.top_view.app import TopApp

    async def run() -> tuple[str, str]:
        app = TopApp(source)  # type: ignore[arg-type]
        async with app.run_test(size=(200, 40)) as pilot:
            for _ in range(100):  # the look runs in a thread of its own, then hands the view its answer
                await pilot.pause()
                if not app.following:
                    break
                await asyncio.sleep(0.02)
            app.refresh_data()  # one more read: after a look that found none, no other look
            return str(app.query_one("#message", Static).render()), str(app.query_one("#job", Static).render())

    return asyncio.run(run())


def test_top_follows_the_controller_to_its_new_store_and_says_so_once():
    source = MovingSource(True, "127.0.0.3")
    message, job = watch_the_store_go(source)
    assert message == "the controller moved to 127.0.0.3; following it" and source.looks == 1
    assert "step 99" in job and "controller on 127.0.0.3 (moved 1x)" in job


def test_top_gives_up_when_no_controller_came_and_says_the_store_does_not_answer():
    source = MovingSource(True, "")
    message, _ = watch_the_store_go(source)
    assert message.startswith("the job's store does not answer (the job ended") and source.looks == 1


def test_top_of_a_c10d_job_does_not_look_for_the_controller():
    source = MovingSource(False, "127.0.0.3")
    message, _ = watch_the_store_go(source)
    assert message.startswith("the job's store does not answer (the job ended") and source.looks == 0


def test_a_followed_source_keeps_the_events_read_and_reads_the_new_controllers_from_its_first_batch():
    import datetime
    import json

    from torch.distributed import TCPStore

    from ftrun.config import Endpoint
    from ftrun.keys import JobKeys
    from ftrun.store import ControlStore
    from ftrun.top_view.source import JobSource

    keys = JobKeys("job1")

    def store_with(*batches: list[dict]) -> ControlStore:
        raw = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=5))
        store = ControlStore(raw, Endpoint("127.0.0.1", raw.port), is_host=True)
        for index, batch in enumerate(batches):
            store.set_text(keys.event_batch(index), json.dumps(batch))
            store.add(keys.event_count)
        return store

    old = store_with([{"kind": "job_started"}], [{"kind": "fault"}])
    new = store_with([{"kind": "controller_moved"}])
    source = JobSource(old, keys, relocate=lambda: (new, "127.0.0.3"))
    assert [e["kind"] for e in source.read_events()] == ["job_started", "fault"]
    assert source.follows and source.follow() == "127.0.0.3" and source.store is new
    assert [e["kind"] for e in source.read_events()] == ["job_started", "fault", "controller_moved"]
    assert not JobSource(old, keys).follows and JobSource(old, keys).follow() == ""
