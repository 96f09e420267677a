"""A small progress bar for long jobs (stderr; redraws in place on a terminal, prints a line
every few seconds otherwise, so CI logs stay readable)."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int | None, desc: str = "", stream=None, min_interval: float = 0.2,
                 log_interval: float = 10.0, disable: bool = False):
        self.total, self.desc, self.n = total, desc, 0
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.min_interval = min_interval if self.tty else log_interval
        self.start = self._last = time.perf_counter()
        self.postfix = ""
        self.disable = disable
        self._drawn = -1  # self.n at the last draw

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def set_postfix(self, text: str) -> None:
        self.postfix = text

    def update(self, n: int = 1, postfix: str | None = None) -> None:
        self.n += n
        if postfix is not None:
            self.postfix = postfix
        now = time.perf_counter()
        if now - self._last >= self.min_interval or (self.total is not None and self.n >= self.total):
            self._last = now
            self._draw(now)

    def _draw(self, now: float, end: str = "") -> None:
        if self.disable:
            return
        self._drawn = self.n
        elapsed = now - self.start
        rate = self.n / elapsed if elapsed > 0 else 0.0
        if self.total:
            frac = min(1.0, self.n / self.total)
            bar = "#" * int(24 * frac) + "-" * (24 - int(24 * frac))
            eta = (self.total - self.n) / rate if rate > 0 else float("nan")
            text = f"{self.desc} [{bar}] {self.n}/{self.total} {elapsed:6.1f}s eta {eta:6.1f}s"
        else:
            text = f"{self.desc} {self.n} it {elapsed:6.1f}s ({rate:.2f} it/s)"
        if self.postfix:
            text += f" | {self.postfix}"
        if self.tty:
            self.stream.write("\r" + text.ljust(100) + end)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self._draw(time.perf_counter(), end="\n")
        elif self._drawn != self.n:
            self._draw(time.perf_counter())


def progress(iterable, total: int | None = None, desc: str = "", **kw):
    """Iterate with a progress bar: ``for x in progress(xs, desc="sweep"): ...``."""
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)
    with Progress(total, desc, **kw) as bar:
        for item in iterable:
            yield item
            bar.update()
