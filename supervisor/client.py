"""The one Python client of a running run: every front end (Gradio, notebook, scripts) uses it.

    client = RunClient.connect("runs/my-run")
    for piece in client.generate("reverse: hello\\n", max_new_tokens=16):
        print(piece, end="")                   # streamed as the live weights produce it
    client.pause(); client.set(lr=1e-4); client.resume()
    for event in client.events(from_line=0):  # history from events.jsonl, then the live stream
        ...

Commands are contract.protocol's pydantic models: each verb builds one (so its defaults, e.g.
`stop(save=True)`, and its validation are the contract's, and a bad argument is refused here
with the server's message), `send(command)` sends one already built. The verbs are `Verbs`,
shared by every front end: the web app's API and the notebook's `Run` call the same methods
through their session (app.session_verbs.SessionVerbs).

It speaks contract.protocol (newline-delimited JSON, the run's token from control.json) over one
connection for commands and one per `events()` stream. Which key: `role=Role.OPERATOR` reads
control.json, `role=Role.VIEWER` viewer.json (the run then refuses every command that changes it,
contract.protocol.roles), `address=PATH` a copy of either handed to you; the default is the
operator's key when this user may read control.json, else the viewer's. A lost connection is reopened on the next
call; an events stream resumes at the line after the last one it yielded, so a reconnect loses
no event and repeats none. When the run has ended, `events()` yields the rest of events.jsonl
and stops. Torch-free, like the rest of app/.
"""

from __future__ import annotations

import queue
from pathlib import Path
from typing import Any, Callable, Generic, Iterator, TypeVar

from contract.protocol.answers import (AddSourceAnswer, Answer, BranchAnswer, BranchesAnswer, EvaluateAnswer,
                                       ForgetAnswer, GenerateAnswer, InboxAnswer, RewindAnswer, SaveAnswer,
                                       SetAnswer, SetWeightAnswer, SnapshotAnswer, SourcesAnswer, StateAnswer,
                                       StatusAnswer, StopAnswer, TeachAnswer)
from contract.protocol.base import Command, ProtocolError
from contract.protocol.branch_commands import Branch, Branches, Rewind, Snapshot
from contract.protocol.commands import Evaluate, Generate, Pause, Resume, Save, Set, Status, Stop, Subscribe, command_from_wire
from contract.protocol.data_commands import AddSource, Forget, Inbox, RemoveSource, SetWeight, SourceFormat, Teach
from contract.protocol.rating_commands import Rate, RateAnswer, RateChat, RateChatAnswer
from contract.protocol.frames import Done, Error, EventLine, Frame, Token
from contract.protocol.reward_commands import AddReward, RemoveReward, RewardsAnswer
from contract.exports import GGUF_TYPES
from contract.protocol.roles import Role
from contract.run_folder import read_events
from supervisor import exports
from supervisor.connection import Answers, CommandError, Connection, RunGone, next_answer

A = TypeVar("A", bound=Answer)
C = TypeVar("C", bound=Command)
__all__ = ["Chunk", "CommandError", "Generation", "RunClient", "RunGone", "Verbs"]


class Chunk(str):
    """A piece of streamed text; `model` is "current" (the weights being trained) or "base"
    (the same request answered with the PEFT adapter disabled)."""

    model: str

    def __new__(cls, text: str, model: str = "current") -> "Chunk":
        chunk = super().__new__(cls, text)
        chunk.model = model
        return chunk


class Generation(Generic[A]):
    """A streamed answer: iterate for its chunks; afterwards `result` holds the run's answer
    (contract.protocol.answers: generate's `text`, `step` the training step it was answered at,
    `base` with compare_base)."""

    def __init__(self, answers: "queue.Queue[Frame]", timeout: float | None, returns: type[A]):
        self._answers, self._timeout, self._returns = answers, timeout, returns
        self.result: A | None = None

    def __iter__(self) -> Iterator[Chunk]:
        while self.result is None:
            frame = next_answer(self._answers, self._timeout)
            if isinstance(frame, Token):
                yield Chunk(frame.text, frame.model)
            elif isinstance(frame, Done):
                self.result = parsed(self._returns, frame.result)
            elif isinstance(frame, Error):
                raise CommandError(frame.message)

    def wait(self) -> A:
        for _ in self:
            pass
        assert self.result is not None  # the loop ends only with a result (or raises)
        return self.result

    @property
    def text(self) -> str:
        return self._generated().text

    @property
    def base_text(self) -> str | None:
        return self._generated().base

    @property
    def step(self) -> int:
        return self.wait().step  # type: ignore[attr-defined]

    def _generated(self) -> GenerateAnswer:
        answer = self.wait()
        if not isinstance(answer, GenerateAnswer):
            raise TypeError(f"a {type(answer).__name__} has no text; read its fields")
        return answer


def parsed(returns: type[A], result: Any) -> A:
    """The run's `done` result as the command's answer model (contract.protocol.answers)."""
    try:
        return returns.model_validate(result)
    except ValueError as e:  # pydantic's ValidationError: a run of another version
        raise CommandError(f"the run's answer does not fit {returns.__name__}: {e}") from None


class Verbs:
    """The verbs of a run, one set that every front end calls (RunClient over its own connection;
    app.session.SessionVerbs through a front end's session, so the web app's API and the
    notebook's `Run`): each builds its contract.protocol command, whose model holds the defaults
    and the rules, so a bad argument gets the same words everywhere, raised as `Refused` before
    anything is sent; `send` and `stream` are how a front end delivers it. Stop is not among them:
    the client's `stop` sends the command, a session's also ends the run's processes."""

    Refused: type[Exception] = CommandError  # what a refused argument is raised as

    def send(self, command: Command, timeout: float | None = None) -> Any:
        """Deliver `command` and return its answer model (`type(command).returns`)."""
        raise NotImplementedError

    def stream(self, command: Command, timeout: float | None = None) -> Generation[Any]:
        """Deliver a command whose answer streams (`generate`, `complete`): its pieces, then `result`."""
        raise NotImplementedError

    def build(self, make: Callable[[], C]) -> C:
        """`make()`'s command; a bad argument is refused (as `Refused`) like the run would refuse it."""
        try:
            return make()
        except ProtocolError as e:
            raise self.Refused(str(e)) from None

    def command(self, cmd: str, timeout: float | None = None, **args: Any) -> Answer:
        """Send the command named `cmd` with wire arguments `args` and wait for its answer (it
        takes effect at the next step boundary)."""
        return self.send(self.build(lambda: command_from_wire(cmd, args)), timeout)

    def generate(self, prompt: str | None = None, *, messages: list[dict] | None = None,
                 timeout: float | None = None, **params: Any) -> Generation[GenerateAnswer]:
        """Stream an answer of the live weights to `prompt` or to chat `messages` (the model's
        chat template); params: max_new_tokens, temperature, top_p, top_k, repetition_penalty,
        stop, seed, compare_base."""
        args = dict(params)
        if prompt is not None:
            args["prompt"] = prompt
        if messages is not None:
            args["messages"] = messages
        return self.stream(self.build(lambda: Generate(**args)), timeout)

    def chat(self, prompt: str | None = None, *, messages: list[dict] | None = None, as_chat: bool = False,
             **params: Any) -> str:
        """The whole answer at once; with `as_chat`, a plain `prompt` is sent as one user turn."""
        if as_chat and prompt is not None:
            prompt, messages = None, [{"role": "user", "content": prompt}]
        return self.generate(prompt, messages=messages, **params).text

    def pause(self) -> StateAnswer:
        """Pause at the next step boundary; the model stays in memory and still answers chats."""
        return self.send(Pause())

    def resume(self) -> StateAnswer:
        return self.send(Resume())

    def save(self) -> SaveAnswer:
        """A training checkpoint of the present step, in the run's checkpoints/."""
        return self.send(Save())

    def export_gguf(self, target: str | Path, dtype: str = "f16") -> str:
        """The live model as a GGUF file for llama.cpp / Ollama, with its Modelfile, in the new
        folder `target`: a checkpoint saved at the next step boundary (`save`: every rank takes
        part), then converted from it by llama.cpp's converter in a process of its own while the
        run trains on (a LoRA run's adapter merged first; supervisor.exports). `dtype`: one of
        contract.exports.GGUF_TYPES. Returns the export's last line (where the file is)."""
        if dtype not in GGUF_TYPES:
            raise self.Refused(f"dtype: {dtype!r} is not one of {', '.join(GGUF_TYPES)}")
        saved = self.save()
        try:
            return exports.export(saved.checkpoint, str(target), gguf=dtype)
        except RuntimeError as e:
            raise self.Refused(str(e)) from None

    def evaluate(self) -> EvaluateAnswer:
        return self.send(Evaluate())

    def set(self, **changes: Any) -> SetAnswer:
        """Live settings (contract.protocol.commands.Set's fields): lr, lr_scale, grad_clip,
        eval_every_n_steps, save_every_n_steps, generation (a dict of generation defaults) ..."""
        return self.send(self.build(lambda: Set(**changes)))

    def rewind(self, target: str | int) -> RewindAnswer:
        """Go back in place to a checkpoint ("step-40", 40) or snapshot (its name); the steps
        after it are abandoned. Returns the `rewind` event's fields."""
        return self.send(self.build(lambda: Rewind(target=str(target))))

    def branch(self, target: str | int, name: str, **settings: Any) -> BranchAnswer:
        """Rewind to `target` and go on as the new branch `name`, optionally with changed
        settings (lr, lr_scale, grad_clip, eval_every_n_steps, save_every_n_steps)."""
        return self.send(self.build(lambda: Branch(target=str(target), branch=name, **settings)))

    def snapshot(self, name: str | None = None) -> SnapshotAnswer:
        """Keep the training state in host memory (for an instant rewind); its size and the
        snapshots kept."""
        return self.send(self.build(lambda: Snapshot(snapshot=name)))

    def branches(self) -> BranchesAnswer:
        """The branch tree, the present branch, the checkpoints and snapshots one can go back to."""
        return self.send(Branches())

    # -- data: sources and the inbox of taught answers -------------------------------------
    def add_source(self, path: str, weight: float | None = None, format: SourceFormat | None = None,
                   name: str = "") -> AddSourceAnswer:
        """Add a training source from the next step on (read and checked like data at start: the
        reply's `report` names dropped rows; an unusable file is refused). `weight`, `format`:
        AddSource's defaults when not given. Returns the source and all `sources`."""
        given: dict[str, Any] = {k: v for k, v in (("weight", weight), ("format", format)) if v is not None}
        return self.send(self.build(lambda: AddSource(path=str(path), source=name, **given)))

    def set_weight(self, name: str, weight: float) -> SetWeightAnswer:
        """Change a source's weight from the next step on; 0 pauses it."""
        return self.send(self.build(lambda: SetWeight(source=name, weight=weight)))

    def remove_source(self, name: str) -> SourcesAnswer:
        """Stop drawing from a source from the next step on."""
        return self.send(self.build(lambda: RemoveSource(source=name)))

    def add_reward(self, entry: dict[str, Any] | None = None, **keys: Any) -> RewardsAnswer:
        """Score a GRPO run's samples with one more reward function from the next step on: an
        entry as grpo.rewards takes one, given as a dict and/or by keyword
        (`add_reward(kind="regex", pattern=r"\\d", weight=0.5)`, `add_reward(function="my.py:f")`).
        Returns the run's rewards now."""
        return self.send(self.build(lambda: AddReward(reward={**(entry or {}), **keys})))

    def remove_reward(self, name: str) -> RewardsAnswer:
        """Stop scoring with the reward named `name` from the next step on (not the last one)."""
        return self.send(self.build(lambda: RemoveReward(reward=name)))

    def teach(self, prompt: str | None, answer: str, *, messages: list[dict] | None = None,
              **rate: Any) -> TeachAnswer:
        """Teach `answer` for `prompt` (as given to generate) or chat `messages`: appended to the
        run's inbox durably, then mixed into the next batches. rate: per_step, steps,
        check_after, weight (defaults: the run's teach.* settings). Returns the entry's `id`
        and the model's greedy answer before (`old`)."""
        where: dict[str, Any] = {"messages": messages} if messages is not None else {"prompt": prompt}
        return self.send(self.build(lambda: Teach(answer=answer, **where, **rate)))

    def prefer(self, prompt: str | None, chosen: str, rejected: str, *, messages: list[dict] | None = None,
               **rate: Any) -> TeachAnswer:
        """A preference from the chat: for `prompt` (as given to generate) or chat `messages`,
        `chosen` is the better answer and `rejected` the worse (say the model's own answer, edited
        into `chosen`). Into the inbox durably, as teach; the run trains on the pair from the next
        step with its objective (kto: two judged answers; sft: the chosen answer plus the pair
        loss of preference.sft_pairs). The answer holds the entry's `id` and `margin`: log
        p(chosen) - log p(rejected) under the live weights. rate as for teach."""
        return self.teach(prompt, chosen, messages=messages, rejected=rejected, **rate)

    def inbox(self) -> InboxAnswer:
        """The inbox: `entries` ({id, prompt, answer, removed, steps_left, and a preference's
        rejected}) and the `sources`."""
        return self.send(Inbox())

    def forget(self, entry_id: str) -> ForgetAnswer:
        """Stop training on inbox entry `entry_id` from the next step on."""
        return self.send(self.build(lambda: Forget(id=entry_id)))

    def rate(self, step: int, sample: int, score: float | str = "up") -> RateAnswer:
        """Rate sample `sample` of step `step` of a GRPO run (the numbers of its `samples` event):
        "up" (1), "down" (-1) or a score in [-1, 1]. In the run's inbox durably before the answer;
        the next step trains the sample's group once more with a `human` reward. `forget(answer.id)`
        takes it back."""
        given: dict[str, Any] = {"step": step, "sample": sample, "score": score}  # up / down: Rate's words
        return self.send(self.build(lambda: Rate(**given)))

    def rate_chat(self, prompt: str | None, answer: str, score: float | str = "up", *,
                  messages: list[dict] | None = None, step: int | None = None) -> RateChatAnswer:
        """Rate an answer the chat gave with a GRPO run's live weights: `prompt` (as given to
        generate) or chat `messages`, the `answer` text as it came back, and optionally the
        `step` it was answered at (generate's). "up" (1), "down" (-1) or a score in [-1, 1]. In
        the run's inbox durably before the answer; the next step samples grpo.num_generations - 1
        fresh answers to the prompt and trains them with this one as a group, with a `human`
        reward (docs/rewards.md, "Rating a chat answer"). `forget(answer.id)` takes it back."""
        given: dict[str, Any] = {"answer": answer, "score": score, "step": step,
                                 **({"messages": messages} if messages is not None else {"prompt": prompt})}
        return self.send(self.build(lambda: RateChat(**given)))

    def status(self, ranks: bool = False) -> StatusAnswer:
        """Step, epoch, state, last metrics, queue length and memory (rank 0's at once; with
        `ranks`, every rank's, gathered at the next boundary)."""
        return self.send(self.build(lambda: Status(ranks=ranks)))


class RunClient(Verbs):
    """Drive one run over its control socket: the verbs (Verbs), each building a contract.protocol
    command and returning its answer model. The socket, reader thread and reconnection are
    supervisor.connection's."""

    def __init__(self, run_dir: str | Path, connect_timeout: float = 60.0, role: Role | None = None,
                 address: str | Path | None = None):
        self.connection = Connection(run_dir, connect_timeout, role, address)
        self.folder = self.connection.folder

    @classmethod
    def connect(cls, run_dir: str | Path, timeout: float = 60.0, role: Role | None = None,
                address: str | Path | None = None) -> "RunClient":
        """Connect to the run in `run_dir`, waiting up to `timeout` s for its server to start;
        `role` / `address`: which key (see the module's docstring)."""
        client = cls(run_dir, connect_timeout=timeout, role=role, address=address)
        client.connection.open_now()
        return client

    @property
    def connected(self) -> bool:
        """Whether the connection to the run is open now (sending then never waits to connect)."""
        return self.connection.connected

    def key_role(self) -> Role:
        """The role of the key this client sends (what the run will let it do)."""
        return self.connection.key_role()

    # -- delivering commands ---------------------------------------------------------------------
    def send(self, command: Command, timeout: float | None = None) -> Any:
        """Send a contract.protocol command and wait for its answer (`type(command).returns`). A
        status read whose connection the server closed as it was sent (an idle connection's close
        crossing the request) is asked once more on a fresh one: it changes nothing; a command
        with an effect is never sent twice."""
        for attempt in (1, 2):
            answers = self.connection.request(command)
            while True:
                frame = next_answer(answers, timeout)
                if isinstance(frame, Done):
                    return parsed(type(command).returns, frame.result)
                if isinstance(frame, Error):
                    if frame.lost and attempt == 1 and isinstance(command, Status):
                        break
                    raise CommandError(frame.message)
        raise AssertionError("unreachable: the second try returns or raises")

    def stream(self, command: Command, timeout: float | None = None) -> Generation[Any]:
        """Send a command whose answer streams (`generate`, `complete`): its pieces, then `result`."""
        return Generation(self.connection.request(command), timeout, type(command).returns)

    def submit(self, command: Command, answers: Answers) -> None:
        """Send `command`; every message of its answer (`token`, then `done` or `error`) is handed
        to `answers.put` from this client's reader thread (an event loop's front end passes one
        that moves it onto the loop: no thread of its own waits for the run)."""
        self.connection.request(command, answers)

    def stop(self, save: bool = Stop().save) -> StopAnswer:
        """Stop at the next boundary; `save` (contract.protocol.commands.Stop's default, true): a
        checkpoint now and the final model at the end."""
        return self.send(self.build(lambda: Stop(save=save)))

    # -- events -------------------------------------------------------------------------------------
    def events(self, from_line: int = 0, follow: bool = True,
               reconnect_timeout: float | None = None) -> Iterator[dict]:
        """Every event from line `from_line` of events.jsonl on, each with its `line` number;
        with `follow`, then the live stream until the run ends. A dropped connection is reopened
        (for up to `reconnect_timeout` s; None: while the run's processes live)."""
        next_line = from_line
        while follow:
            try:
                for frame in self.connection.subscribe(Subscribe(from_line=next_line), reconnect_timeout):
                    if isinstance(frame, EventLine) and frame.line >= next_line:
                        next_line = frame.line + 1
                        yield {**frame.event, "line": frame.line}
                    elif isinstance(frame, Error):
                        raise CommandError(frame.message)
            except RunGone:
                break
            except OSError:
                pass  # reconnect and go on from next_line
        for n, event in enumerate(read_events(self.folder.events, next_line), start=next_line):
            yield {**event, "line": n}

    def close(self) -> None:
        self.connection.close()

    def __enter__(self) -> "RunClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
