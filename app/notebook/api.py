"""Plain calls for people who prefer code to widgets; the widgets use the same calls.

    from app.notebook import start, attach, runs
    run = start(None, "max_steps=200")          # the embedded default, its own process group
    run.wait(step=10)                           # the kernel is free meanwhile; this just waits
    print(run.chat("reverse: hello"))           # the live weights answer
    run.pause(); run.set(lr=1e-4); run.resume()
    for event in run.events(follow=False): ...  # the history in events.jsonl
    run.stop()                                  # saves first: Stop()'s default, as everywhere
    run = attach("run-20250101-120000")         # a run started earlier, from any kernel

Every call goes through the kernel's one `app.session.Session`, the very object the web app's
backend drives (on `supervisor.RunManager` and `supervisor.client.RunClient`), so a command, the
commands a state allows and what stop means are the same in both. Nothing here imports torch.
Runs land in `$LIVETUNE_OUTPUT_DIR`, else `runs/` under the kernel's working folder, unless the
config's logging.output_dir says otherwise.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Iterator

from app.form import make_config
from app.series import RunHistory
from app.session import Session, SessionError
from app.session_verbs import SessionVerbs
from contract.config.schema import RunConfig
from contract.config.load import load_config
from contract.protocol.commands import Stop
from contract.protocol.states import RunState
from contract.run_folder import read_models
from supervisor import Failure, RunError, RunHandle, RunInfo, RunManager
from supervisor.client import RunClient

_sessions: dict[Path, Session] = {}
_sessions_lock = threading.Lock()
_SCHEMA_OUTPUT_DIR = load_config().logging.output_dir  # the schema default, made absolute


class RunFailed(RuntimeError):
    """The run failed while something waited on it; the message carries the reason."""


def default_output_dir() -> Path:
    """Where runs go: $LIVETUNE_OUTPUT_DIR, else `runs/` in the working folder."""
    return Path(os.environ.get("LIVETUNE_OUTPUT_DIR", "runs")).resolve()


def session() -> Session:
    """The kernel's session over `default_output_dir()` (and any folder a call names)."""
    root = default_output_dir()
    with _sessions_lock:
        found = _sessions.get(root)
        if found is None:
            found = _sessions[root] = Session(root)
        return found


def manager(output_dir: str | Path | None = None) -> RunManager:
    """The one RunManager of `output_dir` in this kernel, watching its runs for dead or hung
    ranks (a failure is written to the run's events, where the widgets see it)."""
    return session().manager(output_dir)


def start(config: RunConfig | dict | str | Path | None = None, *overrides: str,
          output_dir: str | Path | None = None, env: dict[str, str] | None = None) -> "Run":
    """Start a run (see `app.form.make_config` for what `config` may be) and return at once; it
    trains in its own process group while the kernel goes on. `output_dir`: where its folder
    goes (else the config's logging.output_dir if set, else `default_output_dir()`)."""
    cfg = make_config(config, *overrides)
    if output_dir is None:
        chosen = cfg.logging.output_dir
        output_dir = default_output_dir() if chosen in ("", _SCHEMA_OUTPUT_DIR) else chosen
    try:
        info = session().start(cfg, output_dir=output_dir, env=env)
    except SessionError as e:
        raise RunError(str(e)) from None
    return Run(info.path)


def chat_with(source: str | Path, output_dir: str | Path | None = None) -> "Run":
    """Chat with a finished run, one of its checkpoints, an adapter or an exported model folder,
    with no live run: a chat-only run holding it in the engine (`supervisor.chat_sessions`).
    `run.chat(...)` answers from it; `run.stop()` frees its memory."""
    try:
        info = session().chat_with(source, output_dir=output_dir or default_output_dir())
    except SessionError as e:
        raise RunError(str(e)) from None
    return Run(info.path)


def attach(name: str, output_dir: str | Path | None = None) -> "Run":
    """The run called `name` (or a run folder path), running or not: a live one can be driven,
    any one's history read."""
    path = Path(name) if Path(name).is_absolute() else Path(output_dir or default_output_dir()) / name
    manager(path.parent).get(path.name)  # RunError naming the runs there when there is none
    return Run(str(path.resolve()))


def runs(output_dir: str | Path | None = None) -> list[RunInfo]:
    """Every run in `output_dir`, newest first."""
    return session().runs(output_dir or default_output_dir())


class Run(SessionVerbs):
    """One run, driven from Python through the kernel's session. Its commands are the client's
    verbs (supervisor.client.Verbs: pause, resume, set, save, evaluate, status, generate, chat,
    rewind, branch, snapshot, branches, add_source, set_weight, remove_source, teach, prefer,
    forget), the very methods the web app's API and `RunClient` call: they take effect at the
    run's next step boundary and return its answer; they raise app.session.SessionError when the
    run refuses them (or cannot be reached), with the reason, and a bad argument with the command
    model's words before anything is sent."""

    def __init__(self, path: str | Path, run_session: Session | None = None):
        super().__init__(run_session or session(), str(Path(path)), connect_timeout=300.0)
        self.path = Path(path)
        self.name = self.path.name
        self.handle: RunHandle = self.session.handle(self.path)

    def __repr__(self) -> str:
        info = self.info()
        total = info.total_steps if info.total_steps is not None else "?"
        return f"<Run {self.name}: {info.state}, step {info.step}/{total}>"

    # -- reading ------------------------------------------------------------------------------
    def info(self) -> RunInfo:
        """State, step, latest metrics, liveness, error (as the run manager sees it now)."""
        return self.session.info(str(self.path), fresh=True)

    @property
    def state(self) -> str:
        return self.info().state

    @property
    def model_dir(self) -> Path:
        """Where the run's final model (or PEFT adapter) is exported when it ends."""
        return self.handle.folder.model

    def history(self) -> RunHistory:
        """Every metric over the steps so far, read from events.jsonl."""
        history = RunHistory()
        history.update(read_models(self.handle.folder.events))
        return history

    @property
    def losses(self) -> list[float]:
        """The training loss of every logged step so far."""
        return self.history().values("loss")

    def events(self, from_line: int = 0, follow: bool = True) -> Iterator[dict]:
        """Events from line `from_line` of the log on, each with its `line`; with `follow`, then
        live ones until the run ends."""
        client = RunClient(self.path)  # a stream of its own, also for a run that has ended
        return client.events(from_line=from_line, follow=follow)

    def failure(self) -> Failure | None:
        """Why the run failed (rank and last log lines), or None."""
        return self.session.failure(str(self.path))

    def wait(self, step: int | None = None, state: str | tuple[str, ...] | None = None,
             timeout: float = 600.0, poll: float = 0.2) -> RunInfo:
        """Wait until the run has done `step` steps, or is in `state`, or (neither given) has
        ended. Raises RunFailed when it fails first, TimeoutError after `timeout` s."""
        states = (state,) if isinstance(state, str) else tuple(state or ())
        deadline = time.monotonic() + timeout
        while True:
            info = self.info()
            if (step is not None and info.step >= step) or info.state in states:
                return info
            if info.state == RunState.FAILED:
                raise RunFailed(f"run {self.name} failed: {info.error}\n{self.failure() or ''}")
            if RunState(info.state).final and not info.alive:
                if step is None and not states:
                    return info
                raise RunFailed(f"run {self.name} ended ({info.state}) at step {info.step} before "
                                f"{'step ' + str(step) if step is not None else 'state ' + '/'.join(states)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"run {self.name}: still {info.state} at step {info.step} after {timeout} s")
            time.sleep(poll)

    # -- what the notebook adds to the verbs ------------------------------------------------------
    @property
    def client(self) -> RunClient:
        """The run's control client (the session's), connected on first use (waits for a
        starting run's server)."""
        return self.session.client(str(self.path), timeout=300.0)

    def entries(self) -> list[dict]:
        """The inbox's entries (`inbox().entries`): id, prompt, answer, removed, steps_left (and a
        preference's rejected)."""
        return self.inbox().entries

    def sources(self) -> list[dict]:
        """The training sources now: name, path, format, weight, samples, seen (samples drawn)."""
        return self.inbox().sources

    def stop(self, save: bool = Stop().save, timeout: float = 60.0) -> RunInfo:
        """Stop at the next step boundary (unless `save` is False: a checkpoint and the final
        export first, the contract's Stop default), then end every process of the run; returns
        the final RunInfo."""
        return self.session.stop(str(self.path), save=save, wait=True, timeout=timeout)

    def close(self) -> None:
        """Drop the control connection (the run goes on)."""
        self.session.forget_client(str(self.path))


__all__ = ["Run", "RunFailed", "RunError", "start", "attach", "runs", "manager", "session",
           "make_config", "default_output_dir"]
