"""The run manager: starts runs as supervised process groups, lists past and present runs,
reattaches to a run that outlived the front end, stops runs, and watches them for dead or hung
ranks. Every front end (Gradio, notebook, scripts) uses this one; it never imports torch.

    manager = RunManager("runs")
    handle = manager.start(config_from_dict({"train": {"max_steps": 20}}))
    manager.start_monitor(on_failure=print)    # or poll manager.check() from a UI timer
    ...
    manager.stop(handle.name, save=True)

Everything is kept in the run folders, so a new RunManager over the same output folder (after
the front end restarted) finds every run, and a run still going can be watched and stopped.
"""

from __future__ import annotations

import copy
import threading
import time
from pathlib import Path
from typing import Callable

from contract.config.schema import RunConfig
from contract.preflight import PreflightError, PreflightReport, fingerprint, preflight
from contract.run_folder import make_run_folder
from supervisor.launch import spawn
from contract.run_folder import EventLog, RunFolder
from contract.protocol.commands import Stop
from contract.protocol.states import RunState
from contract.events import StateEvent

from supervisor import procs, restart
from supervisor.handle import RunHandle
from supervisor.records import Failure, RunInfo, adopt_child
from supervisor.slurm import handle_for


class RunError(RuntimeError):
    """A run could not be found, started or attached to."""


class RunRefused(RunError):
    """The pre-flight check (contract.preflight) refused the run before any rank started;
    `problems` names each (field, message), `report` holds every finding."""

    def __init__(self, report: PreflightReport):
        super().__init__(str(PreflightError(report.problems)))
        self.problems, self.report = report.problems, report


class RunManager:
    """The runs under `output_dir`. Thread-safe.

    hang_timeout: seconds without training progress (a step, an evaluation, a state change)
    while a run is running and not paused before it is reported as hung.
    log_lines: how many last log lines a failure report carries.
    """

    def __init__(self, output_dir: str | Path, hang_timeout: float = 300.0, log_lines: int = 20):
        self.output_dir = Path(output_dir).resolve()
        self.hang_timeout = hang_timeout
        self.log_lines = log_lines
        self._handles: dict[str, RunHandle] = {}
        self._lock = threading.RLock()
        self._check_lock = threading.Lock()
        self._failures: list[Failure] = []
        self._monitor: threading.Thread | None = None
        self._monitor_stop = threading.Event()

    # -- runs -----------------------------------------------------------------------------------
    def start(self, cfg: RunConfig, env: dict[str, str] | None = None,
              die_with_this_process: bool = False, checked: PreflightReport | None = None) -> RunHandle:
        """Start a run of `cfg` (a copy, placed under this manager's output folder): its folder,
        a `starting` state event, then its launcher in a new session. `env`: extra environment
        variables for every process of the run. `die_with_this_process`: the run ends if this
        process (the thread calling here) ends, however it ends: for a terminal's own run.
        Otherwise the run outlives its front end (the web app, the notebook, a detached run).

        Before anything starts, the pre-flight check (`contract.preflight`) reads the config, the
        model folder and every data file; a run it refuses raises RunRefused naming every
        problem. `checked`: a report the caller already made for this very config (the terminal
        prints it), so that large data files are not read twice."""
        if checked is None or checked.fingerprint != fingerprint(cfg):
            checked = preflight(cfg)
        if cfg.parallel.nodes > 1:  # the launcher here starts this machine's (or the hostfile's) ranks only
            checked = copy.copy(checked)
            checked.problems = [*checked.problems, ("parallel.nodes", f"{cfg.parallel.nodes} nodes without a "
                                "hostfile is for a Slurm job (submit --slurm); a run started here spans "
                                "this machine, or the machines parallel.hostfile lists")]
        if not checked.ok:
            raise RunRefused(checked)
        cfg = copy.deepcopy(cfg)
        cfg.logging.output_dir = str(self.output_dir)
        with self._lock:
            folder = make_run_folder(cfg)
            log = EventLog(folder.events)
            try:
                log.emit(StateEvent(state=RunState.STARTING, nproc=cfg.parallel.nproc,
                                    method=cfg.method.name, model=cfg.model.path or "default"))
                try:
                    launched = spawn(cfg, folder, extra_env=env, die_with_parent=die_with_this_process)
                except OSError as e:
                    log.emit(StateEvent(state=RunState.FAILED, source="manager",
                                        error=f"the launcher could not be started: {e}"))
                    raise RunError(f"run {folder.root.name}: the launcher could not be started: {e}") from e
            finally:
                log.close()
            adopt_child(launched.process)
            handle = RunHandle(folder, self.hang_timeout, self.log_lines)
            handle.mark_launched(env, die_with_parent=die_with_this_process)
            restart.record_starter(folder)  # other watchers wait for this process's restarts
            self._handles[handle.name] = handle
        return handle

    def get(self, name: str) -> RunHandle:
        """The run called `name` (running or not)."""
        with self._lock:
            handle = self._handles.get(name)
            if handle is None:
                root = self.output_dir / name
                if not _is_run_folder(root):
                    known = ", ".join(sorted(self._scan())) or "none"
                    raise RunError(f"no run {name!r} in {self.output_dir} (runs: {known})")
                handle = self._handles[name] = handle_for(RunFolder(root), self.hang_timeout, self.log_lines)
        return handle

    def attach(self, name: str) -> RunHandle:
        """Reattach to a run that is still going (after the front end restarted): the handle
        controls it and the monitor watches it. Raises RunError when it is not running."""
        handle = self.get(name)
        info = handle.info()
        if not info.alive:
            raise RunError(f"run {name!r} is not running (state {info.state})")
        return handle

    def list_runs(self) -> list[RunInfo]:
        """Every run under the output folder, newest first."""
        handles = self._all_handles()
        groups = procs.snapshot({h.pid for h in handles if h.pid})
        infos = []
        for handle in handles:
            handle.refresh(groups.get(handle.pid, []) if handle.pid else [])
            infos.append(handle.info(refresh=False))
        return sorted(infos, key=lambda i: i.start_time or 0.0, reverse=True)

    def stop(self, name: str, save: bool = Stop().save, timeout: float = 60.0) -> RunInfo:
        """Stop run `name`: gracefully through its control socket when it has one (saving
        first with `save`, by default as the contract's `Stop` command says), within `timeout`
        s; then every rank and the launcher are ended."""
        return self.get(name).stop(save=save, timeout=timeout)

    def wait(self, name: str, timeout: float | None = None) -> bool:
        """Wait until no process of run `name` is left (True) or `timeout` s passed (False);
        woken by the processes' exits, not by polling."""
        return self.get(name).wait(timeout)

    def failure(self, name: str) -> Failure | None:
        """Why run `name` failed (or is failing): rank and last log lines; None if it is fine."""
        return self.get(name).failure()

    # -- liveness -------------------------------------------------------------------------------
    def check(self) -> list[Failure]:
        """Look at every live run once: a rank that died, a launcher gone, a hang. Returns the
        failures seen for the first time (each is reported once); what is left of a failed run
        is ended right after, and its failure recorded. Cheap: one pass over the processes for all runs."""
        with self._check_lock:
            handles = [h for h in self._all_handles() if not h.settled()]
            groups = procs.snapshot({h.pid for h in handles if h.pid})
            found = []
            for handle in handles:
                handle.refresh(groups.get(handle.pid, []) if handle.pid else [])
                failure = handle.evaluate()
                if failure is not None:
                    found.append(failure)
            with self._lock:
                self._failures += found
            return found

    def failures(self) -> list[Failure]:
        """Every failure the monitor or `check` has reported so far, oldest first."""
        with self._lock:
            return list(self._failures)

    def start_monitor(self, interval: float = 0.5,
                      on_failure: Callable[[Failure], None] | None = None) -> None:
        """Watch every run in a background thread: a rank's exit wakes it at once (pidfds),
        and it looks at least every `interval` s. `on_failure` is called from that thread."""
        with self._lock:
            if self._monitor is not None and self._monitor.is_alive():
                return
            self._monitor_stop.clear()
            self._monitor = threading.Thread(target=self._watch, args=(interval, on_failure),
                                             name="run-monitor", daemon=True)
            self._monitor.start()

    def stop_monitor(self) -> None:
        with self._lock:
            monitor, self._monitor = self._monitor, None
        self._monitor_stop.set()
        if monitor is not None:
            monitor.join(timeout=5.0)

    def close(self) -> None:
        """Stop watching (the runs themselves go on)."""
        self.stop_monitor()

    def __enter__(self) -> "RunManager":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _watch(self, interval: float, on_failure: Callable[[Failure], None] | None) -> None:
        watch = procs.ExitWatch()
        try:
            while not self._monitor_stop.is_set():
                if len(watch):
                    exited = watch.wait(interval)
                else:
                    exited = []
                    self._monitor_stop.wait(interval)
                handles = self._all_handles()
                woke = time.monotonic()
                for pid in exited:  # read how it ended while it is still a zombie
                    for handle in handles:
                        handle.note_exit(pid, woke)
                    watch.discard(pid)
                for failure in self.check():
                    if on_failure is not None:
                        on_failure(failure)
                for handle in handles:
                    for pid in handle.watched_pids():
                        watch.add(pid)
        finally:
            watch.close()

    # -- the folder -----------------------------------------------------------------------------
    def _scan(self) -> list[str]:
        if not self.output_dir.is_dir():
            return []
        return [p.name for p in self.output_dir.iterdir() if _is_run_folder(p)]

    def _all_handles(self) -> list[RunHandle]:
        with self._lock:
            for name in self._scan():
                if name not in self._handles:
                    self._handles[name] = handle_for(RunFolder(self.output_dir / name),
                                                     self.hang_timeout, self.log_lines)
            return list(self._handles.values())


def _is_run_folder(path: Path) -> bool:
    return path.is_dir() and ((path / "events.jsonl").exists() or (path / "launcher.pid").exists()
                              or (path / "slurm_job.json").exists())
