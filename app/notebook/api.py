"""Plain calls for people who prefer code to widgets; the widgets use the same calls.

    from app.notebook import start, attach, runs
    run = start(None, "max_steps=200")          # the embedded default, its own process group
    run.wait(step=10)                           # the kernel is free meanwhile; this just waits
    print(run.chat("reverse: hello"))           # the live weights answer
    run.pause(); run.set(lr=1e-4); run.resume()
    for event in run.events(follow=False): ...  # the history in events.jsonl
    run.stop()
    run = attach("run-20250101-120000")         # a run started earlier, from any kernel

Training runs in its own process group started by `supervisor.RunManager`, and every command goes
through `supervisor.client.RunClient`, the same two pieces the web app uses. Nothing here imports torch.
Runs land in `$LIVETUNE_OUTPUT_DIR`, else `runs/` under the kernel's working folder.
"""

from __future__ import annotations

import copy
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from supervisor.client import Generation, RunClient
from supervisor import RunError, RunHandle, RunInfo, RunManager
from app.series import RunHistory
from contract.config import RunConfig, load_config
from contract.presets import DEFAULT
from contract.run_folder import read_events

FINAL_STATES = ("finished", "failed")

_managers: dict[Path, RunManager] = {}
_managers_lock = threading.Lock()


class RunFailed(RuntimeError):
    """The run failed while something waited on it; the message carries the reason."""


def default_output_dir() -> Path:
    """Where runs go: $LIVETUNE_OUTPUT_DIR, else `runs/` in the working folder."""
    return Path(os.environ.get("LIVETUNE_OUTPUT_DIR", "runs")).resolve()


def manager(output_dir: str | Path | None = None) -> RunManager:
    """The one RunManager of `output_dir` in this kernel, watching its runs for dead or hung
    ranks (a failure is written to the run's events, where the widgets see it)."""
    root = Path(output_dir).resolve() if output_dir else default_output_dir()
    with _managers_lock:
        found = _managers.get(root)
        if found is None:
            found = _managers[root] = RunManager(root)
            found.start_monitor()
        return found


def make_config(config: RunConfig | dict | str | Path | None = None, *overrides: str) -> RunConfig:
    """A validated RunConfig from a RunConfig, a nested dict, a YAML file, or None (the embedded
    default preset), then `key=value` overrides (`max_steps=50`, `optim.lr=1e-4`). Raises
    contract.config.ConfigError naming every field at fault."""
    if isinstance(config, RunConfig):
        data = config.to_dict()
        return load_config(data=data, overrides=list(overrides))
    if config is None:
        return load_config(data=copy.deepcopy(DEFAULT), overrides=list(overrides))
    if isinstance(config, dict):
        return load_config(data=copy.deepcopy(config), overrides=list(overrides))
    return load_config(config, list(overrides))


def start(config: RunConfig | dict | str | Path | None = None, *overrides: str,
          output_dir: str | Path | None = None, env: dict[str, str] | None = None) -> "Run":
    """Start a run (see `make_config` for what `config` may be) and return at once; it trains in
    its own process group while the kernel goes on. `output_dir`: where its folder goes (else
    the config's logging.output_dir if set away from `runs`, else `default_output_dir()`)."""
    cfg = absolute_paths(make_config(config, *overrides))
    if output_dir is None and cfg.logging.output_dir != "runs":
        output_dir = cfg.logging.output_dir
    handle = manager(output_dir).start(cfg, env=env)
    return Run(handle, manager(output_dir))


def attach(name: str, output_dir: str | Path | None = None) -> "Run":
    """The run called `name`, running or not: a live one can be driven, any one's history read."""
    return Run(manager(output_dir).get(name), manager(output_dir))


def runs(output_dir: str | Path | None = None) -> list[RunInfo]:
    """Every run in `output_dir`, newest first."""
    return manager(output_dir).list_runs()


def absolute_paths(cfg: RunConfig) -> RunConfig:
    """The config with its file and folder paths made absolute against this working folder:
    the ranks run in the repository folder, not in the notebook's."""
    cfg = copy.deepcopy(cfg)
    for section, name in (("model", "path"), ("model", "tokenizer"), ("data", "train"),
                          ("data", "eval"), ("parallel", "hostfile")):
        value = getattr(getattr(cfg, section), name)
        if value:
            setattr(getattr(cfg, section), name, str(Path(value).resolve()))
    if cfg.resume and cfg.resume != "latest":
        cfg.resume = str(Path(cfg.resume).resolve())
    ds = cfg.parallel.deepspeed
    if isinstance(ds.get("file"), str):
        ds["file"] = str(Path(ds["file"]).resolve())
    return cfg


class Run:
    """One run, driven from Python. Commands take effect at the run's next step boundary and
    return its answer; they raise supervisor.client.CommandError when the run refuses them."""

    def __init__(self, handle: RunHandle, run_manager: RunManager):
        self.handle, self.manager = handle, run_manager
        self.name, self.path = handle.name, handle.folder.root
        self._client: RunClient | None = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        info = self.info()
        total = info.total_steps if info.total_steps is not None else "?"
        return f"<Run {self.name}: {info.state}, step {info.step}/{total}>"

    # -- reading ------------------------------------------------------------------------------
    def info(self) -> RunInfo:
        """State, step, latest metrics, liveness, error (as the run manager sees it now)."""
        return self.handle.info()

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
        history.update(read_events(self.handle.folder.events))
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

    def failure(self):
        """Why the run failed (rank and last log lines), or None."""
        return self.handle.failure()

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
            if info.state == "failed":
                raise RunFailed(f"run {self.name} failed: {info.error}\n{self.failure() or ''}")
            if info.state in FINAL_STATES and not info.alive:
                if step is None and not states:
                    return info
                raise RunFailed(f"run {self.name} ended ({info.state}) at step {info.step} before "
                                f"{'step ' + str(step) if step is not None else 'state ' + '/'.join(states)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"run {self.name}: still {info.state} at step {info.step} after {timeout} s")
            time.sleep(poll)

    # -- commands -------------------------------------------------------------------------------
    @property
    def client(self) -> RunClient:
        """The run's control client, connected on first use (waits for a starting run's server)."""
        with self._lock:
            if self._client is None:
                self._client = RunClient.connect(self.path, timeout=300.0)
            return self._client

    def generate(self, prompt: str | None = None, *, messages: list[dict] | None = None,
                 **params: Any) -> Generation:
        """Stream the live model's answer: iterate for the pieces as they come."""
        return self.client.generate(prompt, messages=messages, **params)

    def chat(self, prompt: str | None = None, *, messages: list[dict] | None = None, **params: Any) -> str:
        """The live model's whole answer to `prompt` (raw text) or to chat `messages`; a plain
        string prompt is sent as one user turn when `as_chat=True`."""
        if params.pop("as_chat", False) and prompt is not None:
            prompt, messages = None, [{"role": "user", "content": prompt}]
        return self.client.chat(prompt, messages=messages, **params)

    def pause(self) -> dict:
        return self.client.pause()

    def resume(self) -> dict:
        return self.client.resume()

    def save(self) -> dict:
        """A training checkpoint of the present step, in the run's checkpoints/."""
        return self.client.save()

    def evaluate(self) -> dict:
        return self.client.evaluate()

    def set(self, **changes: Any) -> dict:
        """Live settings: lr, lr_scale, grad_clip, eval_every_n_steps, save_every_n_steps, generation."""
        return self.client.set(**changes)

    def status(self) -> dict:
        return self.client.status()

    def stop(self, save: bool = False, timeout: float = 60.0) -> RunInfo:
        """Stop at the next step boundary (with `save`: a checkpoint and the final export first),
        then end every process of the run; returns the final RunInfo."""
        self.close()
        return self.manager.stop(self.name, save=save, timeout=timeout)

    def close(self) -> None:
        """Drop the control connection (the run goes on)."""
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None


__all__ = ["Run", "RunFailed", "RunError", "start", "attach", "runs", "manager", "make_config",
           "absolute_paths", "default_output_dir"]
