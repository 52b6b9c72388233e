"""What the preference objectives cannot do, refused before launch (each problem names its field
and why): the layout x method cells from the capability table (contract.capabilities,
Feature.PREFERENCE), and the rules that depend on values (batching, micro-batch size, the
parameters, the data formats; an SFT run's rule for live pairs, `sft_pair_loss`). The objectives
themselves are engine.objectives.preference."""

from __future__ import annotations

from contract import capabilities
from contract.capabilities import Feature, Layout, Method
from contract.config.grpo_checks import grpo_problems
from contract.config.schema import OBJECTIVE_FORMATS, RunConfig


def preference_problems(c: RunConfig) -> list[tuple[str, str]]:
    """The combinations of `preference.objective` with a layout, method, batching or data format
    that cannot work, and parameters out of their objective's range."""
    pref = c.preference
    if pref.objective == "sft":
        return _unused_parameters(c)
    if pref.objective == "grpo":  # learning from rewards: its own rules (contract.config.grpo_checks)
        return grpo_problems(c)
    problems: list[tuple[str, str]] = []
    name = pref.objective
    if c.method.name in {m.value for m in Method}:  # the layout x method cell: the capability table's
        refused = capabilities.problem(Layout.of(c.parallel.tp_size, c.parallel.pp_size), c.method.name,
                                       Feature.PREFERENCE, field="preference.objective")
        if refused is not None:
            problems.append(refused)
    if c.data.batching == "packing":
        problems.append(("data.batching", f"{name} pads each pair (or answer) to its own row; packing "
                         "would put several in one row. Use group_by_length or random"))
    if name == "kto" and c.train.micro_batch_size < 2:
        problems.append(("train.micro_batch_size", "kto estimates its reference point from each prompt "
                         "paired with another row's completion in the micro-batch: it needs at least 2"))
    if name in ("dpo", "simpo", "kto") and pref.beta <= 0:
        problems.append(("preference.beta", f"{name} divides by beta (or scales its reward by it): "
                         "it must be above 0"))
    if pref.label_smoothing > 0 and not (name == "dpo" and pref.dpo_loss == "robust"):
        problems.append(("preference.label_smoothing", "applies to the robust DPO loss only "
                         "(objective dpo, dpo_loss robust); set it to 0"))
    if "choice" in c.eval.evaluators:
        problems.append(("eval.evaluators", f"{name} evaluates on preference rows: choice needs rows with "
                         "candidate answers; use perplexity (the objective's loss and rewards) and "
                         "exact_match / generation (against the chosen answer)"))
    wanted = OBJECTIVE_FORMATS[name]
    formats = [("data.format", c.data.format)] + [(f"data.sources[{i}].format", s.get("format", "auto"))
                                                   for i, s in enumerate(c.data.sources)]
    for key, fmt in formats:
        if fmt not in ("auto", wanted):
            problems.append((key, f"{name} trains on {wanted} rows "
                             f"({'{prompt, chosen, rejected}' if wanted == 'preference' else '{prompt, completion, label}'})"
                             f", not {fmt}"))
    return problems


def _unused_parameters(c: RunConfig) -> list[tuple[str, str]]:
    problems = []
    if c.data.format in OBJECTIVE_FORMATS.values():
        problems.append(("data.format", f"{c.data.format} rows train a preference objective: set "
                         "preference.objective (dpo, orpo, simpo for pairs; kto for unpaired rows; "
                         "grpo for prompt rows)"))
    if sft_pair_loss(c) == "dpo" and c.method.name != "lora":
        problems.append(("preference.sft_pairs", f"dpo compares with the model without its adapter, and "
                         f"method {c.method.name} has none: use lora, or orpo / simpo (no reference)"))
    if sft_pair_loss(c) in ("dpo", "simpo") and c.preference.beta <= 0:
        problems.append(("preference.beta", f"an SFT run's live pairs train with {sft_pair_loss(c)} "
                         "(preference.sft_pairs), which scales its reward by beta: it must be above 0"))
    return problems


def sft_pair_loss(c: RunConfig) -> str:
    """The preference loss an SFT run adds for its live pairs (preference.sft_pairs; auto: dpo
    against the model without its adapter under lora, else ORPO's odds-ratio term)."""
    rule = c.preference.sft_pairs
    if rule == "auto":
        return "dpo" if c.method.name == "lora" else "orpo"
    return rule
