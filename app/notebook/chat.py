"""The chat box: a question to the run's live weights, the answer streamed in piece by piece.

`chat` mode sends the conversation as chat messages through the session, as the web app's Chat
tab does (the model's chat template; the last message as raw text when it has none); `prompt`
mode sends the text as it is. The answer comes from a background thread, so the kernel stays
free while the model writes. Teach: write the answer you wanted to the last question and press
Teach: the pair goes into the run's inbox and the next batches. Prefer (a preference run): the
written answer is preferred over the model's last answer (chosen and rejected, Run.prefer). Rate
(a GRPO run): Up or Down on the last answer (Run.rate_chat), a human reward for it against fresh
samples of the same question at the next step (docs/rewards.md, "Rating a chat answer").
"""

from __future__ import annotations

import html
import threading
from typing import Any, Callable, Iterator

import ipywidgets as widgets

from app.notebook.api import Run
from app.chat_updates import ChatUpdate, chat_updates
from app.samples import rated_chat_text


class ChatBox:
    """`send()` (or the Send button) asks the run `get_run()` returns; `transcript` holds the
    turns so far as (role, text), `answer` the latest answer as it streams."""

    def __init__(self, get_run: Callable[[], Run | None], on_error: Callable[[str], None] = print):
        self._get_run, self._on_error = get_run, on_error
        self.input = widgets.Textarea(placeholder="ask the model being trained (e.g. reverse: hello)",
                                      layout=widgets.Layout(width="520px", height="60px"))
        self.mode = widgets.ToggleButtons(options=["chat", "prompt"], value="chat",
                                          tooltips=["send as chat messages (chat template)",
                                                    "send the raw text"],
                                          style={"button_width": "70px"})
        self.max_new_tokens = widgets.IntText(value=32, description="max tokens",
                                              layout=widgets.Layout(width="170px"))
        self.keep_history = widgets.Checkbox(value=False, description="multi-turn", indent=False)
        self.compare_base = widgets.Checkbox(value=False, description="compare with base (PEFT)", indent=False)
        self.send_button = widgets.Button(description="Send", button_style="primary", icon="paper-plane")
        self.clear_button = widgets.Button(description="Clear")
        self.view = widgets.HTML(layout=widgets.Layout(width="720px"))
        self.wanted = widgets.Text(placeholder="the answer you wanted to the last question",
                                   layout=widgets.Layout(width="520px"))
        self.teach_button = widgets.Button(description="Teach", icon="graduation-cap")
        self.taught = widgets.HTML()
        self.prefer_button = widgets.Button(description="Prefer", icon="thumbs-up",
                                            tooltip="the answer you wanted, preferred over the model's last answer")
        self.up_button = widgets.Button(description="Up", icon="thumbs-up",
                                        tooltip="a GRPO run: rate the last answer up (a human reward at the next step)")
        self.down_button = widgets.Button(description="Down", icon="thumbs-down",
                                          tooltip="a GRPO run: rate the last answer down")
        self.rated = widgets.HTML()
        self.up_button.on_click(lambda _: self.rate("up"))
        self.down_button.on_click(lambda _: self.rate("down"))
        self._sent: dict[str, Any] = {}  # what the last question was sent as: {"prompt"} or {"messages"}
        self.last: tuple[dict[str, Any], str, int | None] | None = None  # (sent, answer, step) of the last answer
        self.teach_button.on_click(lambda _: self.teach())
        self.prefer_button.on_click(lambda _: self.prefer())
        self.transcript: list[tuple[str, str]] = []
        self.answer = ""          # the answer being streamed (or the last one)
        self.base_answer = ""
        self.answered = 0         # answers completed
        self.busy = False
        self._thread: threading.Thread | None = None
        self.send_button.on_click(lambda _: self.send())
        self.clear_button.on_click(lambda _: self.clear())
        self.widget = widgets.VBox([
            widgets.HTML("<b>Chat with the live model</b>"),
            widgets.HBox([self.input, widgets.VBox([self.send_button, self.clear_button])]),
            widgets.HBox([self.mode, self.max_new_tokens, self.keep_history, self.compare_base]),
            self.view, widgets.HBox([self.wanted, self.teach_button, self.prefer_button]), self.taught,
            widgets.HBox([widgets.HTML("rate the last answer (GRPO):"), self.up_button, self.down_button]),
            self.rated])

    def set_enabled(self, enabled: bool) -> None:
        self.send_button.disabled = not enabled or self.busy

    def clear(self) -> None:
        self.transcript, self.answer, self.base_answer = [], "", ""
        self._render()

    def send(self, text: str | None = None) -> threading.Thread | None:
        """Ask `text` (default: the input box); returns the thread streaming the answer."""
        run = self._get_run()
        text = self.input.value if text is None else text
        if run is None or not text.strip() or self.busy:
            return None
        self.busy, self.send_button.disabled = True, True
        if not self.keep_history.value:
            self.transcript = []
        self.transcript.append(("user", text))
        self.input.value = ""
        self.answer, self.base_answer = "", ""
        self._render()
        self._thread = threading.Thread(target=self._stream, args=(run,), name="chat-stream", daemon=True)
        self._thread.start()
        return self._thread

    def teach(self, answer: str | None = None) -> threading.Thread | None:
        """Teach `answer` (default: the box) for the last question asked, as the chat sent it;
        returns the thread waiting for the run's answer (it comes at the next step boundary)."""
        return self._start_teach(answer, None)

    def prefer(self, answer: str | None = None) -> threading.Thread | None:
        """Prefer `answer` (default: the box) over the model's last answer to the last question
        (a preference run's pair); returns the thread waiting for the run's answer."""
        answered = [text for role, text in self.transcript if role == "assistant"]
        if not answered:
            self._on_error("prefer: ask something and wait for the answer first")
            return None
        return self._start_teach(answer, answered[-1])

    def _start_teach(self, answer: str | None, rejected: str | None) -> threading.Thread | None:
        run = self._get_run()
        answer = self.wanted.value if answer is None else answer
        asked = [text for role, text in self.transcript if role == "user"]
        what = "teach" if rejected is None else "prefer"
        if run is None or not asked:
            self._on_error(f"{what}: ask something first")
            return None
        if not answer.strip():
            self._on_error(f"{what}: write the answer you wanted first")
            return None
        thread = threading.Thread(target=self._teach, args=(run, asked[-1], answer, rejected), name=what,
                                  daemon=True)
        thread.start()
        self._teaching = thread
        return thread

    def _teach(self, run: Run, question: str, answer: str, rejected: str | None = None) -> None:
        pair: dict[str, Any] = {} if rejected is None else {"rejected": rejected}
        try:
            try:
                result = (run.teach(question, answer, **pair) if self.mode.value == "prompt" else
                          run.teach(None, answer, messages=[{"role": "user", "content": question}], **pair))
            except Exception as e:  # noqa: BLE001 - a model without a chat template: the raw text
                if "chat template" not in str(e):
                    raise
                result = run.teach(question, answer, **pair)
            self.wanted.value = ""
            said = "taught" if rejected is None else "preferred"
            over = "" if rejected is None else f" over {html.escape(rejected)}"
            margin = result.margin
            before = f", margin before {margin:+.3f}" if isinstance(margin, (int, float)) else ""
            self.taught.value = (f"<span style='color:#333'>{said} {html.escape(result.id)} at step "
                                 f"{result.step}: {html.escape(question)} → "
                                 f"{html.escape(answer)}{over}{before} (see the data fold's inbox)</span>")
        except Exception as e:  # noqa: BLE001 - shown, the kernel goes on
            self._on_error(f"teach: {e}")
            self.taught.value = f"<span style='color:#b00020'>not taught: {html.escape(str(e))}</span>"

    def rate(self, score: float | str = "up") -> threading.Thread | None:
        """Rate the last answer (a GRPO run's live weights): up, down or a score in [-1, 1], as the
        chat sent its question (Run.rate_chat); returns the thread waiting for the run's answer.
        The next step samples fresh answers to the question and trains them with it as a group."""
        run = self._get_run()
        if run is None or self.last is None:
            self._on_error("rate: ask something and wait for the whole answer first")
            return None
        thread = threading.Thread(target=self._rate, args=(run, score, self.last), name="rate", daemon=True)
        thread.start()
        return thread

    def _rate(self, run: Run, score: float | str, last: tuple[dict[str, Any], str, int | None]) -> None:
        sent, answer, step = last
        try:
            try:
                result = run.rate_chat(sent.get("prompt"), answer, score, messages=sent.get("messages"), step=step)
            except Exception as e:  # noqa: BLE001 - a model without a chat template got the raw text
                if "chat template" not in str(e) or "messages" not in sent:
                    raise
                result = run.rate_chat(sent["messages"][-1]["content"], answer, score, step=step)
            self.rated.value = f"<span style='color:#333'>{html.escape(rated_chat_text(result))}</span>"
        except Exception as e:  # noqa: BLE001 - shown, the kernel goes on
            self._on_error(f"rate: {e}")
            self.rated.value = f"<span style='color:#b00020'>not rated: {html.escape(str(e))}</span>"

    def wait(self, timeout: float | None = None) -> str:
        """Wait for the answer being streamed; returns it."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self.answer

    def _updates(self, run: Run) -> Iterator[ChatUpdate]:
        """The answer as it streams: a chat through the session (as the web app's Chat tab sends
        it, falling back to the raw text for a model without a chat template), or a raw prompt."""
        compare = bool(self.compare_base.value)
        params = {"max_new_tokens": self.max_new_tokens.value, "compare_base": compare}
        if self.mode.value == "prompt":
            self._sent = {"prompt": self.transcript[-1][1]}
            return chat_updates(run.generate(self.transcript[-1][1], **params), compare)
        messages = [{"role": role, "content": text} for role, text in self.transcript]
        self._sent = {"messages": messages}
        return run.session.chat(str(run.path), messages, **params)

    def _stream(self, run: Run) -> None:
        try:
            step = None
            for update in self._updates(run):
                self.answer, self.base_answer, step = update.text, update.base or "", update.step
                self._render(streaming=not update.done)
            self.transcript.append(("assistant", self.answer))
            self.last = (self._sent, self.answer, step)
            self.answered += 1
            self._render(note=f"answered by the weights of step {step}")
        except Exception as e:  # noqa: BLE001 - shown in the box, the kernel goes on
            self.transcript.pop()
            self._on_error(f"chat: {type(e).__name__}: {e}")
            self._render(note=f"no answer: {e}")
        finally:
            self.busy = False
            self.send_button.disabled = False

    def _render(self, streaming: bool = False, note: str = "") -> None:
        turns = list(self.transcript)
        if streaming:
            turns.append(("assistant", self.answer + "\u258c"))
        rows = [f"<div><b>{role}</b>: <span style='white-space:pre-wrap;font-family:monospace'>"
                f"{html.escape(text)}</span></div>" for role, text in turns]
        if self.base_answer:
            rows.append(f"<div><b>base model</b>: <span style='white-space:pre-wrap;font-family:monospace'>"
                        f"{html.escape(self.base_answer)}</span></div>")
        if note:
            rows.append(f"<div style='color:#666;font-size:85%'>{html.escape(note)}</div>")
        self.view.value = "".join(rows)
