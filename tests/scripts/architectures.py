"""The architecture matrix (tests/test_architectures.py): for each tiny architecture, built from
a config in WORK/ARCH/model, our Trainer (1 process) trains full fine-tuning and LoRA a few
steps; the LoRA adapter is saved, loaded back with peft onto a fresh base model, and its logits
compared with the trained model's. Prints one `RESULT {json}` line per architecture.

    python tests/scripts/architectures.py WORK ARCH [ARCH ...]
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

VOCAB, STEPS = 64, 16  # 16 steps of 4: the 32 rows twice
# Learning rates (constant, Adam): measured on every architecture here, 16 steps on 1 process,
# the second pass's mean loss below the first's by 17-19 % (full) and 1.7-3.6 % (LoRA at 1e-2;
# at 2e-2 LoRA overshoots and Phi-3's second pass was no lower than its first)
FULL_LR, LORA_LR = 5e-3, 1e-2
SPECIAL = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def configs() -> dict:
    import transformers as t
    common = dict(vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=64, **SPECIAL)
    decoder = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, **common)
    return {
        # dropout off everywhere: the 2-rank matrix compares tp's losses with ZeRO's step for step
        "gpt2": lambda: t.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **SPECIAL),
        "qwen2": lambda: t.Qwen2Config(num_key_value_heads=2, **decoder),
        "mistral": lambda: t.MistralConfig(num_key_value_heads=2, sliding_window=16, **decoder),
        "phi3": lambda: t.Phi3Config(num_key_value_heads=4, **decoder),
        "gpt_neox": lambda: t.GPTNeoXConfig(**decoder),
        "opt": lambda: t.OPTConfig(hidden_size=32, ffn_dim=64, num_attention_heads=4, word_embed_proj_dim=32,
                                   dropout=0.0, **common),
        "gemma": lambda: t.GemmaConfig(num_key_value_heads=2, head_dim=8, **decoder),  # 2 kv heads: tp=2 splits them
        "llama": lambda: t.LlamaConfig(num_key_value_heads=2, **decoder),
    }


def write_folder(folder: Path, arch: str) -> None:
    """A tiny model of `arch` with a word-level tokenizer ("t1 t5 t6" <-> [1, 5, 6]), and
    patterned rows to learn."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(configs()[arch]())
    # Chat from a barely trained tiny model may well pick pad / bos / eos / unk first, which
    # decode to nothing (skip_special_tokens) or end the answer at once; suppressing them (a
    # setting any user may put in generation_config.json, honoured by the engine's generate)
    # makes "the streamed answer is not empty" a property of the generation path, not of luck.
    model.generation_config = GenerationConfig(suppress_tokens=[0, 1, 2, 3], **SPECIAL)
    model.save_pretrained(folder / "model")
    vocab = {f"t{i}": i for i in range(VOCAB)}
    words = Tokenizer(models.WordLevel(vocab, unk_token="t3"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # chat prompts are text
    tok = PreTrainedTokenizerFast(tokenizer_object=words,
                                  pad_token="t0", bos_token="t1", eos_token="t2", unk_token="t3")
    tok.save_pretrained(folder / "model")
    rows = []
    for i in range(32):  # counting runs with a stride: easy to learn in a few steps
        start, stride, length = 3 + i % 40, 1 + i % 3, 10 + i % 7
        rows.append({"input_ids": [1] + [3 + (start + stride * k) % (VOCAB - 3) for k in range(length)]})
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def overrides(folder: Path, method: str, lr: float, steps: int, name: str, *extra: str) -> list[str]:
    """The run config of one cell: the folder's model and rows, constant lr, fp32, nothing saved
    or evaluated on the way (`extra`: the layout, say "nproc=2", "zero_stage=3")."""
    return [f"model.path={folder / 'model'}", f"data.train={folder / 'train.jsonl'}", f"method={method}",
            f"max_steps={steps}", "batch_size=4", f"lr={lr}", "optim.warmup_steps=0", "optim.scheduler=constant",
            "precision=fp32", "eval.at_end=false", "checkpoint.save_at_end=false", "control.enabled=false",
            "logging.tensorboard=false", "logging.progress_bar=false", f"output_dir={folder / 'runs'}",
            f"run_name={name}", *extra]


def train(folder: Path, method: str, lr: float, *extra: str, steps: int = STEPS, name: str = "",
          at_step: dict | None = None):
    """Our Trainer on the cell's config; returns (trainer, per-step losses). `at_step`:
    {step: fn(trainer)} called at those step boundaries (a mid-training chat)."""
    from contract.config.load import load_config
    from engine.callbacks import Callback
    from engine.trainer import Trainer
    cfg = load_config(overrides=overrides(folder, method, lr, steps, name or method, *extra))
    losses: list[float] = []

    class Record(Callback):
        def on_train_batch_end(self, trainer, loss):
            losses.append(loss)
            if at_step and trainer.state.global_step in at_step:
                at_step[trainer.state.global_step](trainer)

    trainer = Trainer(config=cfg, callbacks=[Record()])
    trainer.train()
    return trainer, losses


# -- shared by the 2-rank scripts (architectures_zero.py, architectures_tp.py) ------------------
PROMPT = "t1 t5 t6 t7 t8"  # bos, then a counting run
IDS = [[1, 5, 6, 7, 8, 9, 10, 11]]  # the input whose logits the engine and the exports compare
CHAT_TOKENS = 4


def chat(trainer) -> dict:
    """A greedy answer to PROMPT through engine.generation.generate.generate, the path the control plane's
    `generate` command takes (collective: every rank calls it; rank 0 streams the pieces)."""
    from engine.generation.generate import generate
    pieces: list[str] = []
    on_text = pieces.append if trainer.env.rank == 0 else None
    (text,) = generate(trainer, [PROMPT], max_new_tokens=CHAT_TOKENS, on_text=on_text)
    return {"step": trainer.state.global_step, "text": text, "pieces": pieces}


def engine_logits(trainer) -> torch.Tensor:
    """The engine's logits on IDS (collective under ZeRO-3 and tp), in eval mode."""
    module = trainer.engine.module
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            return module(input_ids=torch.tensor(IDS)).logits.detach().clone()
    finally:
        module.train(was_training)


def one(work: Path, arch: str) -> dict:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    from engine.model.methods import infer_lora_targets
    folder = work / arch
    write_folder(folder, arch)
    base = AutoModelForCausalLM.from_pretrained(folder / "model")
    targets = infer_lora_targets(base)
    full, full_losses = train(folder, "full", FULL_LR)
    full.close()
    lora, lora_losses = train(folder, "lora", LORA_LR)
    lora.save_peft(str(folder / "adapter"))
    ids = torch.tensor([[1, 5, 6, 7, 8, 9, 10, 11]])
    module = lora.engine.module
    module.eval()
    with torch.no_grad():
        trained = module(input_ids=ids).logits
    lora.close()
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder / "model"), folder / "adapter")
    loaded.eval()
    with torch.no_grad():
        reloaded = loaded(input_ids=ids).logits
    wrapped = sorted({n.rsplit(".", 1)[0].removesuffix(".lora_A").removesuffix(".lora_A.default")
                      for n, _ in loaded.named_modules() if n.endswith("lora_A")})
    events = [json.loads(line) for line in (folder / "runs" / "lora" / "events.jsonl").read_text().splitlines()]
    (setup,) = [e for e in events if e.get("type") == "setup"]
    return {"arch": arch, "targets": targets, "wrapped": wrapped, "full": full_losses, "lora": lora_losses,
            "logged_targets": setup.get("lora_targets"), "loss_average": setup.get("loss_average"),
            "logits_diff": float((trained - reloaded).abs().max()),
            "base_diff": float((trained - base(input_ids=ids).logits).abs().max())}


def main() -> None:
    work, archs = Path(sys.argv[1]), sys.argv[2:]
    for arch in archs:
        try:
            result = one(work, arch)
        except Exception:  # one architecture's failure is its cell's, not the others'
            result = {"arch": arch, "error": traceback.format_exc()[-3000:]}
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    from script_exit import exit_now
    main()
    exit_now()
