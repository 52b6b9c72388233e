"""Reward functions of a GRPO run (docs/rewards.md), torch-free: the built-ins, the user's
`module:function`, and the check that refuses a bad one before launch.

A reward function has TRL's signature::

    f(prompts, completions, completion_ids=..., **columns) -> list[float | None]

one value per completion (None: this function does not score that sample). `prompts` and
`completions` are text, or lists of messages for chat rows (TRL's conversational form); every
other column of the data rows comes as a keyword (a list, one value per completion).

A reward is declared in `grpo.rewards` as a dict: `kind` (a built-in) or `function`
("module:function", or "path/to/file.py:function"), an optional `name` (the metric's
`rewards/<name>/...`; default: the kind or the function's name) and `weight` (default 1). The
built-ins and their keys:

=============  ==============================================  ====================================
kind           1.0 when                                        keys
=============  ==============================================  ====================================
exact_match    the completion, stripped, equals the column     column (answer)
regex          the pattern is found in the completion          pattern
format         the completion holds <tag>...</tag>             tag (answer)
numeric        the completion's last number is within          column (answer), tolerance (1e-6)
               tolerance of the column's value
length         (a penalty) 0 up to max_tokens - cache, then    max_tokens, cache
               falling linearly to -1 at max_tokens (TRL's
               soft overlong punishment)
=============  ==============================================  ====================================
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

RewardFn = Callable[..., list]
DEFAULT_REWARDS = ({"kind": "exact_match", "column": "answer"},)  # what an empty grpo.rewards means

_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
COMMON_KEYS = ("kind", "function", "name", "weight")
BUILTIN_KEYS: dict[str, dict[str, Any]] = {  # each built-in's keys and their defaults (None: required)
    "exact_match": {"column": "answer"},
    "regex": {"pattern": None},
    "format": {"tag": "answer"},
    "numeric": {"column": "answer", "tolerance": 1e-6},
    "length": {"max_tokens": None, "cache": None},
}


class RewardSpecError(ValueError):
    """A reward declaration that cannot be used; `field` names it (grpo.rewards[i]...)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


def text_of(value: Any) -> str:
    """A completion's (or prompt's) text: the string, or the last message's content."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and isinstance(value[-1], dict):
        return str(value[-1].get("content", ""))
    return str(value)


# -- the built-ins -------------------------------------------------------------------------------

def exact_match(column: str) -> RewardFn:
    def reward(prompts, completions, **columns):
        truth = _column(columns, column, len(completions))
        return [float(text_of(c).strip() == str(t).strip()) if t is not None else None
                for c, t in zip(completions, truth)]
    return reward


def regex(pattern: str) -> RewardFn:
    compiled = re.compile(pattern)

    def reward(prompts, completions, **columns):
        return [float(compiled.search(text_of(c)) is not None) for c in completions]
    return reward


def tag_format(tag: str) -> RewardFn:
    compiled = re.compile(rf"<{re.escape(tag)}>.*?</{re.escape(tag)}>", re.DOTALL)

    def reward(prompts, completions, **columns):
        return [float(compiled.search(text_of(c)) is not None) for c in completions]
    return reward


def numeric(column: str, tolerance: float) -> RewardFn:
    def reward(prompts, completions, **columns):
        truth = _column(columns, column, len(completions))
        out: list[float | None] = []
        for c, t in zip(completions, truth):
            if t is None:
                out.append(None)
                continue
            found = _NUMBER.findall(text_of(c))
            out.append(float(bool(found) and abs(float(found[-1]) - float(t)) <= tolerance))
        return out
    return reward


def length_penalty(max_tokens: int, cache: int) -> RewardFn:
    def reward(prompts, completions, completion_ids=None, **columns):
        lengths = [len(ids) for ids in completion_ids] if completion_ids is not None else \
            [len(text_of(c)) for c in completions]
        free = max_tokens - cache
        return [0.0 if n <= free else (free - n) / cache if n <= max_tokens else -1.0 for n in lengths]
    return reward


def _column(columns: dict, name: str, n: int) -> list:
    if name not in columns:
        raise KeyError(f"the data rows have no column {name!r} (columns: {sorted(columns)})")
    return list(columns[name])[:n]


# -- declarations --------------------------------------------------------------------------------

@dataclass
class Reward:
    """A reward function ready to call, with its metric name and weight."""
    name: str
    weight: float
    fn: RewardFn
    spec: dict


def check_entry(spec: Any, field: str) -> float:
    """The checks of a reward entry that import nothing (its shape: kind or function, known keys,
    a finite weight); returns its weight. RewardSpecError naming `field` (build_reward runs them
    first; a live `add_reward` runs them where the command is built, too)."""
    if not isinstance(spec, dict):
        raise RewardSpecError(field, f"a reward is a dict with kind or function, not {spec!r}")
    has_kind, has_fn = spec.get("kind") is not None, spec.get("function") is not None
    if has_kind == has_fn:
        raise RewardSpecError(field, f"give exactly one of kind ({', '.join(BUILTIN_KEYS)}) or "
                              "function (module:function)")
    try:
        weight = float(spec.get("weight", 1.0))
    except (TypeError, ValueError):
        raise RewardSpecError(f"{field}.weight", f"must be a number, not {spec.get('weight')!r}") from None
    if not math.isfinite(weight):
        raise RewardSpecError(f"{field}.weight", f"must be a finite number, not {spec.get('weight')!r}")
    if has_fn:
        unknown = set(spec) - set(COMMON_KEYS)
        if unknown:
            raise RewardSpecError(field, f"unknown keys {sorted(unknown)} for a function (allowed: "
                                  "function, name, weight)")
        return weight
    kind = spec["kind"]
    if kind not in BUILTIN_KEYS:
        raise RewardSpecError(f"{field}.kind", f"{kind!r} is not a built-in; use one of "
                              f"{', '.join(BUILTIN_KEYS)} (or function: module:function)")
    unknown = set(spec) - set(COMMON_KEYS) - set(BUILTIN_KEYS[kind])
    if unknown:
        raise RewardSpecError(field, f"unknown keys {sorted(unknown)} for {kind} (allowed: "
                              f"{', '.join(('name', 'weight', *BUILTIN_KEYS[kind]))})")
    return weight


def build_reward(spec: Any, field: str, max_completion_length: int = 256) -> Reward:
    """The reward `spec` declares (see the module docstring); RewardSpecError naming `field`
    when it cannot be used (unknown kind or key, a module that does not import, a function
    without TRL's signature)."""
    weight = check_entry(spec, field)
    if spec.get("function") is not None:
        fn = load_function(str(spec["function"]), f"{field}.function")
        return Reward(str(spec.get("name") or getattr(fn, "__name__", "reward")), weight, fn, dict(spec))
    kind = spec["kind"]
    keys = BUILTIN_KEYS[kind]
    args = {k: spec.get(k, default) for k, default in keys.items()}
    return Reward(str(spec.get("name") or kind), weight, _builtin(kind, args, field, max_completion_length),
                  dict(spec))


def _builtin(kind: str, args: dict, field: str, max_completion_length: int) -> RewardFn:
    if kind == "exact_match":
        return exact_match(str(args["column"]))
    if kind == "format":
        return tag_format(str(args["tag"]))
    if kind == "numeric":
        return numeric(str(args["column"]), float(args["tolerance"]))
    if kind == "regex":
        if not isinstance(args["pattern"], str) or not args["pattern"]:
            raise RewardSpecError(f"{field}.pattern", "regex needs a pattern (a Python regular expression)")
        try:
            return regex(args["pattern"])
        except re.error as e:
            raise RewardSpecError(f"{field}.pattern", f"not a regular expression: {e}") from None
    max_tokens = int(args["max_tokens"] or max_completion_length)
    cache = int(args["cache"] or max(1, max_tokens // 4))
    if not 0 < cache <= max_tokens:
        raise RewardSpecError(f"{field}.cache", f"must be in [1, max_tokens={max_tokens}], not {cache}")
    return length_penalty(max_tokens, cache)


def load_function(target: str, field: str) -> RewardFn:
    """The user's reward function "module:function" (or "file.py:function"), imported and its
    signature checked: it must take `prompts` and `completions` by keyword and `**kwargs` (the
    data's other columns come as keywords, as TRL passes them)."""
    module_name, sep, attr = target.rpartition(":")
    if not sep or not module_name or not attr:
        raise RewardSpecError(field, f"{target!r} is not module:function")
    try:
        module = _import(module_name)
    except Exception as e:
        raise RewardSpecError(field, f"cannot import {module_name!r}: {type(e).__name__}: {e}") from None
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        raise RewardSpecError(field, f"{module_name!r} has no function {attr!r}")
    if inspect.iscoroutinefunction(fn):
        raise RewardSpecError(field, f"{target} is async; give a plain function")
    problem = signature_problem(fn)
    if problem:
        raise RewardSpecError(field, f"{target}{problem}")
    return fn


def signature_problem(fn: Callable) -> str | None:
    """Why `fn` cannot be called as TRL calls a reward function, or None."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None  # a builtin without a signature: let the call tell
    params = sig.parameters.values()
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    missing = [n for n in ("prompts", "completions") if n not in named]
    if missing or not any(p.kind == p.VAR_KEYWORD for p in params):
        return (f" has the signature {sig}; a reward function takes (prompts, completions, **kwargs) "
                "and returns one float or None per completion")
    return None


def _import(name: str):
    if name.endswith(".py"):
        path = Path(name).resolve()
        spec = importlib.util.spec_from_file_location(path.stem, path)
        if spec is None or spec.loader is None or not path.is_file():
            raise FileNotFoundError(f"no file {path}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # a module beside the config, as `python -m` would see it
    return importlib.import_module(name)


def build_rewards(specs: Sequence[Any], max_completion_length: int = 256) -> list[Reward]:
    """Every reward of `grpo.rewards` (empty: DEFAULT_REWARDS); the first problem raises RewardSpecError."""
    specs = list(specs) or list(DEFAULT_REWARDS)
    rewards = [build_reward(s, f"grpo.rewards[{i}]", max_completion_length) for i, s in enumerate(specs)]
    names = [r.name for r in rewards]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise RewardSpecError("grpo.rewards", f"two rewards are named {', '.join(twice)}; give each a "
                              "distinct name (the metrics are rewards/<name>/...)")
    return rewards


def reward_problems(specs: Sequence[Any], max_completion_length: int = 256) -> list[tuple[str, str]]:
    """Every problem of the reward declarations, as (field, message) (the config check's form)."""
    specs = list(specs) or list(DEFAULT_REWARDS)
    problems = []
    for i, spec in enumerate(specs):
        try:
            build_reward(spec, f"grpo.rewards[{i}]", max_completion_length)
        except RewardSpecError as e:
            problems.append((e.field, e.message))
    if not problems:
        try:
            build_rewards(specs, max_completion_length)
        except RewardSpecError as e:
            problems.append((e.field, e.message))
    return problems
