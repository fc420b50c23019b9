"""The one object that writes to the user's terminal, and the one way out."""

from __future__ import annotations

import logging
import sys
import traceback
from typing import NoReturn

from rich.console import Console
from rich.markup import escape

#: no emoji codes: a value the user gave ("--rdzv-endpoint a:b:c") is printed as given, not as "a🅱c"
console = Console(stderr=True, highlight=False, soft_wrap=True, emoji=False)
#: results a command was asked for (``ftrun probe``'s table or JSON) go to stdout, for pipes
out = Console(highlight=False, soft_wrap=True, emoji=False, width=None if sys.stdout.isatty() else 160)


def say(text: str, style: str | None = None) -> None:
    console.print(escape(text), style=style)


def abort(text: str, code: int) -> NoReturn:
    """Tell the user what went wrong in one line and leave with ``code``."""
    one_line = " ".join(text.splitlines())  # a value with a newline in it still makes one line
    console.print(f"ftrun: error: {escape(one_line)}", style="bold red")
    sys.exit(int(code))


class ConsoleLogHandler(logging.Handler):
    """Library log records, printed as ``ftrun: message`` through the console."""

    STYLES = {logging.WARNING: "yellow", logging.ERROR: "red", logging.CRITICAL: "bold red"}

    def emit(self, record: logging.LogRecord) -> None:
        try:
            console.print(f"ftrun: {escape(record.getMessage())}", style=self.STYLES.get(record.levelno))
            if record.exc_info and logging.getLogger(record.name).isEnabledFor(logging.DEBUG):  # FTRUN_LOG_LEVEL=DEBUG
                console.print(escape("".join(traceback.format_exception(*record.exc_info))), style="dim")
        except Exception:
            self.handleError(record)
