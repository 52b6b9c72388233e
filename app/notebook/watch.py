"""Follows one run's event log in a background thread, so widgets update while cells run.

The log (events.jsonl) is the durable record: reading it from line 0 redraws a reattached run's
whole history, and following the file needs no connection to the run (a run that is starting,
paused, ended or failed reads the same way). Commands and chat go through the run's client.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from app.series import RunHistory
from contract.run_folder import EventTail, RunFolder

# how long a finished run's log is still followed after its processes are gone: the manager may
# write the final state of a run it stopped by signal a moment later
_AFTER_END_S = 2.0


class Watcher:
    """Calls `on_tick(history, changed)` every `interval` s from its own thread until `stop()`
    (or until the run has ended and its processes are gone); `changed` says whether new events
    came in since the last call."""

    def __init__(self, folder: RunFolder, on_tick: Callable[[RunHistory, bool], None],
                 is_alive: Callable[[], bool], interval: float = 0.5,
                 on_error: Callable[[str], None] = print):
        self.history = RunHistory()
        self._tail = EventTail(folder.events)
        self._on_tick, self._is_alive, self._on_error = on_tick, is_alive, on_error
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"watch-{folder.root.name}", daemon=True)

    def start(self) -> "Watcher":
        self._thread.start()
        return self

    def stop(self, wait: bool = True) -> None:
        self._stop.set()
        if wait and self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5.0)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def poll(self) -> bool:
        """Fold in what was written since the last poll; True when there was something."""
        return self.history.update(self._tail.poll_events()) > 0

    def _loop(self) -> None:
        ended_at = None
        while not self._stop.is_set():
            try:
                changed = self.poll()
                self._on_tick(self.history, changed)
                if self.history.summary.final and not self._is_alive():
                    ended_at = ended_at if ended_at is not None else time.monotonic()
                    if time.monotonic() - ended_at > _AFTER_END_S:
                        break
            except Exception as e:  # noqa: BLE001 - a broken redraw must not end the watching
                self._on_error(f"watcher: {type(e).__name__}: {e}")
            self._stop.wait(self.interval)
        try:  # the last lines, drawn once more
            self._on_tick(self.history, self.poll())
        except Exception as e:  # noqa: BLE001
            self._on_error(f"watcher: {type(e).__name__}: {e}")
