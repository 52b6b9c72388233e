"""The one session object every front end drives: which runs there are, which one is current,
and starting, attaching, commanding, chatting with and stopping them.

    session = Session("runs")
    info = session.start(cfg)                       # its own process group; the current run
    session.send(None, Pause())                     # None: the current run
    for update in session.chat(None, [{"role": "user", "content": "reverse: abc"}]): ...
    session.stop(None)                              # Stop()'s default: save first

The web app's Backend and the notebook's `Run` both sit on it, so a command, the commands a
state allows and what Stop means cannot differ between them. It is built on the shared
`supervisor.RunManager` (start, watch, stop a process group) and `supervisor.client.RunClient`
(one connection to a run's control socket), and talks in the contract's typed commands
(`contract.protocol`). Every failure is raised as `SessionError`, with a sentence a user can act on.
Who may do what (contract.protocol.roles): `role_of()` says the role of whoever is asking (an
operator unless a front end says otherwise: the web app asks the login of the request); a command
whose class needs the operator role, and starting, submitting, stopping or exporting a run, are
refused to a viewer with the same sentence the run itself refuses a viewer's key with.
Torch-free, Gradio-free, ipywidgets-free.
"""

from __future__ import annotations

import copy
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from app.chat_updates import ChatUpdate, chat_updates
from app.stops import BackgroundStops
from contract.config.schema import RunConfig
from contract.preflight import PreflightReport, fingerprint, preflight
from contract.protocol.base import Command, ProtocolError
from contract.protocol.commands import REQUESTS, Generate, Stop, allowed_commands
from contract.protocol.roles import Role, refusal
from contract.protocol.states import RunState
from supervisor import Failure, RunError, RunHandle, RunInfo, RunManager, RunRefused, stopping
from supervisor.client import CommandError, Generation, RunClient, RunGone
from supervisor.chat_sessions import chat_config
from supervisor.slurm import SlurmError, SlurmOptions, submit as submit_job

COMMAND_TIMEOUT_S = 120.0  # a command waits for the next step boundary (an evaluation may be running)
INFO_TTL_S = 0.5           # several pages polling one run share one look at its processes


class SessionError(RuntimeError):
    """Something the user asked for cannot be done; the message says why. `problems`: the
    (field, message) pairs when the pre-flight check refused a run (empty otherwise)."""

    def __init__(self, message: str, problems: list[tuple[str, str]] | None = None):
        super().__init__(message)
        self.problems = list(problems or [])


def allowed(state: str | None, role: Role = Role.OPERATOR) -> frozenset[str]:
    """The commands a run in `state` takes (none for no run or an unknown state) from someone of
    `role`: the contract's tables, which every front end's buttons follow."""
    try:
        found = allowed_commands(state) if state else frozenset()
    except ValueError:
        return frozenset()
    return frozenset(c for c in found if role.may(REQUESTS[c].role))


class Session:
    """The runs under `output_dir` (and under any other folder a config names), and the current
    one. Thread-safe: pages, widgets and their threads share one session."""

    def __init__(self, output_dir: str | Path, run_env: dict[str, str] | None = None,
                 hang_timeout: float = 300.0, role: Role | None = None):
        self.output_dir = Path(output_dir).resolve()
        self.run_env = dict(run_env or {})
        self.hang_timeout = hang_timeout
        self._lock = threading.RLock()
        self._managers: dict[Path, RunManager] = {}
        self._clients: dict[str, RunClient] = {}
        self._infos: dict[str, tuple[float, RunInfo]] = {}
        self._stops = BackgroundStops()
        self._current: str | None = None
        # which run key the clients use (None: the operator's when readable, else the viewer's;
        # RunClient), the role of whoever is asking now, and what they hold ("key", "login")
        self.key_role = role
        self.role_of: Callable[[], Role] = lambda: role or Role.OPERATOR
        self.holder = "key"
        self.manager(self.output_dir)

    def require(self, action: str, needed: Role = Role.OPERATOR) -> None:
        """Refuse `action` (SessionError, the run's own sentence) unless the asker may do it."""
        role = self.role_of()
        if not role.may(needed):
            raise SessionError(refusal(action, role, self.holder))

    def close(self) -> None:
        """Stop watching and close connections (the runs themselves go on)."""
        with self._lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()
            for manager in self._managers.values():
                manager.close()

    # -- which run ----------------------------------------------------------------------------
    def manager(self, output_dir: str | Path | None = None) -> RunManager:
        """The one RunManager of `output_dir` (default: the session's), watching its runs for
        dead or hung ranks."""
        folder = Path(output_dir or self.output_dir).resolve()
        with self._lock:
            if folder not in self._managers:
                manager = RunManager(folder, hang_timeout=self.hang_timeout)
                manager.start_monitor()
                self._managers[folder] = manager
            return self._managers[folder]

    def resolve(self, ref: str | Path | None) -> str:
        """The folder of the run `ref` names: a run folder path, a run name under the output
        folder, or None / empty for the current run (see `default_run`)."""
        if not ref:
            found = self.default_run()
            if found is None:
                raise SessionError("there is no run yet: configure one and press Start")
            return found
        path = Path(ref)
        if not path.is_absolute():
            path = self.output_dir / ref if not (path / "events.jsonl").exists() else path
        path = path.resolve()
        if not (path / "events.jsonl").exists() and not (path / "launcher.pid").exists():
            names = ", ".join(i.name for i in self.runs()[:10]) or "none"
            raise SessionError(f"no run {str(ref)!r} in {self.output_dir} (runs: {names})")
        return str(path)

    def default_run(self) -> str | None:
        """The current run: the one this session started or attached last while it is alive,
        else the newest run still going, else the newest run."""
        with self._lock:
            current = self._current
        if current and self.info(current).alive:
            return current
        runs = self.runs()
        alive = [i for i in runs if i.alive]
        chosen = alive[0] if alive else (runs[0] if runs else None)
        return chosen.path if chosen else current

    def handle(self, path: str | Path) -> RunHandle:
        folder = Path(path)
        return self.manager(folder.parent).get(folder.name)

    def info(self, path: str, fresh: bool = False) -> RunInfo:
        """The run as its manager sees it (its processes and its log), looked at once per
        INFO_TTL_S whoever asks, or now with `fresh`."""
        now = time.monotonic()
        with self._lock:
            cached = self._infos.get(path)
        if cached and not fresh and now - cached[0] < INFO_TTL_S:
            return cached[1]
        try:
            info = self.handle(path).info()
        except RunError as e:
            raise SessionError(str(e)) from None
        with self._lock:
            self._infos[path] = (now, info)
        return info

    def failure(self, path: str) -> Failure | None:
        """Why the run failed (rank and last log lines), or None."""
        return self.handle(path).failure()

    def runs(self, output_dir: str | Path | None = None) -> list[RunInfo]:
        """Every run of `output_dir`, or (None) of every folder this session has used; newest first."""
        if output_dir is not None:
            return self.manager(output_dir).list_runs()
        with self._lock:
            managers = list(self._managers.values())
        infos = [i for m in managers for i in m.list_runs()]
        return sorted(infos, key=lambda i: i.start_time or 0.0, reverse=True)

    # -- starting -------------------------------------------------------------------------------
    def start(self, cfg: RunConfig, output_dir: str | Path | None = None,
              env: dict[str, str] | None = None) -> RunInfo:
        """Start a run of `cfg` in its own process group, in `output_dir` (default: the config's
        logging.output_dir); it becomes the current run."""
        self.require("start")
        manager = self.manager(output_dir or cfg.logging.output_dir or self.output_dir)
        try:
            handle = manager.start(cfg, env={**self.run_env, **(env or {})} or None)
        except RunRefused as e:  # the pre-flight check: every problem by field, file and row
            raise SessionError(str(e), e.problems) from None
        except (RunError, OSError) as e:
            raise SessionError(f"the run could not be started: {e}") from None
        path = str(handle.folder.root)
        with self._lock:
            self._current = path
        return self.info(path, fresh=True)

    def submit(self, cfg: RunConfig, options: SlurmOptions, output_dir: str | Path | None = None,
               checked: PreflightReport | None = None) -> RunInfo:
        """Submit a run of `cfg` to Slurm (`supervisor.slurm.submit`: the job script and the job
        id in its folder) instead of starting it here; the terminal's `submit --slurm` and the web
        app's "Submit to Slurm" both come here. The pre-flight check runs first, as for Start
        (`checked`: a report the caller already made for this config); `options.procs_per_node`,
        when set, is the run's parallel.nproc. The run becomes the current run; it shows as
        queued until Slurm starts the job."""
        self.require("submit")
        try:
            options.check()
        except ValueError as e:
            raise SessionError(str(e)) from None
        cfg = copy.deepcopy(cfg)
        if options.procs_per_node:
            cfg.parallel.nproc = options.procs_per_node
        if checked is None or checked.fingerprint != fingerprint(cfg):
            checked = preflight(cfg)
        if not checked.ok:
            refused = RunRefused(checked)
            raise SessionError(str(refused), refused.problems)
        manager = self.manager(output_dir or cfg.logging.output_dir or self.output_dir)
        # sbatch hands its environment to the job (--export=ALL): the run's extra variables too
        env = {**os.environ, **self.run_env} if self.run_env else None
        try:
            folder = submit_job(cfg, manager.output_dir, options, env=env)
        except (SlurmError, OSError, subprocess.SubprocessError) as e:
            raise SessionError(f"the job could not be submitted: {e}") from None
        path = str(folder.root)
        with self._lock:
            self._current = path
        return self.info(path, fresh=True)

    def chat_with(self, source: str | Path, output_dir: str | Path | None = None) -> RunInfo:
        """Start a chat-only run answering from `source` (a run folder, a training checkpoint, an
        adapter or a model folder: `supervisor.chat_sessions`), beside whatever else runs; chat
        with it through `chat` / `generate` with its path, end it with `stop`. The current run
        stays what it was."""
        self.require("chat with a checkpoint (it starts a process)")
        try:
            cfg = chat_config(source)
        except (ValueError, OSError) as e:  # ChatSourceError, a config the run left that is bad now
            raise SessionError(str(e)) from None
        manager = self.manager(output_dir or self.output_dir)
        try:
            handle = manager.start(cfg, env=self.run_env or None)
        except RunRefused as e:
            raise SessionError(str(e), e.problems) from None
        except (RunError, OSError) as e:
            raise SessionError(f"the chat could not be started: {e}") from None
        return self.info(str(handle.folder.root), fresh=True)

    def attach(self, ref: str | Path) -> RunInfo:
        """Take a run (started by an earlier app, a notebook, a terminal) as the current run."""
        path = self.resolve(ref)
        folder = Path(path)
        try:
            self.manager(folder.parent).attach(folder.name)
        except RunError as e:
            raise SessionError(str(e)) from None
        with self._lock:
            self._current = path
        return self.info(path, fresh=True)

    # -- commands -------------------------------------------------------------------------------
    def client(self, path: str, timeout: float = 10.0) -> RunClient:
        """The run's control connection, shared by every caller; waits up to `timeout` s for a
        starting run's server."""
        with self._lock:
            client = self._clients.get(path)
        if client is not None:
            return client
        info = self.info(path)
        if not info.alive:
            raise SessionError(f"run {info.name} is {info.state}; it takes no commands")
        try:
            client = RunClient.connect(path, timeout=timeout, role=self.key_role)
        except (RunGone, OSError, TimeoutError) as e:
            starting = info.state == RunState.STARTING
            raise SessionError(f"run {info.name} is still starting; try again in a few seconds"
                               if starting else f"cannot reach run {info.name}: {e}") from None
        with self._lock:
            self._clients[path] = client
        return client

    def forget_client(self, path: str) -> None:
        """Close the run's connection (the next command opens a new one)."""
        with self._lock:
            client = self._clients.pop(path, None)
        if client is not None:
            client.close()

    def send(self, ref: str | Path | None, command: Command, timeout: float = COMMAND_TIMEOUT_S,
             connect_timeout: float = 10.0) -> Any:
        """Send a typed command (Pause(), Set(lr=1e-4) ...) to the run `ref` names and return its
        answer model (`type(command).returns`, contract.protocol.answers): at its next step
        boundary (status at once). Stop goes through `stop`."""
        if isinstance(command, Stop):
            raise SessionError("stop a run with Session.stop, which also ends its processes")
        self.require(command.name, command.role)
        path = self.resolve(ref)
        try:
            return self.client(path, connect_timeout).send(command, timeout=timeout)
        except CommandError as e:  # a viewer's key refused by the run: its sentence as it is
            raise SessionError(str(e) if "needs the operator role" in str(e) else f"{command.name} refused: {e}") from None
        except TimeoutError:
            raise SessionError(f"{command.name}: no answer from the run within {timeout:g} s") from None
        except (RunGone, OSError) as e:
            self.forget_client(path)
            raise SessionError(f"{command.name}: the run is not reachable ({e})") from None

    # -- stopping -------------------------------------------------------------------------------
    def stop(self, ref: str | Path | None, save: bool = Stop().save, wait: bool = False,
             timeout: float = 60.0) -> RunInfo:
        """Stop a run at its next step boundary, saving first unless `save` is False (the
        contract's Stop default); then every rank and the launcher end. Without `wait` the stop
        goes on in the background and the run shows as stopping. A second stop while one is
        going on ends the process group at once, without waiting for the save."""
        self.require(Stop.name, Stop.role)
        path = self.resolve(ref)
        info = self.info(path, fresh=True)
        if not info.alive:
            raise SessionError(f"run {info.name} is {info.state}; there is nothing to stop")
        running, again = self._stops.begin(path, info.name, lambda: self._stop(path, save, timeout))
        if again:
            handle = self.handle(path)
            stopping.end_group(handle.pid, handle.folder.root, grace_s=5.0)
        if wait:
            running.join()
            error = self._stops.error(path, take=True)
            if error:
                raise SessionError(error)
            return self._settled(path)
        return self.info(path, fresh=True)

    def _settled(self, path: str, within_s: float = 5.0) -> RunInfo:
        # The group is gone when the manager's stop returns, but the launcher's exit can take a
        # moment to be reaped (by a thread, on a loaded machine): look again until it shows.
        deadline = time.monotonic() + within_s
        info = self.info(path, fresh=True)
        while info.alive and time.monotonic() < deadline:
            time.sleep(0.1)
            info = self.info(path, fresh=True)
        return info

    def _stop(self, path: str, save: bool, timeout: float) -> None:
        folder = Path(path)
        try:  # a failure is kept by self._stops for the page
            self.manager(folder.parent).stop(folder.name, save=save, timeout=timeout)
        finally:
            self.forget_client(path)

    def stop_error(self, path: str) -> str | None:
        """Why the last stop of the run failed, if it did."""
        return self._stops.error(path)

    # -- chat -----------------------------------------------------------------------------------
    def stream(self, ref: str | Path | None, command: Command, connect_timeout: float = 60.0,
               timeout: float | None = None) -> Generation:
        """Send a command whose answer streams (Generate(...)) to the run `ref` names: iterate
        for the live model's pieces."""
        self.require(command.name, command.role)
        return self.client(self.resolve(ref), connect_timeout).stream(command, timeout)

    def chat(self, ref: str | Path | None, messages: list[dict], compare_base: bool = False,
             **params: Any) -> Iterator[ChatUpdate]:
        """Stream the live model's answer to a chat (its tokenizer's chat template; a raw prompt
        of the last message when it has none), and with `compare_base` the base model's too."""
        path = self.resolve(ref)
        if not messages or not str(messages[-1].get("content", "")).strip():
            raise SessionError("type a message first")
        params = {k: v for k, v in params.items() if v is not None}
        try:
            request = Generate(messages=messages, compare_base=compare_base, **params)
        except (ProtocolError, TypeError) as e:
            raise SessionError(str(e)) from None
        try:
            yield from chat_updates(self.stream(path, request), compare_base)
        except CommandError as e:
            if "no chat template" not in str(e):
                raise SessionError(f"the run could not answer: {e}") from None
            raw = Generate(prompt=messages[-1]["content"], compare_base=compare_base, **params)
            try:
                yield from chat_updates(self.stream(path, raw), compare_base)
            except CommandError as e2:
                raise SessionError(f"the run could not answer: {e2}") from None
        except (RunGone, OSError) as e:
            self.forget_client(path)
            raise SessionError(f"the run is not reachable ({e})") from None
