"""The web app's backend: everything the pages do, and nothing of how they look.

    backend = Backend("runs")
    info = backend.start(backend.form.check(values).config)
    for update in backend.chat(info.path, [{"role": "user", "content": "reverse: abc"}]):
        ...
    backend.command(info.path, "pause")

It runs the runs through the shared `supervisor.RunManager` and talks to them through the shared
`supervisor.client.RunClient`, reads their history from their event logs (`views.RunView`), and asks a
child process for anything that needs torch (`preview`, `store.export`). The tab modules in
`app.web` only lay out components and call this object. Every failure is raised as
`BackendError` with a sentence a user can act on.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pandas as pd

from supervisor.client import CommandError, RunClient, RunGone
from supervisor import Failure, RunError, RunInfo, RunManager
from app.web.backend import store
from app.web.backend.forms import DEFAULT_PRESET, Form
from app.web.backend.preview import PreviewError, PreviewWorker
from app.web.backend.views import Progress, RunView
from contract.config import ConfigError, RunConfig, load_config
from contract.presets import PRESETS
from contract.run_folder import RunFolder

COMMAND_TIMEOUT_S = 120.0  # a command waits for the next step boundary (an evaluation may be running)
INFO_TTL_S = 0.5           # several pages polling one run share one look at its processes
PEFT_METHODS = ("lora", "prompt_tuning", "p_tuning")


class BackendError(RuntimeError):
    """Something the user asked for cannot be done; the message says why."""


@dataclass(frozen=True)
class Snapshot:
    """Everything the Train tab shows of a run at one moment."""
    path: str
    info: RunInfo
    progress: Progress
    version: int
    failure: Failure | None


@dataclass(frozen=True)
class ChatUpdate:
    """A streamed answer so far; `step` is set once it is complete (the step it came from)."""
    text: str
    base: str | None
    step: int | None
    note: str | None = None

    @property
    def done(self) -> bool:
        return self.step is not None


class Backend:
    """The runs under `output_dir` (and any other folder a config names), shared by every page."""

    def __init__(self, output_dir: str | Path, run_env: dict[str, str] | None = None,
                 hang_timeout: float = 300.0):
        self.output_dir = Path(output_dir).resolve()
        self.form = Form(str(self.output_dir))
        self.run_env = dict(run_env or {})
        self.hang_timeout = hang_timeout
        self._lock = threading.RLock()
        self._managers: dict[Path, RunManager] = {}
        self._views: dict[str, RunView] = {}
        self._clients: dict[str, RunClient] = {}
        self._infos: dict[str, tuple[float, RunInfo]] = {}
        self._stops: dict[str, threading.Thread] = {}
        self._stop_errors: dict[str, str] = {}
        self._current: str | None = None
        self.preview = PreviewWorker()
        self._manager(self.output_dir)

    def close(self) -> None:
        """Stop watching and close connections (the runs themselves go on)."""
        with self._lock:
            for client in self._clients.values():
                client.close()
            for manager in self._managers.values():
                manager.close()
        self.preview.close()

    # -- which run ----------------------------------------------------------------------------
    def _manager(self, output_dir: Path) -> RunManager:
        with self._lock:
            output_dir = output_dir.resolve()
            if output_dir not in self._managers:
                manager = RunManager(output_dir, hang_timeout=self.hang_timeout)
                manager.start_monitor()
                self._managers[output_dir] = manager
            return self._managers[output_dir]

    def resolve(self, ref: str | None) -> str:
        """The folder of the run `ref` names: a run folder path, a run name under the output
        folder, or empty for the default run (see `default_run`)."""
        if not ref:
            found = self.default_run()
            if found is None:
                raise BackendError("there is no run yet: configure one and press Start")
            return found
        path = Path(ref)
        if not path.is_absolute():
            path = self.output_dir / ref if not (path / "events.jsonl").exists() else path
        path = path.resolve()
        if not (path / "events.jsonl").exists() and not (path / "launcher.pid").exists():
            names = ", ".join(i.name for i in self.runs()[:10]) or "none"
            raise BackendError(f"no run {ref!r} in {self.output_dir} (runs: {names})")
        return str(path)

    def default_run(self) -> str | None:
        """The run a page shows when it opens: the one this app started or attached last while
        it is alive, else the newest run still going, else the newest run."""
        with self._lock:
            current = self._current
        if current and self.info(current).alive:
            return current
        runs = self.runs()
        alive = [i for i in runs if i.alive]
        chosen = alive[0] if alive else (runs[0] if runs else None)
        return chosen.path if chosen else current

    def handle(self, path: str):
        folder = Path(path)
        return self._manager(folder.parent).get(folder.name)

    def info(self, path: str, fresh: bool = False) -> RunInfo:
        """The run as the manager sees it (its processes and its log), looked at once per
        INFO_TTL_S whoever asks."""
        now = time.monotonic()
        with self._lock:
            cached = self._infos.get(path)
        if cached and not fresh and now - cached[0] < INFO_TTL_S:
            return cached[1]
        try:
            info = self.handle(path).info()
        except RunError as e:
            raise BackendError(str(e)) from None
        with self._lock:
            self._infos[path] = (now, info)
        return info

    def runs(self) -> list[RunInfo]:
        """Every run in every folder this app has used, newest first."""
        with self._lock:
            managers = list(self._managers.values())
        infos = [i for m in managers for i in m.list_runs()]
        return sorted(infos, key=lambda i: i.start_time or 0.0, reverse=True)

    def view(self, path: str) -> RunView:
        with self._lock:
            if path not in self._views:
                self._views[path] = RunView(RunFolder(Path(path)))
            return self._views[path]

    # -- starting -------------------------------------------------------------------------------
    def start(self, cfg: RunConfig) -> RunInfo:
        """Start a run of `cfg` in its own process group; it becomes the default run."""
        manager = self._manager(Path(cfg.logging.output_dir or self.output_dir))
        try:
            handle = manager.start(cfg, env=self.run_env or None)
        except (RunError, OSError) as e:
            raise BackendError(f"the run could not be started: {e}") from None
        path = str(handle.folder.root)
        with self._lock:
            self._current = path
        return self.info(path, fresh=True)

    def start_text(self, text: str = "", preset: str = DEFAULT_PRESET) -> RunInfo:
        """Start a run from a YAML (or JSON) config laid over a preset ("" for none)."""
        import yaml
        if preset and preset not in PRESETS:
            raise BackendError(f"no preset {preset!r}; presets: {', '.join(PRESETS)}")
        try:
            data = yaml.safe_load(text) if text.strip() else {}
        except yaml.YAMLError as e:
            raise BackendError(f"the config is not valid YAML or JSON: {e}") from None
        if not isinstance(data, dict):
            raise BackendError(f"the config must be a mapping of sections, not {type(data).__name__}")
        base = self.form.to_data(self.form.preset_values(preset) if preset else self.form.values_for())[0]
        _merge(base, data)
        try:
            cfg = load_config(data=base)
        except ConfigError as e:
            raise BackendError(str(e)) from None
        return self.start(cfg)

    def attach(self, ref: str) -> RunInfo:
        """Take a run that is still going (started by an earlier app, a notebook, a terminal)
        as this app's default run."""
        path = self.resolve(ref)
        folder = Path(path)
        try:
            self._manager(folder.parent).attach(folder.name)
        except RunError as e:
            raise BackendError(str(e)) from None
        with self._lock:
            self._current = path
        return self.info(path, fresh=True)

    # -- control --------------------------------------------------------------------------------
    def client(self, path: str, timeout: float = 10.0) -> RunClient:
        with self._lock:
            client = self._clients.get(path)
        if client is not None:
            return client
        info = self.info(path)
        if not info.alive:
            raise BackendError(f"run {info.name} is {info.state}; it takes no commands")
        try:
            client = RunClient.connect(path, timeout=timeout)
        except (RunGone, OSError, TimeoutError) as e:
            starting = info.state == "starting"
            raise BackendError(f"run {info.name} is still starting; try again in a few seconds"
                               if starting else f"cannot reach run {info.name}: {e}") from None
        with self._lock:
            self._clients[path] = client
        return client

    def _forget_client(self, path: str) -> None:
        with self._lock:
            client = self._clients.pop(path, None)
        if client is not None:
            client.close()

    def command(self, ref: str | None, cmd: str, **args: Any) -> dict:
        """pause, resume, save, evaluate, set, status: sent to the run, answered at its next
        step boundary (status at once)."""
        path = self.resolve(ref)
        try:
            return self.client(path).command(cmd, timeout=COMMAND_TIMEOUT_S, **args)
        except CommandError as e:
            raise BackendError(f"{cmd} refused: {e}") from None
        except TimeoutError:
            raise BackendError(f"{cmd}: no answer from the run within {COMMAND_TIMEOUT_S:g} s") from None
        except (RunGone, OSError) as e:
            self._forget_client(path)
            raise BackendError(f"{cmd}: the run is not reachable ({e})") from None

    def stop(self, ref: str | None, save: bool = False, wait: bool = False) -> RunInfo:
        """Stop a run (saving first with `save`); every rank and the launcher end. Without
        `wait` the stop goes on in the background and the run shows as stopping."""
        path = self.resolve(ref)
        info = self.info(path, fresh=True)
        if not info.alive:
            raise BackendError(f"run {info.name} is {info.state}; there is nothing to stop")
        with self._lock:
            running = self._stops.get(path)
            if running is None or not running.is_alive():
                running = threading.Thread(target=self._stop, args=(path, save), daemon=True,
                                           name=f"stop-{info.name}")
                self._stops[path] = running
                running.start()
        if wait:
            running.join()
            with self._lock:
                error = self._stop_errors.pop(path, None)
            if error:
                raise BackendError(error)
        return self.info(path, fresh=True)

    def _stop(self, path: str, save: bool) -> None:
        folder = Path(path)
        try:
            self._manager(folder.parent).stop(folder.name, save=save)
        except Exception as e:  # noqa: BLE001 - kept for the page, which shows it
            with self._lock:
                self._stop_errors[path] = f"stopping {folder.name} failed: {e}"
        finally:
            self._forget_client(path)

    def stop_error(self, path: str) -> str | None:
        with self._lock:
            return self._stop_errors.get(path)

    def set_lr(self, ref: str | None, lr: float) -> dict:
        if lr is None or not lr >= 0:
            raise BackendError(f"the learning rate must be a number >= 0, got {lr}")
        return self.command(ref, "set", lr=float(lr))

    def status(self, ref: str | None = None) -> dict:
        """The run's info, position and, while it is alive, its live settings."""
        path = self.resolve(ref)
        info = self.info(path, fresh=True)
        view = self.view(path)
        view.poll()
        p = view.progress(info.state)
        out = {"run": info.name, "path": path, "state": info.state, "alive": info.alive,
               "step": p.step, "total_steps": p.total, "epoch": p.epoch, "eta_s": p.eta_s,
               "metrics": info.metrics, "error": info.error}
        if info.alive and info.state not in ("starting", "stopping"):
            try:
                live = self.client(path, timeout=2.0).status()
                out["settings"] = live.get("settings")
                out["queue"] = live.get("queue")
            except (BackendError, CommandError, RunGone, OSError, TimeoutError):
                pass
        return out

    # -- watching -------------------------------------------------------------------------------
    def snapshot(self, ref: str | None) -> Snapshot:
        path = self.resolve(ref)
        info = self.info(path)
        view = self.view(path)
        version = view.poll()
        failure = None
        if info.state == "failed":
            failure = self.handle(path).failure()
        return Snapshot(path, info, view.progress(info.state), version, failure)

    def frames(self, path: str, smoothing: float = 0.9) -> dict[str, pd.DataFrame]:
        return self.view(path).frames(smoothing)

    def log_tail(self, path: str, lines: int = 40) -> str:
        return self.view(path).log_tail(lines)

    def config_text(self, ref: str | None) -> str:
        path = self.resolve(ref)
        try:
            return RunFolder(Path(path)).config.read_text()
        except OSError as e:
            raise BackendError(f"cannot read the run's config: {e}") from None

    def trains_adapter(self, ref: str | None) -> bool:
        """Whether the run trains a PEFT adapter (so "compare with base model" means something)."""
        try:
            view = self.view(self.resolve(ref))
            view.poll()
            return view.method in PEFT_METHODS
        except BackendError:
            return False

    # -- chat -----------------------------------------------------------------------------------
    def chat(self, ref: str | None, messages: list[dict], compare_base: bool = False,
             **params: Any) -> Iterator[ChatUpdate]:
        """Stream the live model's answer to a chat (its tokenizer's chat template; a raw prompt
        of the last message when it has none), and with `compare_base` the base model's too."""
        path = self.resolve(ref)
        if not messages or not str(messages[-1].get("content", "")).strip():
            raise BackendError("type a message first")
        client = self.client(path, timeout=60.0)
        params = {k: v for k, v in params.items() if v is not None}
        try:
            yield from _stream(client.generate(messages=messages, compare_base=compare_base, **params),
                               compare_base)
        except CommandError as e:
            if "no chat template" not in str(e):
                raise BackendError(f"the run could not answer: {e}") from None
            prompt = messages[-1]["content"]
            try:
                yield from _stream(client.generate(prompt, compare_base=compare_base, **params), compare_base)
            except CommandError as e2:
                raise BackendError(f"the run could not answer: {e2}") from None
        except (RunGone, OSError) as e:
            self._forget_client(path)
            raise BackendError(f"the run is not reachable ({e})") from None

    # -- checkpoints ----------------------------------------------------------------------------
    def saved(self, ref: str | None) -> list[tuple[store.Saved, dict[str, float]]]:
        """What the run saved, each with the metrics logged at its step."""
        path = self.resolve(ref)
        view = self.view(path)
        view.poll()
        return [(s, view.metrics_at(s.step) if s.step is not None else {})
                for s in store.list_saved(RunFolder(Path(path)))]

    def resume_from(self, ref: str | None, checkpoint: str) -> RunInfo:
        """A new run continuing exactly from `checkpoint` of run `ref`."""
        path = self.resolve(ref)
        if not checkpoint or not Path(checkpoint).is_dir():
            raise BackendError("pick a training checkpoint of this run first")
        try:
            cfg = store.resume_config(RunFolder(Path(path)), checkpoint)
        except ConfigError as e:
            raise BackendError(str(e)) from None
        return self.start(cfg)

    def export(self, source: str, target: str, merge_lora: bool = False) -> str:
        if not source or not Path(source).exists():
            raise BackendError("pick a checkpoint, model or adapter first")
        if not target:
            raise BackendError("give a folder to export into")
        try:
            return store.export(source, target, merge_lora)
        except RuntimeError as e:
            raise BackendError(str(e)) from None

    # -- previews -------------------------------------------------------------------------------
    def preview_deepspeed(self, cfg: RunConfig) -> dict:
        try:
            return self.preview.deepspeed(cfg.to_dict())
        except PreviewError as e:
            raise BackendError(str(e)) from None

    def inspect_model(self, path: str) -> dict:
        try:
            return self.preview.model(path)
        except PreviewError as e:
            return {"ok": False, "error": str(e)}

    def inspect_data(self, path: str, fmt: str = "auto") -> dict:
        try:
            return self.preview.data(path, fmt)
        except PreviewError as e:
            return {"ok": False, "error": str(e)}


def _stream(generation, compare_base: bool) -> Iterator[ChatUpdate]:
    text, base = "", ""
    for chunk in generation:
        if chunk.model == "base":
            base += chunk
        else:
            text += chunk
        yield ChatUpdate(text, base if compare_base else None, None)
    result = generation.result
    yield ChatUpdate(result.get("text", text), result.get("base") if compare_base else None,
                     int(result.get("step", 0)), result.get("note"))


def _merge(dst: dict, src: dict) -> None:
    for key, value in src.items():
        if isinstance(value, dict) and isinstance(dst.get(key), dict):
            _merge(dst[key], value)
        else:
            dst[key] = value
