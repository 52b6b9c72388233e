"""The named Gradio API endpoints, for `gradio_client` scripts (documented in the README):

    /start   /stop   /pause   /resume   /set   /save   /evaluate   /chat   /status   /runs
    /rewind  /branch /snapshot /branches
    /add_source  /set_weight  /remove_source  /teach  /inbox  /forget
    /add_reward  /remove_reward  /rate                      (a GRPO run's)

(A "path" in a run's answer is called "file" here, as the run info's is "folder".)

Each takes plain values and returns a JSON object; `run` is a run name, a run folder path, or
empty for the app's current run. A failure comes back as a Gradio error with a readable message.
With logins (app.users), a viewer's client (`Client(url, auth=(name, password))`) may call /chat,
/status, /runs, /branches and /inbox; every other endpoint answers "refused: <endpoint> needs
the operator role; this login is a viewer's" (the session checks, app.web.access).
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from typing import Any, Callable, Iterator

import gradio as gr
from pydantic import BaseModel

from app.form import DEFAULT_PRESET, config_from_text
from app.live_settings import reward_entry
from app.session import SessionError
from app.session_verbs import SessionVerbs
from app.web.backend import Backend
from contract.config.schema import ConfigError
from contract.protocol.answers import Answer
from contract.protocol.base import ProtocolError
from contract.protocol.commands import Set, Stop
from supervisor import RunInfo


def _info(info: RunInfo) -> dict:
    # "folder", not "path": gradio_client takes any object with a "path" key for a file to fetch
    fields = dataclasses.asdict(info)
    return {"run": info.name, "folder": fields.pop("path"), **fields}


def _answer(verb: Callable[[], Answer]) -> dict:
    """The run's answer to `verb()` (one of the client's verbs, supervisor.client.Verbs, through
    the session: its arguments, defaults and checks are the command's) as its model's JSON
    (contract.protocol.answers), "path" keys named "file"."""
    return _no_paths(_call(verb).wire())


def _call(fn, *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except (SessionError, ConfigError, ProtocolError) as e:
        raise gr.Error(str(e), print_exception=False) from None


def register(backend: Backend) -> None:
    """Add the endpoints to the Blocks being built."""

    def start(config: str = "", preset: str = DEFAULT_PRESET) -> dict:
        """Start a run: `config` is YAML or JSON (a partial run config) laid over `preset`
        ("" for the schema defaults). Returns the run's info (name, path, state ...)."""
        _call(backend.session.require, "start")  # before the config is even read
        cfg = _call(config_from_text, config, preset, str(backend.output_dir))
        return _info(_call(backend.session.start, cfg))

    def stop(run: str = "", save: bool = Stop().save) -> dict:
        """Stop a run (with `save`, the default as in every front end: a checkpoint first and the
        final model); waits until every process of it has ended. Returns its final info."""
        return _info(_call(backend.session.stop, run, save=save, wait=True))

    def verbs(run: str) -> SessionVerbs:
        """The client's verbs for `run`, sent through the app's session (its role checks)."""
        return SessionVerbs(backend.session, run)

    def pause(run: str = "") -> dict:
        """Pause at the next step boundary; the model stays in memory and still answers chats."""
        return _answer(lambda: verbs(run).pause())

    def resume(run: str = "") -> dict:
        """Resume a paused run."""
        return _answer(lambda: verbs(run).resume())

    def save(run: str = "") -> dict:
        """Save a training checkpoint now."""
        return _answer(lambda: verbs(run).save())

    def evaluate(run: str = "") -> dict:
        """Evaluate now; returns the metrics."""
        return _answer(lambda: verbs(run).evaluate())

    def chat(message: str, run: str = "", max_new_tokens: int = 64, temperature: float = 0.0,
             compare_base: bool = False) -> Iterator[dict]:
        """Ask the live model; streams {"text", "base", "step", "done"} (the last one has the
        training step the answer came from)."""
        messages = [{"role": "user", "content": message}]
        try:
            for update in backend.session.chat(run, messages, compare_base=compare_base,
                                       max_new_tokens=max_new_tokens, temperature=temperature):
                yield {"text": update.text, "base": update.base, "step": update.step,
                       "done": update.done, "note": update.note}
        except SessionError as e:
            raise gr.Error(str(e), print_exception=False) from None

    def status(run: str = "") -> dict:
        """State, step, total steps, epoch, ETA, latest metrics and live settings."""
        found = _call(backend.watch.status, run)
        found["folder"] = found.pop("path")
        return found

    def runs() -> list[dict]:
        """Every run, newest first."""
        return [_info(i) for i in backend.session.runs()]

    for fn, name in ((start, "start"), (stop, "stop"), (pause, "pause"), (resume, "resume"),
                     (_set_endpoint(verbs), "set"), (save, "save"), (evaluate, "evaluate"), (chat, "chat"),
                     (status, "status"), (runs, "runs")):
        gr.api(fn, api_name=name, concurrency_limit=None)
    for fn in [*_tree_and_data(verbs), *_rewards(verbs)]:
        gr.api(fn, api_name=fn.__name__, concurrency_limit=None)


def _set_endpoint(verbs: Callable[[str], SessionVerbs]) -> Callable[..., dict]:
    """/set: `run`, then one optional parameter per field of contract.protocol.commands.Set (its
    fields, not a list of ours: a new live setting is an argument here at once)."""
    fields = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None,
                                annotation=_api_type(field.annotation)) for name, field in Set.model_fields.items()]
    signature = inspect.Signature([inspect.Parameter("run", inspect.Parameter.POSITIONAL_OR_KEYWORD, default="",
                                                     annotation=str), *fields], return_annotation=dict)

    def set_values(*given: Any, **named: Any) -> dict:
        """Change live settings at the next step boundary (give at least one)."""
        args = signature.bind(*given, **named).arguments
        run = args.pop("run", "")
        return _answer(lambda: verbs(run).set(**{k: v for k, v in args.items() if v is not None}))

    # gradio reads the endpoint's parameters from its signature and type hints
    set_values.__signature__ = signature  # type: ignore[attr-defined]
    set_values.__annotations__ = {p.name: p.annotation for p in signature.parameters.values()} | {"return": dict}
    return set_values


def _api_type(annotation: Any) -> Any:
    """A Set field's type as the API declares it: a nested model (generation) is a JSON object."""
    kinds = typing.get_args(annotation) or (annotation,)
    if any(isinstance(k, type) and issubclass(k, BaseModel) for k in kinds):
        return dict | None
    return annotation


def _tree_and_data(verbs: Callable[[str], SessionVerbs]) -> list:
    """The branch and data endpoints: each calls the client's verb (its arguments, defaults and
    checks are the command's own) and returns the run's answer."""
    def rewind(target: str, run: str = "") -> dict:
        """Go back in place to a checkpoint (step-40, 40, a checkpoint folder) or snapshot:NAME."""
        return _answer(lambda: verbs(run).rewind(target))

    def branch(target: str, branch: str, run: str = "", lr: float | None = None) -> dict:
        """Rewind to `target` and go on as the new branch `branch` (with `lr`, if given)."""
        return _answer(lambda: verbs(run).branch(target, branch, **({} if lr is None else {"lr": lr})))

    def snapshot(run: str = "", name: str = "") -> dict:
        """Keep the complete training state in host memory now (default name snap-<step>)."""
        return _answer(lambda: verbs(run).snapshot(name or None))

    def branches(run: str = "") -> dict:
        """The branch tree, the present branch, its checkpoints and the snapshots kept."""
        return _answer(lambda: verbs(run).branches())

    def add_source(path: str, run: str = "", weight: float | None = None, format: str | None = None,
                   name: str = "") -> dict:
        """Add a training source from the next step on (checked row by row first)."""
        return _answer(lambda: verbs(run).add_source(path, weight=weight, format=format, name=name))  # type: ignore[arg-type]

    def set_weight(source: str, weight: float, run: str = "") -> dict:
        """Change a source's weight from the next step on (0 pauses it)."""
        return _answer(lambda: verbs(run).set_weight(source, weight))

    def remove_source(source: str, run: str = "") -> dict:
        """Stop drawing from a source."""
        return _answer(lambda: verbs(run).remove_source(source))

    def teach(prompt: str, answer: str, run: str = "") -> dict:
        """Teach `answer` for `prompt` (sent as a chat message through the chat template)."""
        try:
            return _answer(lambda: verbs(run).teach(None, answer, messages=[{"role": "user", "content": prompt}]))
        except gr.Error as e:
            if "chat template" not in str(e):
                raise
            return _answer(lambda: verbs(run).teach(prompt, answer))

    def inbox(run: str = "") -> dict:
        """Every taught entry, removed ones marked."""
        return _answer(lambda: verbs(run).inbox())

    def forget(id: str, run: str = "") -> dict:
        """Stop training on an inbox entry (t1, t2 ...)."""
        return _answer(lambda: verbs(run).forget(id))

    return [rewind, branch, snapshot, branches, add_source, set_weight, remove_source, teach, inbox, forget]


def _rewards(verbs: Callable[[str], SessionVerbs]) -> list:
    """A GRPO run's reward endpoints (any other run refuses them, saying why)."""
    def add_reward(reward: str, run: str = "") -> dict:
        """Score the samples with one more reward from the next step on: an entry as grpo.rewards
        takes one, as YAML or JSON ({kind: regex, pattern: 'a+', name: as, weight: 0.5} or
        {function: my_rewards.py:brevity})."""
        return _answer(lambda: verbs(run).add_reward(reward_entry(reward)))

    def remove_reward(reward: str, run: str = "") -> dict:
        """Stop scoring with the reward named `reward` from the next step on."""
        return _answer(lambda: verbs(run).remove_reward(reward))

    def rate(step: int, sample: int, score: str = "up", run: str = "") -> dict:
        """Rate sample `sample` of step `step` (the samples event's numbers): up, down or a score
        in [-1, 1]; the next step trains its group with a `human` reward."""
        return _answer(lambda: verbs(run).rate(step, sample, score))

    def rate_chat(prompt: str, answer: str, score: str = "up", step: int | None = None, run: str = "") -> dict:
        """Rate an answer the chat gave with the live weights to `prompt` (as sent to generate):
        up, down or a score in [-1, 1]; the next step samples fresh answers to the prompt and
        trains them with it as a group, with a `human` reward."""
        return _answer(lambda: verbs(run).rate_chat(prompt, answer, score, step=step))

    return [add_reward, remove_reward, rate, rate_chat]


def _no_paths(value: Any) -> Any:
    """`value` with every "path" key named "file": gradio_client fetches any object with a "path"
    key as a file to download (a source's data file would be refused, or copied)."""
    if isinstance(value, dict):
        return {("file" if k == "path" else k): _no_paths(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_no_paths(v) for v in value]
    return value
