"""The live settings a front end offers beside the learning rate: every field of `set`
(contract.protocol.commands.Set) but `lr`, which has a box of its own (app.lr_box), and
`generation`, the chat's defaults. The fields are the command's, not a list kept here, so a new
live setting shows in the web Train tab's fold and the notebook panel's at once, with the
command's description as its help.

Boxes hold text: `changes` reads the filled ones into Set's arguments (a number, two numbers for
Adam's betas, a JSON object for any other optimizer field, `name=weight, ...` for a GRPO run's
reward weights) and refuses text that is not one, naming the setting; the bounds are the command's own, checked by the verb that sends it.
`present` words the run's values now (its status `settings`).
"""

from __future__ import annotations

import json
import typing
from typing import Any

import yaml

from app.session import SessionError
from contract.protocol.commands import Set

OWN_BOXES = ("lr", "generation")  # the learning-rate box; the Chat tab's generation defaults


def names() -> list[str]:
    """The settings offered, in the command's order."""
    return [name for name in Set.model_fields if name not in OWN_BOXES]


def label(name: str) -> str:
    words = name.replace("_", " ").capitalize()
    return "GRPO" + words[4:] if name.startswith("grpo_") else words


def help_text(name: str) -> str:
    return Set.model_fields[name].description or ""


def _kind(name: str) -> type:
    """int, float, list (betas) or dict (optimizer): what the field holds, without None."""
    kinds = [k for k in typing.get_args(Set.model_fields[name].annotation) if k is not type(None)]
    kind = kinds[0] if kinds else Set.model_fields[name].annotation
    return typing.get_origin(kind) or kind


def parse(name: str, text: Any) -> Any:
    """The value typed in `name`'s box, as Set takes it; SessionError naming the setting if the
    text is not of its kind."""
    text = str(text).strip()
    kind = _kind(name)
    try:
        if kind is list:
            return [float(part) for part in text.replace(",", " ").split()]
        if kind is dict and name == "reward_weights" and not text.startswith("{"):
            return _weights(text)
        if kind is dict:
            value = json.loads(text)
            if not isinstance(value, dict):
                raise ValueError
            return value
        return int(text) if kind is int else float(text)
    except ValueError:
        wanted = {list: "numbers separated by a comma (e.g. 0.9, 0.999)",
                  dict: 'a JSON object of optimizer fields (e.g. {"momentum": 0.8})',
                  int: "a whole number"}.get(kind, "a number")
        if name == "reward_weights":
            wanted = "reward=weight pairs separated by a comma (e.g. exact_match=1, brevity=0.2)"
        raise SessionError(f"{label(name)}: must be {wanted}, got {text!r}") from None


def _weights(text: str) -> dict[str, float]:
    """`name=weight, name=weight` as {name: weight} (ValueError when a pair is not one)."""
    pairs = [part.split("=") for part in text.split(",") if part.strip()]
    if not pairs or any(len(pair) != 2 or not pair[0].strip() for pair in pairs):
        raise ValueError(text)
    return {pair[0].strip(): float(pair[1]) for pair in pairs}


def changes(boxes: dict[str, Any]) -> dict[str, Any]:
    """Set's arguments from the boxes that hold text (the empty ones change nothing)."""
    given = {name: parse(name, text) for name, text in boxes.items() if str(text or "").strip()}
    if not given:
        raise SessionError("type a new value in at least one box")
    return given


def shown(value: Any) -> str:
    """A value as the pages show it."""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(shown(v) for v in value)
    if isinstance(value, dict):
        return ", ".join(f"{k} {shown(v)}" for k, v in value.items())
    return str(value)


def present(settings: dict[str, Any] | None) -> list[tuple[str, str]]:
    """(label, value) of each offered setting the run reports now (the optimizer's other fields
    without those that have a box of their own)."""
    out = []
    for name in names():
        value = (settings or {}).get(name)
        if isinstance(value, dict) and name == "optimizer":
            value = {k: v for k, v in value.items() if v is not None and k not in names() and k not in OWN_BOXES}
        if value is not None and value != {}:
            out.append((label(name), shown(value)))
    return out


def reward_entry(text: Any) -> dict[str, Any]:
    """A reward entry typed as a `grpo.rewards` item is written in a config (YAML or JSON:
    `{kind: regex, pattern: 'a+', name: as, weight: 0.5}`) as `add_reward` takes it; SessionError
    when the text is not a mapping (the command's model checks its keys)."""
    text = str(text or "").strip()
    try:
        entry = yaml.safe_load(text) if text else None
    except yaml.YAMLError as e:
        raise SessionError(f"Reward: not YAML or JSON: {str(e).splitlines()[0]}") from None
    if not isinstance(entry, dict):
        raise SessionError("Reward: type an entry as grpo.rewards takes one, e.g. {kind: regex, pattern: 'a+', "
                           "name: as} or {function: my_rewards.py:brevity, weight: 0.2}; got " + repr(text))
    return entry


def weights_hint(settings: dict[str, Any] | None) -> str:
    """The reward weights box's hint: the run's rewards and weights now (none on another run)."""
    weights = (settings or {}).get("reward_weights") or {}
    return ", ".join(f"{name}={shown(float(w))}" for name, w in weights.items())
