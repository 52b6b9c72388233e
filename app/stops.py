"""Stops of runs that go on in the background (app.session.Session.stop): one thread per run; a
second stop while one is going on is told apart (the session then ends the group at once); why
the last stop of a run failed is kept for the page that shows it. Torch-free."""

from __future__ import annotations

import threading
from typing import Callable


class BackgroundStops:
    """The stop threads of a session's runs, by run folder. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._threads: dict[str, threading.Thread] = {}
        self._errors: dict[str, str] = {}

    def begin(self, path: str, name: str, stop: Callable[[], None]) -> tuple[threading.Thread, bool]:
        """`stop()` on a thread of its own for the run at `path` (called `name`), unless one is
        going on: (the thread, whether it was going on already)."""
        with self._lock:
            earlier = self._threads.get(path)
            if earlier is not None and earlier.is_alive():
                return earlier, True
            running = threading.Thread(target=self._run, args=(path, name, stop), daemon=True, name=f"stop-{name}")
            self._threads[path] = running
            running.start()
            return running, False

    def _run(self, path: str, name: str, stop: Callable[[], None]) -> None:
        try:
            stop()
        except Exception as e:  # noqa: BLE001 - kept for the page, which shows it
            with self._lock:
                self._errors[path] = f"stopping {name} failed: {e}"

    def error(self, path: str, take: bool = False) -> str | None:
        """Why the last stop of the run failed, if it did (`take`: and forget it)."""
        with self._lock:
            return self._errors.pop(path, None) if take else self._errors.get(path)
