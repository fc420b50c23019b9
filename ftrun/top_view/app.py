"""``ftrun top``'s terminal application (textual): a rank table over a pane that shows the opened rank,
its stack, the event log or the help, and one line for answers. ``ControllerTopApp`` is the same view on
the controller's own terminal (``ftrun.top_view.attached``).

Every store read happens in the refresh timer (once a second, twice while a stack is awaited); keys only
change what is shown, or send one request. A store that stops answering under --rdzv-backend etcd is looked
for in a thread of its own (``ftrun-top-follow``) while the view keeps its keys; the reads start again on
the new controller's store.
"""

from __future__ import annotations

import os
import threading
import time

from rich.text import Text
from textual import events
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.css.query import NoMatches
from textual.screen import ModalScreen
from textual.widgets import DataTable, Footer, Input, Static

from ftrun.errors import ExitCode
from ftrun.live_view import job_line, moved_line, stall_lines, straggler_lines
from ftrun.live_view import render as status_render
from ftrun.messages import OperatorAction
from ftrun.store import StoreUnavailable
from ftrun.top_view import panes
from ftrun.top_view.source import JobSource, NoToken

#: seconds between reads of the store
REFRESH_EVERY = 1.0
#: how long to wait for an agent's stack before saying it did not come
STACK_DEADLINE = 15.0
ACTIONS = {"r": OperatorAction.RESTART, "d": OperatorAction.DRAIN, "x": OperatorAction.STOP}
STORE_GONE = "the job's store does not answer (the job ended, or its host is gone); q leaves"
LOOKING = "the job's store does not answer; looking for its controller in etcd…"
ENDED = "the job has ended; q leaves"


class Confirm(ModalScreen[bool]):
    """y or n to an action that changes the job."""

    BINDINGS = [Binding("y", "answer(True)", "yes"), Binding("n,escape", "answer(False)", "no")]
    DEFAULT_CSS = """
    Confirm { align: center middle; }
    Confirm > Static { width: auto; max-width: 90%; border: heavy $warning; padding: 1 2; background: $panel; }
    """

    def __init__(self, question: str):
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        yield Static(f"{self.question}?  [b]y[/b]es / [b]n[/b]o")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)


class TopApp(App):
    """The view of one job; ``source`` is its store."""

    TITLE = "ftrun top"
    CSS = """
    #job { height: auto; }
    #ranks { height: auto; max-height: 45%; }
    #pane { height: 1fr; border-top: solid $primary; }
    #filter { display: none; }
    #message { height: 1; color: $warning; }
    """
    BINDINGS = [
        Binding("j,down", "move(1)", "down", show=False), Binding("k,up", "move(-1)", "up", show=False),
        Binding("enter", "show('detail')", "open"), Binding("s", "stack", "stack"),
        Binding("e", "show('events')", "events"), Binding("slash", "filter", "filter"),
        Binding("question_mark", "show('help')", "help"), Binding("escape", "clear_filter", show=False),
        Binding("q", "quit", "quit"), Binding("r", "act('r')", "restart"), Binding("d", "act('d')", "drain"),
        Binding("x", "act('x')", "stop"),
    ]

    #: what the refusal of an action without the token says to do
    TOKEN_HINT = panes.TOKEN_HINT
    HELP = panes.HELP

    def __init__(self, source: JobSource):
        super().__init__()
        self.source = source
        self.snapshot: dict = {}
        self.mode = "detail"
        self.wanted = ""
        self.rank_order: list[int] = []
        #: (rank, nonce, when asked) of the stack awaited, and the answer once it came
        self.stack_asked: tuple[int, str, float] | None = None
        self.stack_answer: dict | None = None
        #: the store went and the controller's new one is looked for (--rdzv-backend etcd): no reads meanwhile
        self.following = False
        #: a look that found no controller in its time: the view says the store is gone, and stays so
        self.gave_up = False

    def compose(self) -> ComposeResult:
        yield Static(id="job")
        yield DataTable(id="ranks", cursor_type="row", zebra_stripes=False)
        with VerticalScroll(id="pane"):
            yield Static(id="body")
        yield Input(placeholder="filter the events (Enter keeps it, Escape clears it)", id="filter")
        yield Static(id="message")
        yield Footer()

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns(*panes.RANK_COLUMNS)
        table.focus()
        self.refresh_data()
        self.set_interval(REFRESH_EVERY / 2, self._tick)

    def _tick(self) -> None:
        if self.stack_asked is not None and self.stack_answer is None or int(time.monotonic() * 2) % 2 == 0:
            try:
                self.refresh_data()
            except NoMatches:  # a tick as the view closes, its widgets already gone (seen under load)
                pass

    # --- reading -------------------------------------------------------------------------------------------

    def refresh_data(self) -> None:
        if self.following:
            return
        try:
            snapshot = self.source.snapshot()
            events = self.source.read_events()
            if self.stack_asked is not None and self.stack_answer is None:
                rank, nonce, asked = self.stack_asked
                self.stack_answer = self.source.stack(rank, nonce)
                if self.stack_answer is None and time.monotonic() - asked > STACK_DEADLINE:
                    self.stack_answer = {"lines": [f"no stack came from rank {rank}'s agent in {STACK_DEADLINE:g}s"]}
            detail = self._detail(events) if self.mode == "detail" else None
        except StoreUnavailable:
            self._store_went()
            return
        if not snapshot and not self.snapshot:
            self.query_one("#job", Static).update(status_render({}))  # the rendezvous runs
        if snapshot:
            self.snapshot = snapshot
            self._fill_table()
            line = job_line(snapshot, self.size.width or 120)
            for straggler in [*stall_lines(snapshot), *straggler_lines(snapshot)]:
                line.append("\n")
                line.append_text(straggler)
            self.query_one("#job", Static).update(line)
            if snapshot["phase"] == "done":
                self.say(ENDED)
        self._draw(events, detail)

    def _store_went(self) -> None:
        """The store stopped answering: the job ended, its host is gone, or (--rdzv-backend etcd, the job not
        ending) its controller moved: looked for in a thread of its own, for a bounded time (the source's)."""
        if self.source.follows and self.snapshot.get("phase") not in ("exiting", "done") and not self.gave_up:
            self.following = True
            self.say(LOOKING)
            threading.Thread(target=self._follow, name="ftrun-top-follow", daemon=True).start()
        else:
            self.say(STORE_GONE)

    def _follow(self) -> None:
        host = self.source.follow()
        try:
            self.call_from_thread(self._followed, host)
        except RuntimeError:
            pass  # the view left meanwhile

    def _followed(self, host: str) -> None:
        self.following = False
        if not host:
            self.gave_up = True
            self.say(STORE_GONE)
            return
        self.say(moved_line(host))
        self.refresh_data()

    def _fill_table(self) -> None:
        table = self.query_one(DataTable)
        rows = panes.rank_rows(self.snapshot)
        selected = self.selected_rank()
        order = [rank for rank, _ in rows]
        if order != self.rank_order:
            table.clear()
            for rank, cells in rows:
                table.add_row(*cells, key=str(rank))
            self.rank_order = order
            if selected in order:
                table.move_cursor(row=order.index(selected))
        else:
            for rank, cells in rows:
                for column, cell in zip(table.columns, cells):
                    table.update_cell(str(rank), column, cell)

    def _detail(self, events: list[dict]) -> Text:
        rank = self.selected_rank()
        if rank is None:
            return Text("waiting for the job's ranks…", style="dim")
        node = panes.node_of(self.snapshot, rank) or {}
        output = self.source.output(node.get("agent", "")).get(str(rank), [])
        history = self.source.history().get(str(rank), [])
        return panes.rank_detail(self.snapshot, rank, output, history, events)

    def _draw(self, events: list[dict], detail: Text | None = None) -> None:
        body = self.query_one("#body", Static)
        if self.mode == "detail" and detail is not None:
            body.update(detail)
        elif self.mode == "stack" and self.stack_asked is not None:
            body.update(panes.stack_pane(self.stack_asked[0], self.stack_answer))
        elif self.mode == "events":
            body.update(panes.event_pane(events, self.wanted))
            self.query_one("#pane", VerticalScroll).scroll_end(animate=False)
        elif self.mode == "help":
            body.update(Text(self.HELP))

    def selected_rank(self) -> int | None:
        table = self.query_one(DataTable)
        if not self.rank_order or table.cursor_row < 0 or table.cursor_row >= len(self.rank_order):
            return None
        return self.rank_order[table.cursor_row]

    def say(self, line: str) -> None:
        self.query_one("#message", Static).update(Text(line))

    # --- keys ----------------------------------------------------------------------------------------------

    def action_move(self, by: int) -> None:
        table = self.query_one(DataTable)
        if by > 0:
            table.action_cursor_down()
        else:
            table.action_cursor_up()
        if self.mode == "detail":
            self.refresh_data()

    def on_data_table_row_selected(self, _event: DataTable.RowSelected) -> None:
        self.action_show("detail")  # Enter on the table

    def action_show(self, mode: str) -> None:
        self.mode = mode
        self.say("")
        self.refresh_data()

    def action_stack(self) -> None:
        rank = self.selected_rank()
        node = panes.node_of(self.snapshot, rank) if rank is not None else None
        if node is None:
            self.say("no rank selected")
            return
        try:
            nonce = self.source.ask_for_stack(node["agent"], rank)
        except StoreUnavailable:
            self.say("the job's store does not answer")
            return
        self.stack_asked, self.stack_answer = (rank, nonce, time.monotonic()), None
        self.action_show("stack")

    def action_filter(self) -> None:
        if self.mode != "events":
            self.action_show("events")
        box = self.query_one("#filter", Input)
        box.display = True
        box.value = self.wanted
        box.focus()

    def _filtering(self) -> bool:
        """The filter box is open: what is typed goes into it, even before it has the focus."""
        try:
            return bool(self.query_one("#filter", Input).display)
        except NoMatches:
            return False

    def check_action(self, action: str, parameters: tuple) -> bool | None:
        # the focus moves to the box a moment after "/": letters typed right behind it reach the table first,
        # and an "r" there would open the restart dialog
        return action in ("filter", "clear_filter") or not self._filtering()

    def on_key(self, event: events.Key) -> None:
        box = self.query_one("#filter", Input)
        if not self._filtering() or box.has_focus:
            return
        if event.key == "enter":
            self._close_filter()
            event.stop()
        elif event.is_printable and event.character:
            box.insert_text_at_cursor(event.character)
            event.stop()

    def on_input_changed(self, event: Input.Changed) -> None:
        self.wanted = event.value
        self._draw(self.source.events)

    def on_input_submitted(self, _event: Input.Submitted) -> None:
        self._close_filter()

    def action_clear_filter(self) -> None:
        self.wanted = ""
        self._close_filter()
        self._draw(self.source.events)

    def _close_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.display = False
        self.query_one(DataTable).focus()

    def action_act(self, key: str) -> None:
        if not self.source.has_token:
            self.say(panes.refusal(key, self.TOKEN_HINT))
            return
        rank = self.selected_rank()
        node = panes.node_of(self.snapshot, rank) if rank is not None else None
        if key != "x" and node is None:
            self.say("no rank selected")
            return
        node_rank = node["node"] if node else -1
        question = panes.ACTION_WORDS[key].format(rank=rank, node=node_rank)

        def answered(yes: bool | None) -> None:
            if not yes:
                self.say(f"not done: {question}")
                return
            try:
                self.source.ask(ACTIONS[key], rank if rank is not None else -1, node_rank)
            except (NoToken, StoreUnavailable) as e:
                self.say(f"not sent: {e}")
                return
            self.say(f"asked the controller to {question}; its answer goes to the event log (e)")

        self.push_screen(Confirm(question[0].upper() + question[1:]), answered)


class ControllerTopApp(TopApp):
    """The view on the controller's own terminal. Ctrl-C stops the job there as it does outside the view
    (the app leaves with status 130 and the controller takes it as its own Ctrl-C), and the view leaves
    by itself when the controller closes ``lifeline`` (the job is ending, or the controller is gone)."""

    TITLE = "ftrun"
    TOKEN_HINT = panes.JOB_TOKEN_HINT
    HELP = panes.HELP + "\n  Ctrl-C         stop the job (as outside the view)"
    BINDINGS = [Binding("q", "quit", "leave"),
                Binding("ctrl+c", "interrupt", "stop the job", show=False, priority=True)]
    #: the exit status that asks the controller to stop the job
    INTERRUPTED = int(ExitCode.INTERRUPTED)

    def __init__(self, source: JobSource, lifeline: int):
        super().__init__(source)
        #: the read end of the controller's pipe (the app owns it from now on)
        self.lifeline = lifeline

    def on_mount(self) -> None:  # textual calls TopApp's on_mount too
        threading.Thread(target=self._watch_lifeline, name="ftrun-top-lifeline", daemon=True).start()

    def _watch_lifeline(self) -> None:
        """Until the lifeline's end (this thread owns the descriptor, and closes it)."""
        try:  # the bare descriptor: nothing more comes on it but its end
            while os.read(self.lifeline, 4096):
                pass
        except OSError:
            pass
        finally:
            os.close(self.lifeline)
        if self.is_running:
            try:
                self.call_from_thread(self.exit)
            except RuntimeError:
                pass  # it left meanwhile

    def action_interrupt(self) -> None:
        self.exit(return_code=self.INTERRUPTED)
