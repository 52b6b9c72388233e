"""The run config's declaration: one pydantic model per section, each field documented where it
is declared (litgpt style), with its bounds and label on the field. Pydantic validates types and
bounds (strictly: unknown keys are refused); contract.config.load turns its errors into this
project's messages, contract.config.checks adds the combinations that cannot work, and
contract.config.form lists the fields for the forms and the generated reference. Torch-free.
"""

from __future__ import annotations

import copy
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from contract.capabilities import Method


def _f(default: Any, help: str, *, minimum: float | None = None, maximum: float | None = None,
       **meta: Any) -> Any:
    """A field with its documentation (`description`), its bounds (`ge` / `le`, which pydantic
    enforces) and its form label and other hints (`json_schema_extra`): one declaration that the
    validation, the forms and the reference all read."""
    bounds: dict[str, Any] = {k: v for k, v in (("ge", minimum), ("le", maximum)) if v is not None}
    extra: Any = meta or None
    if isinstance(default, (list, dict)):
        return Field(default_factory=lambda: copy.deepcopy(default), description=help,
                     json_schema_extra=extra, **bounds)
    return Field(default=default, description=help, json_schema_extra=extra, **bounds)


class Section(BaseModel):
    """A config section: unknown keys are refused; a number given where a string is expected is
    taken as its text (`run_name=123`); a list may be given as `a,b` (the command line, a form);
    true / false is not a number (`max_steps=true` is refused, not read as 1), nor are nan and inf."""
    model_config = ConfigDict(extra="forbid", coerce_numbers_to_str=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _comma_separated_lists(cls, value: Any, info: ValidationInfo) -> Any:
        field = cls.model_fields.get(info.field_name or "")
        if field is not None and field.annotation in (int, float) and isinstance(value, bool):
            raise PydanticCustomError("bool_for_number", "true / false is not a number")
        if field is not None and typing.get_origin(field.annotation) is list and isinstance(value, str):
            return [v.strip() for v in value.split(",") if v.strip()]
        return value


# the methods are contract.capabilities.Method (declared once, there)
FUSED_METHODS = tuple(m.value for m in Method if m.fused)  # the update happens inside backward
PEFT_METHODS = tuple(m.value for m in Method if m.peft)
# eval.evaluators values (engine.evaluation.evaluators builds them; kept here so that validation stays torch-free)
EVALUATORS = ("perplexity", "choice", "exact_match", "generation")


class ModelConfig(Section):
    path: str = _f("", "Local Hugging Face model folder, or a hub ID (owner/name) read from the Hugging "
                   "Face cache. Empty: the embedded tiny default model.", label="Model folder or hub ID")
    tokenizer: str = _f("", "Tokenizer folder or hub ID. Empty: the model's own tokenizer.")
    gradient_checkpointing: bool = _f(False, "Recompute activations in backward to save memory.")
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = _f(
        "sdpa", "Attention kernel: sdpa (PyTorch's fused attention, any device), eager (plain "
        "matrix products), flash_attention_2 (a CUDA GPU in bf16 / fp16, the flash_attn package).",
        label="Attention")
    trust_remote_code: bool = _f(False, "Allow model code shipped inside the model folder to run.")
    quantization: Literal["none", "4bit", "8bit"] = _f(
        "none", "Load the base model's linear layers quantized with bitsandbytes (QLoRA) and train a "
        "PEFT adapter on it: 4bit keeps about a quarter of bf16's weight memory, 8bit about half. Costs: "
        "every forward dequantizes the weights (slower steps) and the base loses a little accuracy. "
        "Needs method lora, prompt_tuning or p_tuning, zero_stage 0-2, tp_size and pp_size 1.",
        label="Quantized base")
    bnb_4bit_quant_type: Literal["nf4", "fp4"] = _f(
        "nf4", "4bit: the data type of the weights: nf4 (NormalFloat, QLoRA's, fits normally "
        "distributed weights) or fp4.", label="4-bit type")
    bnb_4bit_use_double_quant: bool = _f(
        True, "4bit: quantize the quantization constants too (about 0.4 bits per parameter less).",
        label="Double quantization")
    bnb_4bit_compute_dtype: Literal["auto", "bf16", "fp16", "fp32"] = _f(
        "auto", "4bit: the dtype the weights are dequantized to for each matrix product; auto: the run's "
        "precision.", label="4-bit compute dtype")
    bnb_4bit_quant_storage: Literal["uint8", "bf16", "fp16", "fp32"] = _f(
        "uint8", "4bit: the dtype of the tensors that hold the packed weights (the bits are the same; a "
        "float type is what layouts that flatten parameters by dtype need).", label="4-bit storage dtype")


class DataConfig(Section):
    train: str = _f("", "Training data file or saved dataset folder (JSON lines, JSON, CSV, "
                    "Parquet, or `datasets` save_to_disk). Empty: the embedded default task.",
                    label="Training data")
    eval: str = _f("", "Evaluation data in the same formats. Empty with the default task: its "
                   "held-out split; empty otherwise: no evaluation data.", label="Evaluation data")
    format: Literal["auto", "text", "input_output", "chat", "tokenized", "preference", "unpaired", "prompt"] = _f(
        "auto", "Row format: {text}, {input, output} (loss on output only), {messages} (chat "
        "template, loss on assistant turns), {input_ids, labels}, {prompt, chosen, rejected} "
        "(preference pairs), {prompt, completion, label} (KTO), {prompt, ...} (GRPO: prompts, the "
        "other columns go to the reward functions); auto detects it from the keys.")
    max_length: int = _f(512, "Longest sample in tokens.", minimum=8)
    overlong: Literal["truncate", "drop", "error"] = _f(
        "truncate", "What to do with a sample longer than max_length (always counted and reported).")
    batching: Literal["random", "group_by_length", "packing"] = _f(
        "group_by_length", "How samples form batches: random order, batches of similar length "
        "(little padding), or several samples packed per row (per-sample attention and positions).")
    num_workers: int = _f(0, "Data loader worker processes (a run's training sources are drawn "
                          "in the main process, step by step: this applies to evaluation data).", minimum=0)
    sources: list[dict] = _f([], "Several training sources, each {path, format, weight, name}: a "
                             "file or saved dataset folder, its row format (auto by default), its "
                             "weight (>= 0; batches draw from the sources in proportion) and a name "
                             "(default: the file name). Empty: data.train is the one source.",
                             label="Training sources")


class TeachConfig(Section):
    per_step: int = _f(4, "Samples of a taught answer in each of the next global batches.", minimum=1)
    steps: int = _f(20, "Batches a taught answer is mixed into.", minimum=1)
    check_after: int = _f(20, "Steps after a teach when the model is asked the prompt again "
                          "(greedy) and the old and new answers are recorded; 0: never.", minimum=0)
    max_new_tokens: int = _f(32, "Tokens generated for the answers before and after teaching.", minimum=1)


class MethodConfig(Section):
    # the name is kept as its text ("lora"), so the config reads, prints and saves as written
    model_config = ConfigDict(use_enum_values=True)

    name: Method = _f(
        "full", "Fine-tuning method: all parameters with an optimizer, a PEFT adapter, or the "
        "fused low-memory LOMO / AdaLomo update.", label="Method")
    lora_r: int = _f(8, "LoRA rank.", minimum=1)
    lora_alpha: int = _f(16, "LoRA scaling numerator (scale = alpha / r).", minimum=1)
    lora_dropout: float = _f(0.0, "Dropout on the LoRA branch.", minimum=0.0, maximum=1.0)
    lora_target_modules: list[str] = _f([], "Module names LoRA wraps. Empty: inferred from the model.")
    num_virtual_tokens: int = _f(8, "Virtual tokens for prompt tuning / P-tuning.", minimum=1)
    adapter_name: str = _f("default", "Name of the trained adapter.")


OBJECTIVES = ("sft", "dpo", "orpo", "simpo", "kto", "grpo")
REFERENCE_OBJECTIVES = ("dpo", "kto")  # compare the policy with a frozen reference model
OBJECTIVE_FORMATS = {"dpo": "preference", "orpo": "preference", "simpo": "preference", "kto": "unpaired",
                     "grpo": "prompt"}


class PreferenceConfig(Section):
    """The training objective (docs/preferences.md): imitation (sft) or learning from preferences.
    The defaults are TRL's."""
    objective: Literal["sft", "dpo", "orpo", "simpo", "kto", "grpo"] = _f(
        "sft", "sft: imitate the answers (the data's labels). dpo: prefer chosen over rejected "
        "against a frozen reference (rows {prompt, chosen, rejected}); orpo: odds-ratio preference "
        "plus the chosen answers' likelihood, no reference; simpo: length-normalised preference "
        "with a target margin, no reference; kto: desirable / undesirable answers against the "
        "reference (rows {prompt, completion, label}); grpo: learn from rewards of sampled answers "
        "(rows {prompt, ...}; the grpo section, docs/rewards.md).", label="Objective")
    beta: float = _f(0.1, "DPO, SimPO, KTO: beta, the scale of the implicit reward (DPO, KTO: how "
                     "far from the reference; IPO: the regularisation tau).", minimum=0.0, label="Beta")
    dpo_loss: Literal["sigmoid", "ipo", "hinge", "robust"] = _f(
        "sigmoid", "DPO's loss: sigmoid (the DPO paper), ipo (squared, per-token averaged), hinge "
        "(SLiC), robust (label noise of label_smoothing).", label="DPO loss")
    label_smoothing: float = _f(0.0, "DPO robust loss: the probability that a pair's preference is "
                                "flipped, in [0, 0.5).", minimum=0.0, maximum=0.49, label="Label smoothing")
    orpo_lambda: float = _f(0.1, "ORPO: weight of the odds-ratio term next to the chosen answers' "
                            "negative log-likelihood (TRL's ORPOConfig.beta).", minimum=0.0, label="ORPO lambda")
    simpo_gamma: float = _f(0.5, "SimPO: the target reward margin gamma.", label="SimPO gamma")
    kto_desirable_weight: float = _f(1.0, "KTO: weight of the desirable answers' losses.", minimum=0.0,
                                     label="KTO desirable weight")
    kto_undesirable_weight: float = _f(1.0, "KTO: weight of the undesirable answers' losses.", minimum=0.0,
                                       label="KTO undesirable weight")
    sft_pairs: Literal["auto", "orpo", "simpo", "dpo"] = _f(
        "auto", "An SFT run's live preference pairs (the chat's prefer): the chosen answer trains as a "
        "taught answer, plus this preference loss, averaged over the step's pairs, added to the step's "
        "SFT loss: orpo (lambda times ORPO's odds-ratio term, orpo_lambda), simpo (beta, simpo_gamma), "
        "dpo (beta; against the model without its adapter, so lora only); auto: dpo with lora, else orpo.",
        label="SFT run's preference pairs")


class GrpoConfig(Section):
    """GRPO and its variants (docs/rewards.md): sample num_generations answers per prompt with the
    live weights, score them with the reward functions, move toward the better ones. TRL's
    GRPOConfig names, meanings and defaults (a run's micro-batch is train.micro_batch_size prompts)."""
    loss_type: Literal["grpo", "dr_grpo", "dapo", "bnpo"] = _f(
        "dapo", "How token losses are averaged: grpo (per answer, then over answers), bnpo (over the "
        "micro-batch's tokens), dr_grpo (sum over the tokens / (answers x max_completion_length)), dapo "
        "(over the tokens of the whole step on every rank).", label="GRPO loss")
    num_generations: int = _f(8, "Answers sampled per prompt (a group; advantages are relative to "
                              "the group).", minimum=2, label="Answers per prompt")
    max_completion_length: int = _f(256, "Most tokens sampled per answer.", minimum=1,
                                    label="Max answer tokens")
    temperature: float = _f(1.0, "Sampling temperature (also divides the logits the loss scores).",
                            minimum=0.01, label="Temperature")
    top_p: float = _f(1.0, "Nucleus sampling: the smallest set of tokens whose probability reaches top_p.",
                      minimum=0.01, maximum=1.0, label="Top p")
    epsilon: float = _f(0.2, "Clip range of the importance ratio, below 1.", minimum=0.0, label="Clip epsilon")
    epsilon_high: float = _f(0.0, "Clip range above 1 (DAPO recommends 0.28); 0: epsilon.", minimum=0.0,
                             label="Clip epsilon (upper)")
    beta: float = _f(0.0, "Weight of the KL term to the reference (the model without its adapter "
                     "under PEFT, a frozen copy otherwise); 0: no reference.", minimum=0.0, label="KL beta")
    scale_rewards: Literal["group", "batch", "none"] = _f(
        "group", "Advantages: (reward - group mean) divided by the group's std (group), the whole "
        "step's std (batch), or not divided (none).", label="Scale rewards")
    num_iterations: int = _f(1, "Optimizer steps per batch of samples (TRL's mu): each is a step; answers "
                             "are sampled every num_iterations steps and reused with importance ratios.",
                             minimum=1, label="Iterations per sample batch")
    rewards: list[dict] = _f([], "Reward functions, each {kind, weight, ...} (built-in: exact_match, regex, "
                             "format, numeric, length) or {function: module:function, weight}; the "
                             "reward is their weighted sum (docs/rewards.md). Empty: exact match "
                             "against the rows' `answer` column.", label="Rewards")


class OptimConfig(Section):
    name: Literal["adamw", "sgd"] = _f("adamw", "Optimizer (ignored by LOMO / AdaLomo).", label="Optimizer")
    lr: float = _f(1e-3, "Peak learning rate.", minimum=0.0)
    weight_decay: float = _f(0.0, "Decoupled weight decay.", minimum=0.0)
    betas: list[float] = _f([0.9, 0.999], "Adam betas.")
    eps: float = _f(1e-8, "Adam epsilon.", minimum=0.0)
    scheduler: Literal["constant", "linear", "cosine"] = _f("cosine", "Learning-rate schedule after warmup.")
    warmup_steps: int = _f(0, "Linear warmup steps (wins over warmup_ratio when > 0).", minimum=0)
    warmup_ratio: float = _f(0.0, "Warmup as a fraction of the total steps.", minimum=0.0, maximum=0.99)
    grad_clip: float = _f(1.0, "Clip the global gradient norm to this value; 0 disables.", minimum=0.0)


class TrainConfig(Section):
    epochs: int = _f(1, "Passes over the training data (max_steps wins when > 0).", minimum=0)
    max_steps: int = _f(0, "Optimizer steps to train; 0: as many as the epochs give.", minimum=0)
    micro_batch_size: int = _f(8, "Samples per rank per forward pass.", minimum=1)
    grad_accum: int = _f(1, "Micro-batches accumulated per optimizer step.", minimum=1)
    precision: Literal["auto", "bf16", "fp16", "fp32"] = _f(
        "auto", "Training precision; auto takes bf16 where the hardware does bf16 fast, else fp32.")
    seed: int = _f(42, "Seed of weights init, data order and dropout.")
    loss_average: Literal["tokens", "micro_batch"] = _f(
        "tokens", "The step's loss: tokens = the sum of the token losses over every micro-batch of the "
        "step on every data-parallel rank, divided by their number of label tokens (the Hugging Face "
        "Trainer's objective; the same whatever the split into micro-batches, accumulation and ranks); "
        "micro_batch = the mean of the micro-batches' mean losses (each micro-batch weighs the same).")
    logits_at_labels: bool = _f(
        True, "Run the output head only at the positions that carry a label (prompt and padding "
        "skipped: less time and memory with a wide vocabulary); the loss is the same within fp32 "
        "rounding. false: logits at every position, as the Hugging Face Trainer computes them.")
    logits_chunk_rows: int = _f(
        1024, "With logits_at_labels: when a micro-batch has more labelled positions than this, the "
        "output head and its cross-entropy run this many positions at a time, each chunk's logits "
        "recomputed in the backward (only one chunk's logits in memory, for one more head product "
        "per chunk; a model that soft-caps or scales its logits is never chunked). 0: all at once.",
        minimum=0)


class ParallelConfig(Section):
    nproc: int = _f(1, "Processes (ranks) on this machine.", minimum=1)
    zero_stage: int = _f(0, "DeepSpeed ZeRO stage: 0 off, 1 optimizer, 2 +gradients, 3 +parameters.",
                         minimum=0, maximum=3)
    offload_optimizer: bool = _f(False, "Keep optimizer state in CPU memory (ZeRO >= 1).")
    offload_param: bool = _f(False, "Keep parameters in CPU memory (ZeRO 3).")
    tp_size: int = _f(1, "Tensor-parallel size (DeepSpeed AutoTP).", minimum=1)
    pp_size: int = _f(1, "Pipeline-parallel size (DeepSpeed pipeline engine).", minimum=1)
    dp_size: int = _f(0, "Data-parallel size; 0: derived as world / (tp * pp).", minimum=0)
    pp_partition: Literal["parameters", "uniform"] = _f("parameters", "How pipeline stages are split.")
    launcher: Literal["deepspeed", "torchrun"] = _f("deepspeed", "Launcher that starts the ranks.")
    deepspeed: dict = _f({}, "A full DeepSpeed config (dict, or {file: path.json}); \"auto\" values "
                         "are filled from this run config, contradicting values are an error.")
    hostfile: str = _f("", "DeepSpeed hostfile for several machines. Empty: this machine only.")
    nodes: int = _f(1, "Machines the run spans when no hostfile lists them: a Slurm job's nodes "
                    "(set by submit --slurm, which starts nproc ranks on each).", minimum=1, label="Nodes")
    master_addr: str = _f("127.0.0.1", "Rendezvous address of rank 0.")
    master_port: int = _f(0, "Rendezvous port; 0 picks a free one.", minimum=0, maximum=65535)


class EvalConfig(Section):
    every_n_steps: int = _f(0, "Evaluate every n optimizer steps; 0 never.", minimum=0)
    every_n_epochs: int = _f(0, "Evaluate every n epochs; 0 never.", minimum=0)
    at_end: bool = _f(True, "Evaluate once more when training ends (if there is evaluation data).")
    batch_size: int = _f(16, "Samples per rank per evaluation batch.", minimum=1)
    evaluators: list[str] = _f(["perplexity"], "Evaluators: perplexity (loss, perplexity); choice "
                               "(rows with choices: the lowest-loss candidate; accuracy, F1); "
                               "exact_match (generate and compare); generation (exact match, BLEU, "
                               "ROUGE, predictions saved in the run folder).")
    max_new_tokens: int = _f(32, "Tokens generated per sample by generating evaluators.", minimum=1)
    max_samples: int = _f(0, "Evaluate on at most this many samples; 0: all.", minimum=0)
    lm_eval_tasks: list[str] = _f([], "lm-evaluation-harness tasks run on the live weights at each "
                                  "evaluation: task names, or paths of task YAML files; metrics "
                                  "lm_eval/<task>/<metric> (needs the lm-eval package).",
                                  label="lm-eval tasks")
    early_stopping_patience: int = _f(0, "Stop training after this many evaluations in a row "
                                      "without improvement of checkpoint.monitor; 0: never stop early.",
                                      minimum=0, label="Early stopping patience")
    early_stopping_threshold: float = _f(0.0, "How much checkpoint.monitor must improve on its best "
                                         "to count as an improvement (early stopping).", minimum=0.0,
                                         label="Early stopping threshold")


class CheckpointConfig(Section):
    every_n_steps: int = _f(0, "Save a training checkpoint every n steps; 0 never.", minimum=0)
    every_n_epochs: int = _f(0, "Save a training checkpoint every n epochs; 0 never.", minimum=0)
    keep_last: int = _f(2, "Keep the newest k step checkpoints; 0 keeps all.", minimum=0)
    keep_best: int = _f(0, "Also keep the best k by `monitor`; 0 off.", minimum=0)
    monitor: str = _f("eval/loss", "Metric the best checkpoints are ranked by.")
    mode: Literal["min", "max"] = _f("min", "Whether smaller or larger `monitor` is better.")
    save_at_end: bool = _f(True, "Save the final model (Hugging Face format) when training ends.")
    load_best_at_end: bool = _f(False, "Reload the best checkpoint's weights at the end.")
    snapshots_keep: int = _f(2, "In-memory snapshots kept for instant rewinds (the `snapshot` "
                             "command); the oldest goes first; 0: snapshots off.", minimum=0,
                             maximum=1000, label="Snapshots kept")
    snapshots_max_mib: int = _f(0, "Most host memory (MiB, per machine) the snapshots may take "
                                "together; the oldest go first; 0: no bound but snapshots_keep.",
                                minimum=0, label="Snapshot memory (MiB)")


class LoggingConfig(Section):
    output_dir: str = _f("runs", "Folder that holds the run folders.")
    run_name: str = _f("", "Name of this run's folder. Empty: a timestamp.")
    log_every_n_steps: int = _f(1, "Write a training record every n steps.", minimum=1)
    tensorboard: bool = _f(True, "Also write TensorBoard event files.")
    csv: bool = _f(False, "Also write train.csv and eval.csv (one row per record) in the run folder.",
                   label="CSV files")
    wandb: Literal["off", "offline", "online"] = _f("off", "Also log to Weights & Biases: offline writes "
                                                    "the run under <run folder>/wandb/ with no network "
                                                    "(wandb sync uploads it later); online needs wandb login.",
                                                    label="Weights & Biases")
    wandb_project: str = _f("livetune", "The W&B project the run is logged to.", label="W&B project")
    progress_bar: bool = _f(True, "Show a progress bar on rank 0 when attached to a terminal.")


class ControlConfig(Section):
    enabled: bool = _f(True, "Open the control socket on rank 0 (chat, pause, set lr ...).",
                       label="Control socket on")
    host: str = _f("127.0.0.1", "Address the control socket listens on. Anything but loopback "
                   "must be opted into explicitly; every message still needs the run's token.")
    port: int = _f(0, "Control socket port; 0 picks a free one.", minimum=0, maximum=65535)
    chat_only: bool = _f(False, "Train nothing: hold the model (model.path, the checkpoint `resume` "
                         "names, or chat_load) in the engine for chat until stopped.", label="Chat only")
    chat_load: str = _f("", "With chat_only: a model folder, or a PEFT adapter folder on top of model.path, "
                        "loaded into the engine before chat starts.", label="Chat with (folder)")
    serving_budget: float = _f(0.05, "Share of the wall time of a training run that answering the OpenAI-compatible "
                               "API's requests may take (each is generated at a step boundary, time the run "
                               "does not train): over about a minute, requests beyond it wait in the queue "
                               "(its bound and timeouts apply). While paused or chat only: no limit. 1: no "
                               "limit. The chat's own replies are never limited.", minimum=0.0, maximum=1.0,
                               label="API serving budget (share of time)")


class FaultConfig(Section):
    max_restarts: int = _f(0, "Times the run manager relaunches the whole group from the run's latest complete "
                           "checkpoint after a rank dies (0: a failure ends the run). A laptop: 0; a "
                           "cluster or rented GPUs: 3, with checkpoint.every_n_steps set (docs/faults.md).",
                           minimum=0, maximum=100, label="Restarts after a failure")


class GuardConfig(Section):
    """The spike guard (engine.guard.decisions): every step's loss and gradient norm are judged, and
    a non-finite value, a loss spike or a gradient norm above the bound triggers an action."""
    enabled: bool = _f(False, "Judge every step and act by itself on a non-finite loss, a loss "
                       "spike or a gradient norm above grad_norm_max.", label="Spike guard on")
    warmup_steps: int = _f(10, "Steps whose loss only feeds the spike statistic before spikes are "
                           "judged (non-finite values and the norm bound count from step 1).",
                           minimum=0, label="Guard warm-up steps")
    window: int = _f(20, "The spike statistic is taken over the losses of the last n accepted steps.",
                     minimum=3, maximum=10000, label="Spike window (steps)")
    spike_z: float = _f(6.0, "A loss spikes when it is above the window's median by more than spike_z "
                        "times its noise (a robust standard deviation of the step-to-step changes) ...",
                        minimum=0.0, label="Spike threshold (robust z)")
    spike_ratio: float = _f(1.2, "... and at least spike_ratio x the median (a nearly flat loss then "
                            "does not make every wiggle a spike); 1: the z threshold alone.",
                            minimum=1.0, label="Spike ratio to the median")
    grad_norm_max: float = _f(0.0, "Bound on the global gradient norm (before clipping); 0: off.",
                              minimum=0.0, label="Gradient norm bound")
    on_nonfinite: Literal["skip", "rewind", "pause"] = _f(
        "skip", "Action on a non-finite loss: skip the update, rewind to the newest good checkpoint "
        "or snapshot (lr x lr_scale), or pause and notify.", label="On a non-finite loss")
    on_spike: Literal["skip", "rewind", "pause"] = _f("skip", "Action on a loss spike (as on_nonfinite).",
                                                      label="On a loss spike")
    on_grad_norm: Literal["rewind", "pause"] = _f(
        "rewind", "Action on a gradient norm above the bound, or non-finite. The norm is known only "
        "once the update is applied, so it cannot be skipped.", label="On a gradient norm")
    lr_scale: float = _f(0.5, "Factor on the learning rate at each guard rewind.", minimum=0.0,
                         maximum=1.0, label="Learning-rate factor per rewind")
    max_rewinds: int = _f(3, "Guard rewinds in the whole run; once spent, a trigger that would "
                          "rewind pauses instead.", minimum=0, label="Most guard rewinds")
    max_skips_in_a_row: int = _f(5, "Skipped steps in a row after which the guard pauses instead "
                                 "(a run whose every step spikes is not training).", minimum=1,
                                 label="Most skips in a row")
    snapshot_every_n_steps: int = _f(0, "Take an in-memory snapshot every n steps for the guard to "
                                     "rewind to (fast, no disk); 0: off (it rewinds to checkpoints "
                                     "and to the snapshots you take).", minimum=0,
                                     label="Guard snapshot every N steps")


class RunConfig(Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    method: MethodConfig = Field(default_factory=MethodConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    control: ControlConfig = Field(default_factory=ControlConfig)
    teach: TeachConfig = Field(default_factory=TeachConfig)
    guard: GuardConfig = Field(default_factory=GuardConfig)
    preference: PreferenceConfig = Field(default_factory=PreferenceConfig)
    grpo: GrpoConfig = Field(default_factory=GrpoConfig)
    fault: FaultConfig = Field(default_factory=FaultConfig)
    resume: str = _f("", "Continue from a training checkpoint folder, `latest` in the run folder (the "
                     "present branch's newest), or a branch's name (its newest checkpoint).",
                     label="Resume from checkpoint")

    # -- derived values -----------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        nodes = _hostfile_nodes(self.parallel.hostfile) if self.parallel.hostfile else self.parallel.nodes
        return self.parallel.nproc * max(1, nodes)

    @property
    def dp_size(self) -> int:
        return self.world_size // (self.parallel.tp_size * self.parallel.pp_size)

    @property
    def uses_default_task(self) -> bool:
        return not self.data.train and not self.data.sources

    def to_dict(self) -> dict:
        return self.model_dump()

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# The most used settings, short whatever the nesting: `./launch.sh train max_steps=40 nproc=2`.
SHORTCUTS = {
    "max_steps": "train.max_steps",
    "epochs": "train.epochs",
    "nproc": "parallel.nproc",
    "zero_stage": "parallel.zero_stage",
    "tp": "parallel.tp_size",
    "pp": "parallel.pp_size",
    "seed": "train.seed",
    "lr": "optim.lr",
    "output_dir": "logging.output_dir",
    "run_name": "logging.run_name",
    "method": "method.name",
    "precision": "train.precision",
    "model": "model.path",
    "batch_size": "train.micro_batch_size",
    "objective": "preference.objective",
}


class ConfigError(ValueError):
    """Every problem of a config at once; `problems` is a list of (field, message)."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = problems
        lines = "\n".join(f"  - {key}: {msg}" for key, msg in problems)
        super().__init__(f"invalid run config ({len(problems)} problem{'s' * (len(problems) != 1)}):\n{lines}")


def _hostfile_nodes(hostfile: str) -> int:
    if not hostfile or not Path(hostfile).is_file():
        return 1
    lines = [ln.split("#")[0].strip() for ln in Path(hostfile).read_text().splitlines()]
    return max(1, sum(1 for ln in lines if ln))
