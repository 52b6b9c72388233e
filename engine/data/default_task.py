r"""The embedded default: a synthetic instruction task, its tokenizer and a tiny Llama config.

A new user presses Start without choosing anything and trains this. It has to learn visibly and
fast on a laptop CPU, so everything here is small and generated locally (no hub downloads):

Task. Instructions over short random lowercase words, one of three operations::

    reverse: kcodw\n  ->  wdock
    sort: kcodw\n     ->  cdkow
    upper: kcodw\n    ->  KCODW

``input`` is the prompt text with its separator (the trailing newline), ``output`` the answer.
Words are 3..8 letters. Rows are generated from a seed; which split a prompt belongs to is a pure
function of the prompt text (a hash), so train and held-out rows can never overlap whatever seeds
or sizes are asked for.

Tokenizer. Character level (one token per character: printable ASCII plus newline, so anything a
user types in the chat is representable), built and trained with `tokenizers`, wrapped as a
`PreTrainedTokenizerFast`. It adds ``<s>`` in front of every encoded text (the Llama convention);
the data layer appends ``</s>`` after an answer. The chat template renders each user turn as
``<s>{content}\n`` and each assistant turn as ``{content}</s>`` (inside ``{% generation %}`` so
``return_assistant_tokens_mask`` works), so a one-turn chat prompt tokenizes exactly like a
training ``input``. The model is trained on single turns: in the chat it answers the last
instruction best when the history is short.

Model. A 2-layer Llama (see :func:`default_model_config`), built from the config with the run's
seed (the model folder holds no weights).

Figures (bench/bench_default.py, the real run on 2 CPU cores, one rank, bf16, 2026-12-03): held-out
exact match 0.42 after 25 s of training, 0.91 after 55 s (step 700), 0.98 after 74 s (step 1000,
the preset's end). Length-grouped batches hold one instruction each and learn about 4x slower
than random batches (bench/explore_default.py --batching), so the default trains with random
batching.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import string
import tempfile
from dataclasses import dataclass
from pathlib import Path

from engine.data.file_lock import held
from contract.presets import MODEL_SIZE, RECOMMENDED  # measured values and the model size live in the contract
from typing import Callable, Iterable, Sequence

ASSETS_VERSION = "default-v1"
SEPARATOR = "\n"
BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]  # pad = id 0

OPERATIONS: dict[str, Callable[[str], str]] = {
    "reverse": lambda w: w[::-1],
    "sort": lambda w: "".join(sorted(w)),
    "upper": str.upper,
}
MIN_WORD, MAX_WORD = 3, 8
EVAL_FRACTION = 0.02  # share of all possible prompts reserved for the held-out split
N_TRAIN, N_EVAL = 50_000, 256

# The recommended training hyperparameters (RECOMMENDED) live in contract/presets.py; measured
# with bench/explore_default.py, see the module docstring.

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}"
    "{% else %}{{ bos_token }}{{ message['content'] }}{{ '\\n' }}{% endif %}"
    "{% endfor %}"
)


# -- the task -----------------------------------------------------------------------------------

def split_of(prompt: str) -> str:
    """'eval' or 'train': a stable hash of the prompt decides, so the splits never overlap."""
    digest = hashlib.sha256(prompt.encode()).digest()
    return "eval" if int.from_bytes(digest[:8], "big") / 2**64 < EVAL_FRACTION else "train"


def make_row(operation: str, word: str) -> dict:
    """One example: {"input": "<op>: <word>\\n", "output": <answer>}."""
    if operation not in OPERATIONS:
        raise ValueError(f"operation must be one of {sorted(OPERATIONS)}, not {operation!r}")
    return {"input": f"{operation}: {word}{SEPARATOR}", "output": OPERATIONS[operation](word)}


def make_examples(n: int, seed: int, split: str = "train",
                  operations: Sequence[str] | None = None) -> list[dict]:
    """`n` distinct rows of `split` ('train' or 'eval'), the same for the same arguments.

    `operations` restricts the instructions (default: all of OPERATIONS), for experiments.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', not {split!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0, not {n}")
    ops = sorted(operations) if operations is not None else sorted(OPERATIONS)
    unknown = set(ops) - set(OPERATIONS)
    if unknown or not ops:
        raise ValueError(f"operations must be a non-empty subset of {sorted(OPERATIONS)}, "
                         f"not {list(operations or [])}")
    rng = random.Random(f"{ASSETS_VERSION}/{seed}/{split}")
    rows: list[dict] = []
    seen: set[str] = set()
    while len(rows) < n:
        word = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(MIN_WORD, MAX_WORD)))
        row = make_row(rng.choice(ops), word)
        if row["input"] not in seen and split_of(row["input"]) == split:
            seen.add(row["input"])
            rows.append(row)
    return rows


# -- tokenizer ----------------------------------------------------------------------------------

def alphabet() -> list[str]:
    """Every character the tokenizer knows: printable ASCII without the odd whitespace, plus \\n."""
    return sorted(set(string.printable) - set("\t\r\x0b\x0c"))


def build_tokenizer(texts: Iterable[str]):
    """A character-level `PreTrainedTokenizerFast` trained with `tokenizers` on `texts`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token=UNK))
    # Each character is its own piece; Fuse joins them back without inserting spaces.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    trainer = trainers.WordLevelTrainer(special_tokens=SPECIAL_TOKENS, min_frequency=1)
    # The alphabet goes in as a text of its own so characters the task never uses still get ids.
    tok.train_from_iterator([*texts, "".join(alphabet())], trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B:1", special_tokens=[(BOS, bos_id)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
        chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False, model_max_length=256,
        padding_side="right")


# -- model --------------------------------------------------------------------------------------

# the default model's size lives in the contract (the layout checks need it without torch)


def default_model_config(vocab_size: int, hidden: int = MODEL_SIZE["hidden"],
                         layers: int = MODEL_SIZE["layers"], heads: int = MODEL_SIZE["heads"],
                         intermediate: int = MODEL_SIZE["intermediate"], **overrides):
    """The tiny Llama the default task trains (bos/eos/pad ids follow SPECIAL_TOKENS)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=256, rope_theta=10000.0, tie_word_embeddings=True,
        pad_token_id=SPECIAL_TOKENS.index(PAD), bos_token_id=SPECIAL_TOKENS.index(BOS),
        eos_token_id=SPECIAL_TOKENS.index(EOS), torch_dtype="bfloat16", **overrides)


# -- assets on disk -----------------------------------------------------------------------------

ASSETS_SEED = 0  # the data is the same for everyone; the run's seed only drives init and order


@dataclass(frozen=True)
class DefaultAssets:
    """Where the default task lives on disk."""

    model_dir: Path  # config.json + tokenizer files, no weights
    train_path: Path  # JSON lines of {"input", "output"}
    eval_path: Path  # the held-out split, same format

    @classmethod
    def at(cls, root: Path) -> "DefaultAssets":
        root = Path(root)
        return cls(model_dir=root / "model", train_path=root / "train.jsonl",
                   eval_path=root / "eval.jsonl")


def cache_base() -> Path:
    """The livetune cache folder: $LIVETUNE_CACHE, else ~/.cache/livetune (the default assets,
    the tokenized datasets of engine.data.cache)."""
    cache = os.environ.get("LIVETUNE_CACHE")
    return Path(cache).expanduser() if cache else Path.home() / ".cache" / "livetune"


def default_root() -> Path:
    """Folder of the default assets: $LIVETUNE_CACHE/default-v1, else ~/.cache/livetune/default-v1."""
    return cache_base() / ASSETS_VERSION


def ensure_default_assets(root: Path | None = None) -> DefaultAssets:
    """Write the default model folder and data under `root` once; return where they are.

    Idempotent and safe under concurrency: one process builds while the others (the run's other
    ranks) wait on a lock beside `root`, then find the assets there; they are built in a
    temporary sibling folder and renamed into place in one step, so a reader sees either nothing
    or the complete set. The content depends on nothing but this module, so a process that builds
    them unlocked (no lock to be had) writes the same bytes.
    """
    root = Path(root) if root is not None else default_root()
    marker = root / "assets.json"
    if marker.exists():
        return DefaultAssets.at(root)
    with held(root.parent / f".{root.name}.lock"):  # the other ranks wait, then find them built
        if not marker.exists():
            _build_assets(root)
    return DefaultAssets.at(root)


def _build_assets(root: Path) -> None:
    marker = root / "assets.json"
    if root.exists() and any(root.iterdir()):
        raise FileExistsError(f"default assets folder {root} holds other files and no "
                              "assets.json; remove it or point LIVETUNE_CACHE elsewhere")
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.tmp-", dir=root.parent))
    try:
        _write_assets(tmp)
        try:
            os.replace(tmp, root)  # atomic; replaces an empty folder, fails on a full one
        except OSError:
            if not marker.exists():  # not a lost race with another process: a real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_assets(folder: Path) -> None:
    assets = DefaultAssets.at(folder)
    train = make_examples(N_TRAIN, ASSETS_SEED, "train")
    held_out = make_examples(N_EVAL, ASSETS_SEED, "eval")
    _write_jsonl(assets.train_path, train)
    _write_jsonl(assets.eval_path, held_out)
    tokenizer = build_tokenizer(r["input"] + r["output"] for r in train)
    tokenizer.save_pretrained(assets.model_dir)
    default_model_config(len(tokenizer)).save_pretrained(assets.model_dir)
    info = {"version": ASSETS_VERSION, "seed": ASSETS_SEED, "train_rows": len(train),
            "eval_rows": len(held_out), "operations": sorted(OPERATIONS),
            "recommended": RECOMMENDED}
    (folder / "assets.json").write_text(json.dumps(info, indent=2) + "\n")


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


# -- evaluation ---------------------------------------------------------------------------------

def exact_match(model, tokenizer, rows: list[dict], batch_size: int = 32,
                max_new_tokens: int | None = None) -> float:
    """Fraction of `rows` whose greedy answer equals row["output"] (both stripped).

    Plain Hugging Face generation on this rank's model: prompts left-padded, only the new tokens
    decoded, each answer cut at the first eos. `max_new_tokens` defaults to the longest expected
    answer plus one (room for the eos).
    """
    import torch

    if not rows:
        raise ValueError("exact_match needs at least one row")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, not {batch_size}")
    if max_new_tokens is None:
        answers = tokenizer([r["output"] for r in rows], add_special_tokens=False)["input_ids"]
        max_new_tokens = max(len(ids) for ids in answers) + 1
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    correct = 0
    try:
        for start in range(0, len(rows), batch_size):
            batch = rows[start:start + batch_size]
            enc = tokenizer([r["input"] for r in batch], return_tensors="pt", padding=True,
                            padding_side="left").to(device)
            with torch.no_grad():
                out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                     eos_token_id=tokenizer.eos_token_id,
                                     pad_token_id=tokenizer.pad_token_id)
            for row, ids in zip(batch, out[:, enc["input_ids"].shape[1]:].tolist()):
                if tokenizer.eos_token_id in ids:
                    ids = ids[:ids.index(tokenizer.eos_token_id)]
                correct += tokenizer.decode(ids).strip() == row["output"].strip()
    finally:
        model.train(was_training)
    return correct / len(rows)


# -- the preference variant ---------------------------------------------------------------------

# A plausible wrong answer for each instruction: what a model that half-learnt the task says.
WRONG: dict[str, Callable[[str], str]] = {
    "reverse": lambda w: w,                      # echoes the word
    "sort": lambda w: w[::-1],                   # reverses instead of sorting
    "upper": lambda w: w[:1].upper() + w[1:],    # capitalises the first letter only
}


def wrong_answer(operation: str, word: str) -> str:
    """A plausible wrong answer to `operation` on `word`, never the right one."""
    right, wrong = OPERATIONS[operation](word), WRONG[operation](word)
    return wrong if wrong != right else right[1:] + right[:1] if len(set(right)) > 1 else right + right[-1]


def preference_row(row: dict) -> dict:
    """{"prompt", "chosen", "rejected"} of a default-task row: the right answer over a wrong one."""
    operation, word = row["input"].rstrip(SEPARATOR).split(": ", 1)
    return {"prompt": row["input"], "chosen": row["output"], "rejected": wrong_answer(operation, word)}


def prompt_row(row: dict) -> dict:
    """{"prompt", "answer"} of a default-task row: GRPO samples answers, an exact-match reward
    against `answer` scores them."""
    return {"prompt": row["input"], "answer": row["output"]}


def unpaired_rows(row: dict) -> list[dict]:
    """Two KTO rows of a default-task row: the right answer (desirable) and a wrong one."""
    pair = preference_row(row)
    return [{"prompt": pair["prompt"], "completion": pair["chosen"], "label": True},
            {"prompt": pair["prompt"], "completion": pair["rejected"], "label": False}]


def sources_for(assets: DefaultAssets, objective: str) -> tuple[Path, Path]:
    """(train, held-out) files of the default task for `objective` (preference.objective): the
    instruction rows for sft, their pairs for dpo / orpo / simpo, unpaired rows for kto, prompts
    with their answer for grpo. The
    derived files are written next to the assets once (atomically, the same bytes everywhere)."""
    if objective == "sft":
        return assets.train_path, assets.eval_path
    kind = {"kto": "unpaired", "grpo": "prompt"}.get(objective, "preference")
    derive: Callable[[dict], list[dict]] = {"unpaired": unpaired_rows, "prompt": lambda r: [prompt_row(r)]}.get(
        kind, lambda r: [preference_row(r)])
    out = []
    for source in (assets.train_path, assets.eval_path):
        target = source.with_name(f"{source.stem}.{kind}.jsonl")
        if not target.exists():
            rows = [json.loads(line) for line in source.read_text(encoding="utf-8").splitlines() if line]
            tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
            _write_jsonl(tmp, [d for r in rows for d in derive(r)])
            os.replace(tmp, target)
        out.append(target)
    return out[0], out[1]
