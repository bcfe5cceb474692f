"""A progress line for long data jobs: documents, tokens, input read and the rates, on stderr. On a terminal it is
redrawn in place twice a second; in a log (not a terminal) a line every 10 s. `finish()` prints the last one."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, what: str, stream=None):
        self.what = what
        self.stream = stream if stream is not None else sys.stderr
        self.docs = self.tokens = self.bytes = 0
        self.start = self._shown = time.perf_counter()
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every = 0.5 if self.tty else 10.0

    def add(self, docs: int, tokens: int, input_bytes: int) -> None:
        self.docs += docs
        self.tokens += tokens
        self.bytes += input_bytes
        now = time.perf_counter()
        if now - self._shown >= self.every:
            self._shown = now
            self._show(end="\r" if self.tty else "\n")

    def line(self) -> str:
        seconds = max(time.perf_counter() - self.start, 1e-9)
        return (f"{self.what}: {self.docs:,} documents, {self.tokens:,} tokens, {self.bytes / 1e6:,.1f} MB in "
                f"{seconds:.1f} s ({self.bytes / 1e6 / seconds:,.2f} MB/s, {self.tokens / seconds:,.0f} tokens/s)")

    def _show(self, end: str) -> None:
        self.stream.write(self.line() + end)
        self.stream.flush()

    def finish(self) -> None:
        self._show(end="\n")
