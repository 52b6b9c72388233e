"""The Chat tab's "Which answer is better?": one question answered twice (two samples of the live
model, or the live model and the run or checkpoint in the Compare column), then "this one is
better" on either (the other is the rejected answer), or "edit and prefer" (the edited text is the
chosen answer, the live model's answer the rejected one). The pair goes into the run's inbox as
Teach's answers do (the contract's Teach command with `rejected`; RunClient.prefer is the same
command), and the page shows the entry's id and the model's log-probability margin of chosen over
rejected when it came in; the check some steps later is in the inbox on the Train tab.

A pair the user chooses can always be trained: before generating, the run says how many tokens
the question takes (the `complete` command scoring the prompt alone), and the answers are kept to
what is left of `data.max_length` after the question and the end token (the run's inbox refuses a
longer pair); the page says so when that cuts the chat's setting. The choice buttons stay off
until two different, non-empty answers are there. A viewer's press is refused naming the action
(prefer), before anything is sent."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gradio as gr

from app.session import SessionError
from app.web.access import OPERATOR, may_change
from app.web.backend import Backend
from app.web.widgets import readable
from contract.config.load import load_config
from contract.protocol.answers import TeachAnswer
from contract.protocol.completion_commands import Complete
from contract.protocol.data_commands import Teach

SAMPLE = "Another sample of the live model"
COMPARED = "The Compare column (another run or a checkpoint)"
MARKUP = re.compile(r"([\\`*_{}\[\]()#+\-.!|<>~])")
SAMPLE_TEMPERATURE = 1.0  # two greedy answers are the same answer: samples at least this warm
PREFER = "prefer (choosing the better answer)"  # the action a viewer's refusal names


def build(backend: Backend, run_state: gr.State, copy: gr.State | None, settings: list, history: gr.Chatbot,
          prefix: str = "chat-prefer") -> None:
    """The fold under a chat; `copy` is the Compare column's target ({"path", "label"} or None;
    None: no Compare column, B is always another sample), `settings` the chat's generation
    settings (max_new, temperature, top_p, top_k, repetition), `history` the chat the chosen pairs
    are recorded in, `prefix` its components' element ids (the Chat tab's, or the side chat's)."""
    compared = copy is not None
    copy = copy if copy is not None else gr.State(None)
    with gr.Accordion("Which answer is better? One question answered twice: pick the better answer, or "
                      "edit one into the answer you wanted", open=False, elem_id=f"{prefix}-fold"):
        with gr.Row(equal_height=True):
            question = gr.Textbox(label="The question", max_lines=4, scale=4, elem_id=f"{prefix}-question")
            second = gr.Radio([SAMPLE, COMPARED], value=SAMPLE, label="The second answer", scale=2,
                              elem_id=f"{prefix}-second", visible=compared)
            ask = gr.Button("Two answers", variant="primary", scale=1, elem_id=f"{prefix}-ask")
        with gr.Row(equal_height=True):
            with gr.Column():
                first_text = gr.Textbox(label="A: the live model", interactive=False, lines=2,
                                        elem_id=f"{prefix}-a")
                first_better = gr.Button("A is better", interactive=False, elem_id=f"{prefix}-a-better", elem_classes=[OPERATOR])
            with gr.Column():
                second_text = gr.Textbox(label="B", interactive=False, lines=2, elem_id=f"{prefix}-b")
                second_better = gr.Button("B is better", interactive=False, elem_id=f"{prefix}-b-better", elem_classes=[OPERATOR])
        with gr.Row(equal_height=True):
            edited = gr.Textbox(label="Answer A, edited into the answer you wanted", max_lines=4, scale=4,
                                elem_id=f"{prefix}-edit")
            edit_prefer = gr.Button("Edit and prefer", scale=1, elem_id=f"{prefix}-edit-send", elem_classes=[OPERATOR])
        result = gr.Markdown("", elem_id=f"{prefix}-result")
    pair = gr.State(None)  # {"question", "a", "b"}: the two answers shown
    view = PairView(first_text, second_text, edited, result, pair, first_better, second_better, history)

    def asked(path: str | None, text: str, which: str, copied: dict | None, *opts: Any):
        yield from two_answers(backend, view, path, text, which, copied, *opts)

    ask.click(readable(asked), inputs=[run_state, question, second, copy, *settings],
              outputs=[first_text, second_text, edited, result, pair, first_better, second_better],
              concurrency_limit=None,
              show_progress="hidden", api_visibility="private")
    chosen: dict[str, Any] = dict(outputs=[result, history], api_visibility="private", concurrency_limit=None)
    first_better.click(readable(lambda path, shown, chat: pick(backend, view, path, shown, "a", chat)),
                       inputs=[run_state, pair, history], **chosen)
    second_better.click(readable(lambda path, shown, chat: pick(backend, view, path, shown, "b", chat)),
                        inputs=[run_state, pair, history], **chosen)
    edit_prefer.click(readable(lambda path, shown, text, chat: prefer_edit(backend, view, path, shown, text, chat)),
                      inputs=[run_state, pair, edited, history], **chosen)


@dataclass
class PairView:
    """The components the preference handlers update."""
    first: gr.Textbox
    second: gr.Textbox
    edited: gr.Textbox
    result: gr.Markdown
    pair: gr.State
    a_better: gr.Button  # "A is better" and "B is better": on only for two different answers
    b_better: gr.Button
    history: gr.Chatbot | None = None  # the chat a chosen pair is recorded in


@dataclass(frozen=True)
class Budget:
    """How long an answer may be for its pair to be trained: the prompt and either answer with
    its end token must fit the run's data.max_length (engine.data.inbox.encode_pair)."""
    max_length: int
    prompt_tokens: int

    @property
    def answer_tokens(self) -> int:
        return self.max_length - self.prompt_tokens - 1  # the end token follows each answer

    def note(self, asked: int) -> str:
        """The page's words when the budget cuts the `asked` tokens (empty when it does not)."""
        if self.answer_tokens >= asked:
            return ""
        return (f"Answers are kept to {self.answer_tokens} tokens (not {asked}): the question takes "
                f"{self.prompt_tokens} of the run's data.max_length={self.max_length}, and a chosen pair "
                "(question, answer and end token) must fit it to be trained.")


def pair_budget(backend: Backend, path: str | None, question: str) -> Budget:
    """The run's data.max_length and the tokens `question` takes as the chat sends it (its chat
    template, or the raw prompt for a model without one), asked of the run (`complete` with no new
    tokens only tokenizes). SessionError when no answer fits."""
    root = backend.session.resolve(path)
    max_length = load_config(Path(root) / "config.yaml").data.max_length
    chat = [{"role": "user", "content": question}]
    try:
        found = backend.verbs(root).send(Complete(messages=chat, max_new_tokens=0, echo=True))
    except SessionError as e:
        if "chat template" not in str(e):
            raise
        found = backend.verbs(root).send(Complete(prompts=[question], max_new_tokens=0, echo=True))
    budget = Budget(max_length, int(found.usage["prompt_tokens"]))
    if budget.answer_tokens < 1:
        raise SessionError(f"the question takes {budget.prompt_tokens} tokens of the run's data.max_length="
                           f"{max_length}: no room for an answer and its end token; shorten the question")
    return budget


def choosable(first: str, second: str) -> bool:
    """Whether two answers make a pair to choose from: both non-empty, and different."""
    return bool(first.strip()) and bool(second.strip()) and first != second


def answer(backend: Backend, path: str | None, question: str, params: dict) -> str:
    """The run's whole answer to `question` alone (its chat template, or the raw prompt)."""
    text = ""
    for update in backend.session.chat(path, [{"role": "user", "content": question}], **params):
        text = update.text
    return text


def sampling(max_new: Any, temperature: Any, top_p: Any, top_k: Any, repetition: Any) -> dict:
    """The chat's settings as generate's parameters."""
    return dict(max_new_tokens=int(max_new), temperature=float(temperature), top_p=float(top_p),
                top_k=int(top_k or 0), repetition_penalty=float(repetition))


def two_answers(backend: Backend, view: PairView, path: str | None, question: str, which: str,
                copied: dict | None, *opts: Any):
    """Answer `question` twice: A from the live model, B from another sample of it (`which` is
    SAMPLE; unseeded samples draw fresh seeds, so they differ) or from the Compare column's run."""
    question = (question or "").strip()
    if not question:
        raise SessionError("type the question first")
    if which == COMPARED and not copied:
        raise SessionError("nothing to compare with: pick a run or checkpoint under Compare and press Compare first")
    params = sampling(*opts)
    if which == SAMPLE:
        params["temperature"] = max(params["temperature"], SAMPLE_TEMPERATURE)
    off = gr.update(interactive=False)
    waiting = "… waiting for the next step boundary"
    yield {view.first: waiting, view.second: "…", view.edited: "", view.result: "", view.pair: None,
           view.a_better: off, view.b_better: off}
    budget = pair_budget(backend, path, question)  # said before generating, not refused after choosing
    note = budget.note(params["max_new_tokens"])
    params["max_new_tokens"] = min(params["max_new_tokens"], budget.answer_tokens)
    yield {view.result: note}
    first = answer(backend, path, question, params)
    yield {view.first: first, view.edited: first}
    if copied and which == COMPARED:
        second, label = answer(backend, copied["path"], question, params), f"B: {copied['label']}"
    else:
        second, label = answer(backend, path, question, params), "B: another sample of the live model"
    ok = gr.update(interactive=choosable(first, second) and may_change(backend))  # a viewer may only ask
    why = "" if choosable(first, second) else (
        " The two answers are the same, or one is empty: nothing to choose between. Ask again, or edit A "
        "into the answer you wanted (Edit and prefer).")
    yield {view.second: gr.update(value=second, label=label), view.a_better: ok, view.b_better: ok,
           view.pair: {"question": question, "a": first, "b": second}, view.result: (note + why).strip()}


def pick(backend: Backend, view: PairView, path: str | None, shown: dict | None, better: str,
         chat: list | None = None) -> dict:
    """"A is better" (`better` "a") or "B is better": the other answer is the rejected one; the
    pair is recorded in `chat` (the chat history shown)."""
    if not shown:
        raise SessionError("press Two answers first")
    if not choosable(shown["a"], shown["b"]):
        raise SessionError("the two answers are the same, or one is empty: press Two answers again, or use "
                           "Edit and prefer")
    worse = "b" if better == "a" else "a"
    taken = prefer(backend, path, shown["question"], shown[better], shown[worse])
    return preferred(view, chat, shown["question"], taken)


def prefer_edit(backend: Backend, view: PairView, path: str | None, shown: dict | None, edited: str,
                chat: list | None = None) -> dict:
    """"Edit and prefer": the edited text is chosen over the live model's answer (A)."""
    if not shown:
        raise SessionError("press Two answers first")
    return preferred(view, chat, shown["question"], prefer(backend, path, shown["question"], edited, shown["a"]))


def preferred(view: PairView, chat: list | None, question: str, taken: TeachAnswer) -> dict:
    """The page after a pair was taken: the run's words, and the pair in the chat history (the
    question, then the chosen answer marked as preferred over the rejected one)."""
    out: dict = {view.result: said(taken)}
    if view.history is not None:
        note = f"*preferred ({taken.id}, step {taken.step}) over:* {_plain(taken.rejected or '')}"
        out[view.history] = list(chat or []) + [{"role": "user", "content": question},
                                                {"role": "assistant", "content": f"{taken.answer}\n\n{note}"}]
    return out


def pair_command(question: str, chosen: str, rejected: str, chat: bool = True) -> Teach:
    """The teach command of a preference: `chosen` over `rejected` for `question` as the chat sent
    it (`chat`: through the chat template; else the raw prompt). The contract refuses an empty or
    identical pair (ProtocolError)."""
    if chat:
        return Teach(messages=[{"role": "user", "content": question}], answer=chosen, rejected=rejected)
    return Teach(prompt=question, answer=chosen, rejected=rejected)


def prefer(backend: Backend, path: str | None, question: str, chosen: str, rejected: str) -> TeachAnswer:
    """Send the pair into the run's inbox (a model without a chat template gets the raw prompt,
    as the chat sent it); the run's answer: the entry's id, the step, the margin."""
    pair_command(question, chosen, rejected)  # the contract's pair rules refuse it here, before the role check
    backend.session.require(PREFER, Teach.role)  # a viewer's refusal names what was pressed
    verbs = backend.verbs(path)
    try:
        return verbs.prefer(None, chosen, rejected, messages=[{"role": "user", "content": question}])
    except SessionError as e:
        if "chat template" not in str(e):
            raise
        return verbs.prefer(question, chosen, rejected)


def said(result: TeachAnswer) -> str:
    """The page's words for the run's answer to a preference."""
    text = (f"**Preferred {result.id}** at step {result.step}: "
            f"*{_plain(result.answer)}* over *{_plain(result.rejected or '')}*, mixed into the next "
            "batches.")
    margin = result.margin
    if isinstance(margin, (int, float)):
        leaning = "the chosen answer" if margin > 0 else "the rejected answer"
        text += (f" Margin before: log p(chosen) − log p(rejected) = {margin:+.3f} (the model leaned to "
                 f"{leaning}).")
    if result.check_at_step is not None:
        text += (f" It is checked again at step {result.check_at_step} (the margin after is in the inbox, "
                 "on the Train tab's data panel).")
    return text


def _plain(text: Any) -> str:
    """`text` shown as it is in Markdown: its markup characters escaped, on one line."""
    return MARKUP.sub(r"\\\1", " ".join(str(text).split()))
