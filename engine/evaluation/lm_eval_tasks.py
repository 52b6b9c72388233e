"""lm-evaluation-harness tasks on the live weights at evaluation time (`eval.lm_eval_tasks`).

`LmEvalTasks` is an evaluator (engine.evaluation.evaluators): every rank runs lm-evaluation-harness's own
`simple_evaluate` on the same tasks with `LiveModel`, a harness model whose log-likelihoods are
engine.generation.scoring's forward passes and whose generations are engine.generation.generate's, so the ranks
meet in the same collective calls in the same order (ZeRO-3 gathers, pipeline stages) and all
of them return the same numbers. The harness's results become metrics named
`lm_eval/<task>/<metric>` (evaluation events, plots, `checkpoint.monitor`, keep_best).

A task is a name the harness knows, or the path of a task YAML file (its folder is searched for
the tasks it includes). The harness seeds Python's, NumPy's and torch's generators for its few-shot
sampling: the trainer's evaluation restores every generator afterwards (engine.rng), so the
training trajectory is unchanged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lm_eval import simple_evaluate
from lm_eval.api.model import TemplateLM
from lm_eval.tasks import TaskManager

from engine.generation.generate import generate
from engine.generation.scoring import score

LLH_BATCH = 16  # rows per forward pass when scoring


class LiveModel(TemplateLM):
    """The run's engine as an lm-evaluation-harness model (every rank holds one)."""

    def __init__(self, run: Any, batch_size: int, max_new_tokens: int):
        super().__init__()
        self.run, self.tokenizer = run, run.tokenizer
        self.batch_size, self.max_new_tokens = batch_size, max_new_tokens

    @property
    def eot_token_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return int(bos if bos is not None else self.eot_token_id)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """With the tokenizer's special tokens (BOS), as the run's training data is encoded."""
        special = True if add_special_tokens is None else add_special_tokens
        bos = self.tokenizer.bos_token
        if add_special_tokens is None and bos and string.startswith(bos):
            special = False
        return self.tokenizer(string, add_special_tokens=special)["input_ids"]

    def _loglikelihood_tokens(self, requests: list, **kwargs: Any) -> list[tuple[float, bool]]:
        out: list[tuple[float, bool]] = []
        for start in range(0, len(requests), LLH_BATCH):
            chunk = requests[start:start + LLH_BATCH]
            rows = [list(context) + list(continuation) for _, context, continuation in chunk]
            for (_, context, _), scores in zip(chunk, score(self.run, rows, top=1)):
                picked = scores.logprobs[len(context):]
                best = [top[0][1] for top in scores.top[len(context):]]
                out.append((float(sum(picked)), all(p >= b for p, b in zip(picked, best))))
        return out

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        raise NotImplementedError("eval.lm_eval_tasks: rolling log-likelihood (perplexity) tasks are not "
                                  "supported; use the perplexity evaluator")

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        answers = []
        for request in requests:  # one at a time: each has its own stop strings and limit
            context, kwargs = request.args
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            limit = int(kwargs.get("max_gen_toks", self.max_new_tokens))
            text = generate(self.run, [self.tok_encode(context)], max_new_tokens=limit, temperature=0.0,
                            stop=until or None)[0]
            answers.append(text)
        return answers


def _task_specs(tasks: list[str]) -> tuple[list[str | dict], list[str]]:
    """(what simple_evaluate is given, the folders to search): a YAML path is loaded as a
    config; a name is looked up among the harness's tasks."""
    import yaml
    specs: list[str | dict] = []
    folders: list[str] = []
    for task in tasks:
        path = Path(task)
        if path.suffix in (".yaml", ".yml") and path.is_file():
            specs.append(yaml.safe_load(path.read_text()))
            folders.append(str(path.parent))
        else:
            specs.append(task)
    return specs, folders


class LmEvalTasks:
    """The evaluator of `eval.lm_eval_tasks`: metrics `lm_eval/<task>/<metric>`."""

    name = "lm_eval"

    def __init__(self, tasks: list[str], batch_size: int, max_new_tokens: int, max_samples: int = 0):
        self.tasks, self.batch_size = list(tasks), batch_size
        self.max_new_tokens, self.max_samples = max_new_tokens, max_samples

    def __call__(self, trainer: Any) -> dict[str, float]:
        specs, folders = _task_specs(self.tasks)
        names = [s for s in specs if isinstance(s, str)]
        manager = TaskManager(include_path=folders or None, include_defaults=bool(names))
        results = simple_evaluate(model=LiveModel(trainer, self.batch_size, self.max_new_tokens), tasks=specs,
                                  task_manager=manager, limit=self.max_samples or None, log_samples=False,
                                  bootstrap_iters=0)
        return metrics_of(results or {})


def metrics_of(results: dict) -> dict[str, float]:
    """{"<task>/<metric>": value} of the harness's numeric results (the "none" filter left out of
    the name; other filters kept as `<metric>_<filter>`)."""
    out: dict[str, float] = {}
    for task, values in (results.get("results") or {}).items():
        for key, value in values.items():
            metric, _, kept = key.partition(",")
            if not kept or metric.endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            name = metric if kept == "none" else f"{metric}_{kept}"
            out[f"lm_eval/{task}/{name}"] = float(value)
    return out
