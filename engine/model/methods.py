"""Fine-tuning methods, one object chosen once at assembly: full, PEFT, fused (LOMO / AdaLomo).

"full", "lomo" and "adalomo" train every parameter (LOMO's fused update is a step strategy in
engine.lomo); the PEFT methods wrap the model in a `peft.PeftModel` whose active adapter is all
that trains: LoRA (target modules named, or chosen by module type: every nn.Linear / Conv1D of
the blocks, never the embeddings or the output head), prompt tuning and P-tuning.

A method object carries every operation in which methods differ, so no code elsewhere asks
`is_peft` or whether the update is fused:

    prepare_model(model, cfg)            the model to train (PEFT: wrapped with the adapter)
    adjust_ds_setup(setup)               DeepSpeed config changes (fused: no optimizer, stage 0)
    check_optimizer(optimizer)           refuse a user's optimizer where the method has its own
    builds_optimizer                     False: the method builds its own after the engine
    optimizer_after_engine(engine, cfg, setup, env)   that optimizer (fused), else None
    step(layout)                         the step strategy (fused, else the layout's)
    targets_shifted                      whether a row's first label is never a target (losses)
    base_model(module), has_adapter      a context in which the model answers without its adapter
    save_model / load_model / save_peft / load_peft   weights in and out (PEFT: adapters)

What peft (0.21) does by itself for prompt tuning and P-tuning, and tests/test_peft.py checks:
its forward puts `num_virtual_tokens` learned embeddings in front of the input, puts -100 in
front of the labels (virtual positions are never targets; after the shift the last virtual
position predicts the first real label, which in our data formats is a prompt token, -100, or
bos), and puts ones in front of the
attention mask (every real token attends to the virtual ones, padding stays masked). It drops
`position_ids` with a warning, so packed rows, whose per-sample attention rests on them, cannot
be used with these two methods: the config validation rejects data.batching "packing" for them.
Logits come back with the virtual positions first; evaluators that read logits take the last
`input length` positions.

Several named adapters: a model that already is a PeftModel (say with an adapter loaded for
comparison) gets the configured adapter added next to the others under `method.adapter_name`;
that adapter is made the active one, and peft then trains only it.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager

import torch

from contract import capabilities
from contract.capabilities import Feature
from contract.config.schema import FUSED_METHODS, PEFT_METHODS, RunConfig
from engine import lomo
from engine.parallel import ds_config
from engine.model.loading import is_quantized
from engine.checkpoint import adapters
from engine.context import Method, RunContext
from engine.steps import StepStrategy
from engine import checkpoint

def _linear_types() -> tuple[type, ...]:
    from transformers.pytorch_utils import Conv1D  # GPT-2's linear layers
    return (torch.nn.Linear, Conv1D)


def _blocks(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The model's stack of repeated blocks (decoder layers): the ModuleList of modules of one
    class that holds the most parameters; None if the model has no such list."""
    def size(blocks: torch.nn.ModuleList) -> int:
        return sum(p.numel() for p in blocks.parameters())
    stacks = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 0
              and len({type(b) for b in m}) == 1]
    return max(stacks, key=size) if stacks else None


def _lora_modules(model: torch.nn.Module) -> list[str]:
    """Full names of the modules LoRA wraps by default: every nn.Linear / Conv1D inside the
    blocks (attention and MLP, fused projections included); without blocks, every linear layer
    but the output head. Embeddings and the output head are never among them."""
    linear = _linear_types()
    blocks = _blocks(model)
    inside = {id(m) for m in blocks.modules()} if blocks is not None else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return [name for name, m in model.named_modules()
            if isinstance(m, linear) and m is not head and (inside is None or id(m) in inside)]


def infer_lora_targets(model: torch.nn.Module) -> list[str]:
    """LoRA's target modules chosen by module type (see `_lora_modules`), as peft's
    `target_modules`: the short names (q_proj, c_attn, ...) where they name exactly those
    modules, else the full module names."""
    chosen = _lora_modules(model)
    if not chosen:
        raise ValueError("method.lora_target_modules: this model has no linear layers for LoRA to wrap")
    short = list(dict.fromkeys(name.rsplit(".", 1)[-1] for name in chosen))
    # peft matches a short name against the end of every module name: it must catch no other module
    caught = [n for n, _ in model.named_modules() if n.rsplit(".", 1)[-1] in short]
    return short if caught == chosen else chosen


def peft_config(model: torch.nn.Module, cfg: RunConfig):
    """The peft config of the run's method, or None for the methods that are not PEFT."""
    import peft
    m = cfg.method
    if m.name == "lora":
        return peft.LoraConfig(r=m.lora_r, lora_alpha=m.lora_alpha, lora_dropout=m.lora_dropout,
                               target_modules=m.lora_target_modules or infer_lora_targets(model),
                               task_type="CAUSAL_LM")
    if m.name == "prompt_tuning":
        return peft.PromptTuningConfig(num_virtual_tokens=m.num_virtual_tokens, task_type="CAUSAL_LM")
    if m.name == "p_tuning":
        # an MLP reparameterises the virtual tokens (the P-tuning paper's prompt encoder)
        return peft.PromptEncoderConfig(num_virtual_tokens=m.num_virtual_tokens, task_type="CAUSAL_LM",
                                        encoder_reparameterization_type="MLP")
    return None


def is_peft_model(model: torch.nn.Module) -> bool:
    return adapters.is_peft(model)  # without importing peft where no PEFT is used: its docstring


def prepare_model(model: torch.nn.Module, cfg: RunConfig) -> torch.nn.Module:
    """The model to train for the configured method: wrapped with a PEFT adapter, or unchanged
    (see the method objects below)."""
    return method_of(cfg).prepare_model(model, cfg)


def refuse_peft_model(model: torch.nn.Module, cfg: RunConfig) -> torch.nn.Module:
    """The model itself, for methods that train the whole model; a PEFT model is an error."""
    if is_peft_model(model):
        raise ValueError(f"method.name: {cfg.method.name} trains the whole model, but the model given "
                         "is a PEFT model; choose lora, prompt_tuning or p_tuning")
    if is_quantized(model):  # the config check refuses it first; a model given by hand meets it here
        raise ValueError(f"method.name: {cfg.method.name} trains the whole model, but the model given is "
                         "quantized (frozen integer weights); choose lora, prompt_tuning or p_tuning")
    return model


def wrap_with_adapter(model: torch.nn.Module, cfg: RunConfig) -> torch.nn.Module:
    """Wrap the model in the configured PEFT adapter.

    A model that is a PeftModel already keeps its adapters; the configured one is added (if it
    is not there yet) and made the active, trained one.
    """
    import peft
    name = cfg.method.adapter_name
    if not is_peft_model(model):
        return peft.get_peft_model(model, peft_config(model, cfg), adapter_name=name)
    if name not in model.peft_config:
        add_adapter(model, name, peft_config(model.get_base_model(), cfg))
    set_active_adapter(model, name)
    return model


def add_adapter(model, name: str, config) -> None:
    """Add adapter `name` (a peft config) to a PeftModel; the active adapter stays as it was."""
    if name in model.peft_config:
        raise ValueError(f"method.adapter_name: the model already has an adapter named {name!r} "
                         f"(it has {', '.join(model.peft_config)})")
    active = model.active_adapter
    model.add_adapter(name, config)
    model.set_adapter(active)


def set_active_adapter(model, name: str) -> None:
    """Make adapter `name` the one that is used and trained (peft freezes the others)."""
    if name not in model.peft_config:
        raise ValueError(f"method.adapter_name: no adapter named {name!r}; the model has "
                         f"{', '.join(model.peft_config)}")
    model.set_adapter(name)


def prepare_quantized(model: torch.nn.Module, cfg: RunConfig) -> torch.nn.Module:
    """A quantized base made ready for an adapter (peft's `prepare_model_for_kbit_training`): every
    base weight frozen, the norms and other unquantized weights in fp32 for a stable forward, the
    input embeddings' output requiring grad (so gradient checkpointing has a graph to recompute)."""
    from peft import prepare_model_for_kbit_training
    checkpointing = cfg.model.gradient_checkpointing
    return prepare_model_for_kbit_training(
        model, use_gradient_checkpointing=checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False} if checkpointing else None)


def trainable_parameter_names(model: torch.nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


# -- the method objects ---------------------------------------------------------------------------

class FullMethod:
    """Every parameter trains through the engine's optimizer; weights are saved by the layout."""
    builds_optimizer = True
    has_adapter = False  # no base model apart from the trained one (chat's compare_base)
    # the model's loss predicts label t+1 at position t: a row's first label is never a target
    # (how engine.objectives.losses counts a step's label tokens)
    targets_shifted = True
    lora_targets: list[str] = []  # LoRA: the target modules the adapter wraps (for the run log)

    def __init__(self, name: str = "full"):
        self.name = name

    def prepare_model(self, model: torch.nn.Module, cfg: RunConfig) -> torch.nn.Module:
        return refuse_peft_model(model, cfg)

    def adjust_ds_setup(self, setup) -> None:
        pass

    def check_optimizer(self, optimizer) -> None:
        pass

    def optimizer_after_engine(self, engine, cfg: RunConfig, setup, env) -> Any:
        return None

    def grad_clip(self, run: RunContext) -> float:
        """The gradient-norm clipping in force (0: off): DeepSpeed's, which clips for this method."""
        return float(run.engine.gradient_clipping() or 0.0)

    def set_grad_clip(self, run: RunContext, value: float) -> None:
        """Change the clipping of the running run (the control plane's `set grad_clip`)."""
        ds_config.set_gradient_clipping(run.engine, value)

    def step(self, layout) -> StepStrategy:
        return layout.step()

    def base_model(self, module) -> ContextManager:
        return contextlib.nullcontext()  # there is no adapter: the model is its own base

    def save_model(self, run: RunContext, path: str, max_shard_size: int | str) -> dict:
        return run.layout.save_model(run, path, max_shard_size)

    def load_model(self, run: RunContext, path: str) -> None:
        run.layout.load_model(run, path)

    def save_peft(self, run: RunContext, path: str, selected_adapters: list[str] | None) -> dict:
        return self.save_model(run, path, checkpoint.models.DEFAULT_SHARD_SIZE)  # as in CoLLie

    def load_peft(self, run: RunContext, path: str, adapter_name: str, is_trainable: bool) -> None:
        self.load_model(run, path)


class PeftMethod(FullMethod):
    """A PEFT adapter trains; saving the model writes the adapter in PEFT's layout (as the run
    folder's `model/` promises); `engine.checkpoint.export_merged` writes base + LoRA."""
    has_adapter = True

    def __init__(self, name: str = "lora"):
        super().__init__(name)
        # prompt tuning and P-tuning put -100 labels in front for the virtual tokens: after the
        # shift the last virtual position predicts the first real label, which thus is a target
        self.targets_shifted = name == "lora"

    def prepare_model(self, model: torch.nn.Module, cfg: RunConfig) -> torch.nn.Module:
        if is_quantized(model) and not is_peft_model(model):
            model = prepare_quantized(model, cfg)
        model = wrap_with_adapter(model, cfg)
        targets = getattr(model.peft_config[cfg.method.adapter_name], "target_modules", None)
        self.lora_targets = sorted(targets) if isinstance(targets, (set, list, tuple)) else []
        return model

    def base_model(self, module) -> ContextManager:
        return module.disable_adapter()

    def save_model(self, run: RunContext, path: str, max_shard_size: int | str) -> dict:
        return adapters.save_peft(run, path)

    def load_model(self, run: RunContext, path: str) -> None:
        adapters.load_model_folder(run, path)

    def save_peft(self, run: RunContext, path: str, selected_adapters: list[str] | None) -> dict:
        return adapters.save_peft(run, path, selected_adapters)

    def load_peft(self, run: RunContext, path: str, adapter_name: str, is_trainable: bool) -> None:
        adapters.load_peft(run, path, adapter_name, is_trainable)


class FusedMethod(FullMethod):
    """LOMO / AdaLomo: the update happens inside backward (engine.lomo); the engine has no
    optimizer of DeepSpeed's, the fused one is built on the engine's module."""
    builds_optimizer = False

    def adjust_ds_setup(self, setup) -> None:
        lomo.prepare_ds_setup(setup, self.name)

    def check_optimizer(self, optimizer) -> None:
        if optimizer is not None:
            raise ValueError(f"method.name: {self.name} updates inside backward; pass no optimizer")

    def optimizer_after_engine(self, engine, cfg: RunConfig, setup, env) -> Any:
        # built on the engine's module: under ZeRO-3 its parameters are the partitioned ones
        return lomo.build_optimizer(engine, cfg, setup.config, env.dp_group, env.dp_size)

    def grad_clip(self, run: RunContext) -> float:
        # the fused update clips inside backward, with its own norm: DeepSpeed's setting is unused
        return float(run.optimizer.max_grad_norm)

    def set_grad_clip(self, run: RunContext, value: float) -> None:
        run.optimizer.max_grad_norm = float(value)

    def step(self, layout) -> StepStrategy:
        refused = capabilities.problem(layout.kind, self.name, Feature.TRAIN)
        if refused:  # the config check refuses it first; a Trainer built by hand meets it here
            raise ValueError("{}: {}".format(*refused))
        return lomo.FusedStep(self.name)


def method_of(cfg: RunConfig) -> Method:
    """The method object of the run config (chosen once, at assembly)."""
    if cfg.method.name in PEFT_METHODS:
        return PeftMethod(cfg.method.name)
    if cfg.method.name in FUSED_METHODS:
        return FusedMethod(cfg.method.name)
    return FullMethod(cfg.method.name)
