"""What a chat view tells a person talking to the embedded default while it trains.

The embedded default is a tiny model learning `reverse: hello` -> `olleh` from scratch: for its
first ~100-200 steps its greedy answers are empty (the end-of-answer token is the most frequent
answer token, and the model has not yet learned where it goes) or garbage. A chat view says so,
shows the answers it should come to give (`EXAMPLES`, and the expected answer beside the model's
when one of them is asked) and the held-out exact match the run has measured so far (its
`eval/exact_match` series). Front-end neutral (plain text with Markdown emphasis), torch-free: the
web app's chat views use it; the notebook's chat box can too.

    default = embedded_default(run_folder)      # None: the run trains something else
    if default is not None:
        print(early_note(), default.exact_match_text(history.eval.get("exact_match", [])))
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from contract.config.schema import ConfigError, RunConfig
from contract.config.load import load_config

# Questions of the embedded task and the answers a trained model gives (the task itself is
# engine/data/default_task.py; these are examples of it, as the quickstart notebook's text gives them).
EXAMPLES: tuple[tuple[str, str], ...] = (("reverse: hello", "olleh"), ("sort: hello", "ehllo"),
                                         ("upper: hello", "HELLO"))
EARLY_STEPS = "100-200"  # engine/data/default_task.py: exact match 0.42 after 25 s of training, 0.91 at step 700


@dataclass(frozen=True)
class EmbeddedDefault:
    """A run of the embedded default: when it measures its held-out exact match."""
    every_n_steps: int         # eval.every_n_steps (0: only at the end or on Evaluate now)
    measures_exact_match: bool  # whether eval.evaluators has exact_match (or generation)
    objective: str = "sft"     # preference.objective: what the chat's note promises depends on it

    def exact_match_text(self, points: list[tuple[int, float]]) -> str:
        """The latest held-out exact match (`points`: the run's (step, value) series), or when
        the first one comes."""
        if points:
            step, value = points[-1]
            return f"held-out exact match {value:.0%} at step {step}"
        if not self.measures_exact_match:
            return "held-out exact match: not measured (eval.evaluators has no exact_match)"
        if self.every_n_steps:
            return f"held-out exact match: measured every {self.every_n_steps} steps, none yet"
        return "held-out exact match: none yet (press Evaluate now)"


def embedded_default(run: RunConfig | str | Path) -> EmbeddedDefault | None:
    """The run (its config, or its folder) as an embedded-default run: no model and no data of
    its own. None for any other run, and for a folder whose config cannot be read."""
    if not isinstance(run, RunConfig):
        try:
            run = load_config(Path(run) / "config.yaml")
        except (ConfigError, OSError, ValueError):
            return None
    if run.model.path or run.data.train or run.data.sources:
        return None
    measured = bool({"exact_match", "generation"} & set(run.eval.evaluators))
    return EmbeddedDefault(run.eval.every_n_steps, measured, run.preference.objective)


def expected_answer(question: str) -> str | None:
    """The answer the trained default gives to one of `EXAMPLES`' questions (None for others)."""
    wanted = " ".join(question.split())
    return next((answer for asked, answer in EXAMPLES if asked == wanted), None)


# What each objective is expected to do on the embedded default from scratch (docs/preferences.md,
# docs/rewards.md): only SFT (and ORPO's SFT term) teaches the answers themselves.
RANKS_ONLY = ("DPO alone learns to rank the right answer above the wrong one, not to write it: watch the "
              "reward accuracy and margin rise on the Train tab; its answers stay empty or garbage and the "
              "exact match stays near 0 (docs/preferences.md). Train with SFT first (`model.path`) for a model "
              "that writes them.")
OBJECTIVE_NOTES: dict[str, str] = {
    "dpo": RANKS_ONLY,
    "simpo": RANKS_ONLY.replace("DPO", "SimPO"),
    "kto": ("KTO learns which answers are desirable and which are not, one by one, not to write them: watch "
            "its rewards and KL on the Train tab; its answers stay empty or garbage and the exact match stays "
            "near 0 (docs/preferences.md)."),
    "orpo": ("ORPO's likelihood term trains the chosen answer as SFT does, beside the preference: its answers "
             "start empty or garbage and slowly come to the right ones ({examples}), while the reward accuracy "
             "and margin rise on the Train tab."),
    "grpo": ("GRPO samples groups of answers and rewards them (exact match against the answer by default): from "
             "random weights a right answer is rarely sampled, so the mean reward stays near 0 for a long time and "
             "the answers stay empty or garbage (docs/rewards.md); start it from a model that answers sometimes "
             "(`model.path`)."),
}


def early_note(objective: str = "sft") -> str:
    """What to expect from the embedded default's answers under `objective` (preference.objective):
    SFT learns the example answers; the preference objectives rank answers (ORPO also writes
    them); GRPO needs right answers to be sampled before it can reward them."""
    examples = " · ".join(f"`{q}` → `{a}`" for q, a in EXAMPLES)
    if objective in OBJECTIVE_NOTES:
        return (f"**This run trains the embedded default with {objective}** from scratch. "
                + OBJECTIVE_NOTES[objective].format(examples=examples))
    return (f"**This run trains the embedded default** from scratch: for its first ~{EARLY_STEPS} steps "
            "its answers are expected to be empty or garbage (the end-of-answer token is the most frequent "
            "answer token, and the model has not yet learned where it goes); sampling (temperature 1) "
            f"shows what it has picked up. The answers it learns to give: {examples}.")
