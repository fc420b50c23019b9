"""A plain script's step, read from its output: the outside view of a rank that does not use the worker library.

A script without ``ftrun.elastic`` tells ftrun nothing of its steps, but most print them: ``step 12``,
``Step: 12/400``, ``iter 12``, ``[12/400]``, a tqdm bar's ``| 12/400 [``. :func:`step_in_line` reads those
shapes and nothing else: a number that is not clearly a step counts nothing (``epoch 3``, ``loss 0.25``,
``12 steps``, ``max_step=1000``, ``step 0.5``, ``step_time 3``, ``Epoch [1/10]``, a build tool's
``[3/40] Building``), since a wrong step is worse than none: the status would show progress that is not.

What it cannot see: a script that prints no step, or prints it every thousand steps; a tqdm bar redraws its
line with carriage returns, and ftrun reads a line when it ends, so a bar is read when its line ends (at its
close, or when something else prints a newline). Said as "from output" wherever it shows.

No clock or process here: the agent's output pumps feed :class:`OutputSteps` with the time they read a line.
"""

from __future__ import annotations

import re
import threading

#: characters of a line looked at (a step is said near a line's start; a long line costs the regexes)
LOOKED_AT = 240
#: a whole number that is not the start of a float, a thousands group or a word (12s, 1e3, 0.5, 1,000)
_NUMBER = r"(\d{1,12})(?![\d.,]*\d)(?![A-Za-z_%])"
#: "/400" after the step: the total, which the step may not pass
_TOTAL = r"(?:\s*/\s*(\d{1,12})(?!\d))?"
#: step or iter(ation) as a word of its own (not max_step, warmup_steps, iters/s), then the number, maybe bracketed
_KEYWORD = re.compile(r"(?<![\w])(?:global[ _])?(?:step|iter|iteration)\s*(?:[:=#]\s*)?\[?\s*" + _NUMBER + _TOTAL,
                      re.IGNORECASE)
#: a tqdm bar: "| 12/400 ["
_TQDM = re.compile(r"\|\s*(\d{1,12})/(\d{1,12}) \[")
#: "[12/400]", not after an epoch's word, not a build tool's progress (ninja's "[3/40] Building CXX object")
_BRACKET = re.compile(r"\[\s*(\d{1,12})\s*/\s*(\d{1,12})\s*\](?!\s*(?:Building|Linking|Compiling|Generating|Installing)\b)")
_EPOCH_BEFORE = re.compile(r"epoch\W*$", re.IGNORECASE)


def step_in_line(line: str) -> int | None:
    """The step a line of output says, or None where it says none clearly."""
    text = line.rsplit("\r", 1)[-1][:LOOKED_AT]  # a line redrawn with carriage returns: its last drawing
    match = _KEYWORD.search(text)
    if match:
        return _within(match.group(1), match.group(2))
    match = _TQDM.search(text)
    if match:
        return _within(match.group(1), match.group(2))
    for match in _BRACKET.finditer(text):
        if not _EPOCH_BEFORE.search(text[:match.start()]):
            return _within(match.group(1), match.group(2))
    return None


def _within(step: str, total: str | None) -> int | None:
    """The step, unless a total says it is none (past the total, or a total of 0)."""
    if total is not None and not 0 <= int(step) <= int(total):
        return None
    return int(step)


class OutputSteps:
    """One rank's last step read from its output, and when (the pump's clock), shared by its stdout's and
    stderr's pumps (each in its own thread: the pair is replaced whole, under a lock)."""

    def __init__(self) -> None:
        self._last: tuple[int, float] | None = None
        self._lock = threading.Lock()

    def read(self, line: str, now: float) -> None:
        step = step_in_line(line)
        if step is not None:
            with self._lock:
                self._last = (step, now)

    @property
    def last(self) -> tuple[int, float] | None:
        """(step, when it was read), or None before the first."""
        with self._lock:
            return self._last
