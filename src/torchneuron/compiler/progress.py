"""A progress line for bursts of compiles (pending, done, seconds), shown on a
terminal only: nothing is written when stderr is a file or a pipe."""

from __future__ import annotations

import contextlib
import sys
import threading

from .. import config


def _enabled() -> bool:
    mode = config.settings.progress
    if mode == "auto":
        return sys.stderr.isatty()
    return mode == "on"


# Eager code compiles one op at a time with lowering in between: a burst ends
# only after this long without a compile.
_IDLE_END = 1.0


class CompileProgress:
    def __init__(self):
        self._lock = threading.Lock()
        self._bar = None
        self._closer = None
        self.pending = 0
        self.done = 0

    @contextlib.contextmanager
    def compiling(self):
        self._start()
        try:
            yield
        finally:
            self._finish()

    def _start(self) -> None:
        with self._lock:
            if self._closer is not None:
                self._closer.cancel()
                self._closer = None
            self.pending += 1
            if self._bar is None and _enabled():
                from tqdm import tqdm

                # delay: a burst that finishes within half a second shows nothing.
                self._bar = tqdm(total=0, desc="neuron: compiling", unit=" executables", file=sys.stderr,
                                 delay=0.5, leave=False, dynamic_ncols=True,
                                 bar_format="{desc} {n_fmt}/{total_fmt} done, {postfix} [{elapsed}]")
            if self._bar is not None:
                self._bar.total = self.done + self.pending
                self._bar.set_postfix_str(f"{self.pending} pending", refresh=False)

    def _finish(self) -> None:
        with self._lock:
            self.pending -= 1
            self.done += 1
            if self._bar is not None:
                self._bar.set_postfix_str(f"{self.pending} pending", refresh=False)
                self._bar.update(1)
            if self.pending == 0:
                self._closer = threading.Timer(_IDLE_END, self._end_burst)
                self._closer.daemon = True
                self._closer.start()

    def _end_burst(self) -> None:
        with self._lock:
            if self.pending:
                return
            if self._bar is not None:
                self._bar.close()
                self._bar = None
            self.done = 0


progress = CompileProgress()
