"""Pipeline parallelism: a Hugging Face Llama-family model as a DeepSpeed PipelineModule.

The model folder is loaded (or initialised from its config with the run's seed) exactly as for
any other layout, then cut into DeepSpeed layer specs:

    embedding | decoder layer 0 | ... | decoder layer n-1 | final norm | output head

Each spec wraps the Hugging Face module itself, so a stage runs the very code the whole model
runs and the weights keep their Hugging Face names (`hf_state_dict`). With tied embeddings the
embedding and the head are one DeepSpeed tied layer: the first and the last stage both hold it
and DeepSpeed sums its gradients over them. DeepSpeed partitions the specs by parameter count
or uniformly (parallel.pp_partition); the loss is applied on the last stage.

The head only at labelled positions (`train.logits_at_labels`, as engine.objectives.losses does
for the other layouts): during a training step and an evaluation loss, the last stage's head
layer hands the final norm's hidden states on untouched and tells the loss how to compute its
logits; the loss (`CausalLMLoss`) runs the head at the rows that predict a label only, in chunks of
`train.logits_chunk_rows` when there are more (engine.objectives.losses.labelled_cross_entropy).
The gradients reach the head's weight (or the tied embedding, which DeepSpeed then reduces over
the first and last stage) through the loss, as they did through the layer.

Between stages a micro-batch travels as (hidden or input ids, 2-D attention mask, position
ids); every decoder layer builds its causal mask and rotary embedding from the last two as the
whole model would. A packed batch has no attention mask (transformers derives per-sample masks
from the positions): it travels as a mask of -1, which each layer reads as "none". Batches
differ in length, so the engine runs with dynamic shapes.

Memory: every rank builds the whole model on the CPU first (that is what makes its initial
weights equal to a one-rank run's); the layers of other stages are dropped once the stage is
built, and only this stage's layers move to the accelerator.

Evaluation and generation do not use the engine's schedule: `stage_forward` sends the hidden
states from stage to stage with point-to-point messages inside one pipeline, so data-parallel
replicas never wait for each other (DeepSpeed's eval_batch has a world-wide barrier).
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from torch import nn
from transformers.loss.loss_utils import ForCausalLMLoss

from engine.data import count_tokens
from engine.objectives.losses import PER_MICRO_BATCH, Window, custom_loss, label_positions, labelled_cross_entropy
from engine.steps import step_window

NO_MASK = -1  # an attention mask row of this value stands for "no mask" (packed batches)


# -- the stage layers -------------------------------------------------------------------------

class EmbedPipe(nn.Module):
    """(input ids, mask, positions) -> (embeddings, mask, positions)."""

    def __init__(self, embed_tokens: nn.Module):
        super().__init__()
        self.embed_tokens = embed_tokens

    @property
    def wrapped(self) -> nn.Module:
        return self.embed_tokens

    def forward(self, inputs: tuple) -> tuple:
        ids, mask, positions = inputs
        return self.embed_tokens(ids), mask, positions


class DecoderPipe(nn.Module):
    """One Hugging Face decoder layer with its mask and rotary embedding. `cache` is set only
    while generating (a transformers Cache this stage keeps for its own layers)."""

    def __init__(self, layer: nn.Module, rotary: nn.Module, config, layer_idx: int):
        super().__init__()
        self.layer, self.config, self.layer_idx = layer, config, layer_idx
        self.rotary = rotary  # one module shared by every layer; no weights, only inv_freq
        self.cache = None

    @property
    def wrapped(self) -> nn.Module:
        return self.layer

    def forward(self, inputs: tuple) -> tuple:
        hidden, mask, positions = inputs
        causal = mask_function(self.config, self.layer_idx)(
            config=self.config, inputs_embeds=hidden, attention_mask=mask_or_none(mask),
            cache=self.cache, position_ids=positions,
            layer_idx=self.layer_idx if self.cache is not None else None)
        rotary = self.rotary(hidden, position_ids=positions)
        hidden = self.layer(hidden, attention_mask=causal, position_ids=positions, cache=self.cache,
                            use_cache=self.cache is not None, position_embeddings=rotary)
        return hidden, mask, positions


class NormPipe(nn.Module):
    """(hidden, mask, positions) -> normalised hidden."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm

    @property
    def wrapped(self) -> nn.Module:
        return self.norm

    def forward(self, inputs: tuple) -> torch.Tensor:
        return self.norm(inputs[0])


class HeadPipe(nn.Module):
    """hidden -> logits (an output head of its own); the hidden itself while `loss` takes the
    head to the labelled positions (`loss.takes_hidden`)."""

    def __init__(self, lm_head: nn.Module, loss: "CausalLMLoss | None" = None):
        super().__init__()
        self.lm_head, self.loss = lm_head, loss

    @property
    def wrapped(self) -> nn.Module:
        return self.lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.loss is not None and self.loss.takes_hidden:
            self.loss.head = self.lm_head
            return hidden
        return self.lm_head(hidden)


def tied_logits(embed: EmbedPipe, hidden: torch.Tensor) -> torch.Tensor:
    """The output head of a tied model: the embedding matrix, as nn.Linear without bias uses it."""
    return F.linear(hidden, embed.embed_tokens.weight)


def tied_head(loss: "CausalLMLoss | None", embed: EmbedPipe, hidden: torch.Tensor) -> torch.Tensor:
    """The tied head layer's forward: the logits, or the hidden while `loss` takes the head."""
    if loss is not None and loss.takes_hidden:
        loss.head = partial(tied_logits, embed)
        return hidden
    return tied_logits(embed, hidden)


def mask_or_none(mask: torch.Tensor) -> torch.Tensor | None:
    return None if mask.numel() and int(mask.reshape(-1)[0]) == NO_MASK else mask


def mask_function(config, layer_idx: int) -> Callable:
    """The mask builder the model uses for this layer (sliding window for Mistral-style and
    Qwen2 sliding layers, causal otherwise)."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
    types = getattr(config, "layer_types", None)
    sliding = (types[layer_idx] == "sliding_attention" if types
               else getattr(config, "sliding_window", None) is not None)
    return create_sliding_window_causal_mask if sliding else create_causal_mask


# -- the pipeline module ---------------------------------------------------------------------

class CausalLMLoss:
    """The model's own loss (transformers' loss_function), or the trainer's `loss_fn` called
    with the fields it names among `logits`, `labels` and `num_items_in_batch`.

    DeepSpeed's schedule calls it once per micro-batch on the last stage. For a training step,
    PipelineStep sets `window` (engine.objectives.losses) first: with the token objective each micro-batch
    loss is then the sum of its token losses / N, times `window.scale` (dp_size x accumulation
    steps: the schedule divides each backward by the accumulation steps and DeepSpeed averages
    gradients and the reported loss over the data-parallel ranks). Outside a training step
    (evaluation) the window is the per-micro-batch mean.

    `takes_hidden` (set by `labelled`, where the loss is the plain causal-LM one): the head layer
    hands the hidden states and its head (`head`) instead of the logits, and the head runs at the
    labelled positions only, `chunk_rows` at a time.
    """

    def __init__(self, model_loss: Callable, vocab_size: int, loss_fn: Callable | None = None):
        self.model_loss, self.vocab_size, self.loss_fn = model_loss, vocab_size, loss_fn
        self.window: Window = PER_MICRO_BATCH
        self.takes_hidden, self.chunk_rows = False, 0
        self.head: Callable | None = None

    def labelled(self, at_labels: bool, chunk_rows: int = 0) -> None:
        """Take the head to the labelled positions (where the loss is the model's causal-LM
        cross-entropy), or back to every position (`at_labels` false)."""
        self.takes_hidden = at_labels and self.loss_fn is None and self.model_loss is ForCausalLMLoss
        self.chunk_rows = chunk_rows

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        window = self.window
        if self.takes_hidden:  # `logits` are the final norm's hidden states
            keep, targets = label_positions(labels, window.shifted)
            total = labelled_cross_entropy(self.head, logits[keep], targets, self.chunk_rows)  # type: ignore[arg-type]
            loss = total / (window.num_items if window.num_items is not None else targets.numel())
        elif self.loss_fn is None:
            loss = self.model_loss(logits=logits, labels=labels, vocab_size=self.vocab_size,
                                   num_items_in_batch=window.num_items)
        else:
            loss = custom_loss(self.loss_fn, {"labels": labels}, {"logits": logits}, window)
        return loss * window.scale if window.num_items is not None else loss


def build_pipeline_module(model: nn.Module, *, topology, partition: str = "parameters",
                          loss_fn: Callable | None = None) -> nn.Module:
    """Cut a Hugging Face causal LM into a DeepSpeed PipelineModule on `topology` (every rank
    calls it with the same model). `loss_fn`: the trainer's custom loss, if any."""
    config = model.config
    base = getattr(model, model.base_model_prefix)
    loss = CausalLMLoss(model.loss_function, config.vocab_size, loss_fn)
    tied = model.lm_head.weight is base.embed_tokens.weight
    embed = (TiedLayerSpec("embed", EmbedPipe, base.embed_tokens, tied_weight_attr=["embed_tokens.weight"])
             if tied else LayerSpec(EmbedPipe, base.embed_tokens))
    specs = [embed]
    prefixes = [f"{model.base_model_prefix}.embed_tokens"]
    for i, layer in enumerate(base.layers):
        specs.append(LayerSpec(DecoderPipe, layer, base.rotary_emb, config, i))
        prefixes.append(f"{model.base_model_prefix}.layers.{i}")
    specs.append(LayerSpec(NormPipe, base.norm))
    prefixes.append(f"{model.base_model_prefix}.norm")
    if tied:
        specs.append(TiedLayerSpec("embed", EmbedPipe, base.embed_tokens, forward_fn=partial(tied_head, loss),
                                   tied_weight_attr=["embed_tokens.weight"]))
        prefixes.append(prefixes[0])
    else:
        specs.append(LayerSpec(HeadPipe, model.lm_head, loss))
        prefixes.append("lm_head")
    return HFPipelineModule(specs, prefixes, config, topology=topology, loss_fn=loss,
                            partition_method=partition, dynamic_shape=True)


class HFPipelineModule(PipelineModule):
    """A PipelineModule that knows the Hugging Face names and config of its stage."""

    def __init__(self, specs, prefixes, hf_config, **kwargs):
        super().__init__(layers=specs, **kwargs)
        self.hf_config, self.prefixes = hf_config, prefixes
        for idx, spec in enumerate(self._layer_specs):  # drop other stages' weights
            if not self._local_start <= idx < self._local_stop:
                spec.module_args, spec.module_kwargs = (), {}

    def local_parts(self) -> list[tuple[str, nn.Module]]:
        """(Hugging Face prefix, stage layer) for each layer this stage runs, in order."""
        parts = []
        for idx in range(self._local_start, self._local_stop):
            spec = self._layer_specs[idx]
            module = (self.tied_modules[spec.key] if isinstance(spec, TiedLayerSpec)
                      else getattr(self, str(idx)))
            parts.append((self.prefixes[idx], module))
        return parts

    @property
    def activation_dtype(self) -> torch.dtype:
        return next(p.dtype for p in self.parameters() if p.is_floating_point())

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's weights under their names in the whole Hugging Face model."""
        out = {}
        for prefix, part in self.local_parts():
            for name, tensor in part.wrapped.state_dict().items():
                out[f"{prefix}.{name}"] = tensor
        return out

    @torch.no_grad()
    def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor]) -> list[str]:
        """Copy this stage's weights out of a whole model's state dict; returns missing keys."""
        missing = []
        for prefix, part in self.local_parts():
            own = {k[len(prefix) + 1:]: v for k, v in state_dict.items() if k.startswith(prefix + ".")}
            result = part.wrapped.load_state_dict(own, strict=False)
            missing += [f"{prefix}.{k}" for k in result.missing_keys]
        return missing

    def set_cache(self, cache) -> None:
        """Give this stage's decoder layers a KV cache (None: back to training use)."""
        for _, part in self.local_parts():
            if isinstance(part, DecoderPipe):
                part.cache = cache


# -- training -------------------------------------------------------------------------------

def pipe_inputs(batch: dict, device) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None]:
    """A collated batch -> ((input ids, mask, positions), labels) as the pipeline carries them."""
    ids = batch["input_ids"].to(device)
    rows, width = ids.shape
    mask = batch.get("attention_mask")
    mask = mask.to(device) if mask is not None else torch.full_like(ids, NO_MASK)
    positions = batch.get("position_ids")
    # without positions the model counts 0..T-1 (what LlamaModel does when given none)
    positions = (positions.to(device) if positions is not None
                 else torch.arange(width, device=device).repeat(rows, 1))
    labels = batch.get("labels")
    return (ids, mask, positions), (labels.to(device) if labels is not None else None)


class PipelineStep:
    """One optimizer step with DeepSpeed's pipeline schedule: the step's micro-batches flow
    through the stages (1F1B), the last stage applies the loss, then every stage steps."""

    def __call__(self, trainer, micro_batches: list[dict]) -> tuple[torch.Tensor, int]:
        device = trainer.engine.device
        batches = iter([pipe_inputs(b, device) for b in micro_batches])
        window = step_window(trainer, micro_batches)  # every stage counts: one all-reduce over dp
        if window.num_items is not None:
            window = replace(window, scale=window.scale * len(micro_batches))
        loss_fn = trainer.engine.module.loss_fn
        loss_fn.window = window
        loss_fn.labelled(trainer.config.train.logits_at_labels, trainer.config.train.logits_chunk_rows)
        try:
            # the step's loss (the schedule's mean over the micro-batches, averaged over the
            # data-parallel replicas), on every stage
            loss = trainer.engine.train_batch(data_iter=batches)
        finally:
            loss_fn.window = PER_MICRO_BATCH
            loss_fn.labelled(False)
        return loss.detach().float(), sum(count_tokens(b) for b in micro_batches)


# -- stage-to-stage forward (evaluation, generation) -------------------------------------------

def stage_forward(engine, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
    """Run `inputs` (ids, mask, positions; the same on every stage) through this pipeline;
    returns the logits on the last stage, None elsewhere. Collective over the pipeline only."""
    module, grid = engine.module, engine.grid
    stage, stages = grid.get_stage_id(), grid.pipe_parallel_size
    ids, mask, positions = inputs
    if stage == 0:
        x = inputs
    else:
        hidden = torch.empty(*ids.shape, module.hf_config.hidden_size, dtype=module.activation_dtype,
                             device=ids.device)
        dist.recv(hidden, src=grid.stage_to_global(stage - 1))
        x = (hidden, mask, positions)
    out = module(x)
    if stage < stages - 1:
        dist.send(out[0].contiguous(), dst=grid.stage_to_global(stage + 1))
        return None
    return out


def broadcast_from_last_stage(engine, tensor: torch.Tensor) -> torch.Tensor:
    """Send the last stage's `tensor` to every stage of this pipeline (in place)."""
    grid = engine.grid
    dist.broadcast(tensor, src=grid.stage_to_global(grid.pipe_parallel_size - 1),
                   group=grid.get_pipe_parallel_group())
    return tensor


def eval_loss(engine, batch: dict, at_labels: bool = False, chunk_rows: int = 0) -> torch.Tensor:
    """The loss of one batch under pipeline parallelism, known on every stage (collective over
    the pipeline): what `Trainer.compute_loss` returns with one stage. `at_labels`, `chunk_rows`:
    the head at the labelled positions only (CausalLMLoss.labelled)."""
    inputs, labels = pipe_inputs(batch, engine.device)
    loss_fn = engine.module.loss_fn
    loss_fn.labelled(at_labels, chunk_rows)
    try:
        logits = stage_forward(engine, inputs)
        loss = torch.zeros(1, dtype=torch.float32, device=engine.device)
        if logits is not None:
            loss[0] = loss_fn(logits, labels).float()
    finally:
        loss_fn.labelled(False)
    return broadcast_from_last_stage(engine, loss)[0]
