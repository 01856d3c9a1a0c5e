"""Signals as a run and the commands take them: SIGTERM as Ctrl-C around what writes temporaries (TermInterrupts),
and the training loop's stop after its step (StopSignals). Each puts the handlers it found back on exit."""

from __future__ import annotations

import signal
import time


class TermInterrupts:
    """SIGTERM interrupts as SIGINT does (KeyboardInterrupt), where its default would end the process at once and
    leave what the setup made (a scratch store); the training loop's StopSignals takes over inside."""

    def __enter__(self) -> "TermInterrupts":
        def interrupt(signum, frame):
            raise KeyboardInterrupt

        try:
            self._old = signal.signal(signal.SIGTERM, interrupt)
        except ValueError:  # not the main thread
            self._old = None
        return self

    def __exit__(self, *exc) -> None:
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)


class StopSignals:
    """SIGINT and SIGTERM set `signal` (the loop stops after its step); a second one interrupts at once, but for
    one within a second of the first: a rank of `--gpus N` gets a terminal's Ctrl-C twice, from the terminal and
    from the launcher that passes it on."""

    def __init__(self):
        self.signal: str | None = None
        self._at = 0.0
        self._old: dict = {}

    def _on(self, signum, frame) -> None:
        if self.signal:
            if time.monotonic() - self._at < 1.0:
                return
            raise KeyboardInterrupt
        self.signal, self._at = signal.Signals(signum).name, time.monotonic()

    def __enter__(self) -> "StopSignals":
        try:
            self._old = {s: signal.signal(s, self._on) for s in (signal.SIGINT, signal.SIGTERM)}
        except ValueError:  # not the main thread: signals stay as they were
            self._old = {}
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
