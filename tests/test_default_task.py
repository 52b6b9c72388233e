"""The embedded default task: data, tokenizer, model folder and the exact-match metric."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from engine.data import default_task as dt
from contract import presets

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dt.DefaultAssets:
    return dt.ensure_default_assets(tmp_path_factory.mktemp("default") / "default-v1")


@pytest.fixture(scope="module")
def tokenizer(assets):
    return AutoTokenizer.from_pretrained(assets.model_dir)


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# -- data ---------------------------------------------------------------------------------------

def test_examples_are_deterministic_and_well_formed():
    rows = dt.make_examples(300, seed=7)
    assert rows == dt.make_examples(300, seed=7)
    assert rows != dt.make_examples(300, seed=8)
    assert dt.make_examples(100, seed=7) == rows[:100]  # a prefix: more rows never reshuffle
    assert len({r["input"] for r in rows}) == len(rows)
    for row in rows:
        op, word = row["input"][:-1].split(": ")
        assert row["input"].endswith(dt.SEPARATOR) and dt.MIN_WORD <= len(word) <= dt.MAX_WORD
        assert row["output"] == dt.OPERATIONS[op](word)
    assert {r["input"].split(":")[0] for r in rows} == set(dt.OPERATIONS)
    assert dt.make_row("reverse", "abcd") == {"input": "reverse: abcd\n", "output": "dcba"}
    assert dt.make_row("sort", "dbca")["output"] == "abcd"
    assert dt.make_row("upper", "abc")["output"] == "ABC"


def test_train_and_eval_never_overlap():
    train = {r["input"] for seed in (0, 1) for r in dt.make_examples(4000, seed, "train")}
    held_out = {r["input"] for seed in (0, 1) for r in dt.make_examples(400, seed, "eval")}
    assert len(held_out) > 400 and not train & held_out
    assert all(dt.split_of(p) == "eval" for p in held_out)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="split"):
        dt.make_examples(3, 0, "test")
    with pytest.raises(ValueError, match="operations"):
        dt.make_examples(3, 0, operations=["rot13"])
    with pytest.raises(ValueError, match="operation"):
        dt.make_row("shout", "abc")


# -- assets -------------------------------------------------------------------------------------

def test_assets_files_and_splits(assets):
    train, held_out = _read_jsonl(assets.train_path), _read_jsonl(assets.eval_path)
    assert len(train) == dt.N_TRAIN and len(held_out) == dt.N_EVAL
    assert train == dt.make_examples(dt.N_TRAIN, dt.ASSETS_SEED, "train")
    assert not {r["input"] for r in train} & {r["input"] for r in held_out}
    assert not list(assets.model_dir.glob("*.safetensors")) and not list(assets.model_dir.glob("*.bin"))


def test_assets_are_idempotent_and_deterministic(assets, tmp_path):
    before = {p: p.stat().st_mtime_ns for p in assets.model_dir.parent.rglob("*")}
    assert dt.ensure_default_assets(assets.model_dir.parent) == assets
    assert {p: p.stat().st_mtime_ns for p in assets.model_dir.parent.rglob("*")} == before
    # A fresh process builds the same bytes (nothing depends on hash seeds or the clock).
    other = tmp_path / "again"
    code = "import sys; from pathlib import Path; from engine.data import default_task as dt; " \
           "dt.ensure_default_assets(Path(sys.argv[1]))"
    env = {**os.environ, "PYTHONHASHSEED": "123", "HF_HUB_OFFLINE": "1"}
    subprocess.run([sys.executable, "-c", code, str(other)], check=True, cwd=REPO, env=env)
    assert _files(other) == _files(assets.model_dir.parent)


def _build(root: str, barrier) -> None:
    barrier.wait()  # both processes start writing at the same moment
    dt.ensure_default_assets(Path(root))


def test_concurrent_callers_get_one_complete_folder(tmp_path):
    root = tmp_path / "cache" / "default-v1"
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_build, args=(str(root), barrier)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    assert (root / "assets.json").exists() and (root / "model" / "tokenizer.json").exists()
    assert [p.name for p in root.parent.iterdir()] == ["default-v1"]  # no temp folder left


def test_a_foreign_folder_is_not_overwritten(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="assets.json"):
        dt.ensure_default_assets(tmp_path)
    assert (tmp_path / "keep.txt").read_text() == "mine"


def test_default_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("LIVETUNE_CACHE", str(tmp_path))
    assert dt.default_root() == tmp_path / "default-v1"
    monkeypatch.delenv("LIVETUNE_CACHE")
    assert dt.default_root() == Path.home() / ".cache" / "livetune" / "default-v1"


def test_model_folder_loads_in_transformers(assets, tokenizer):
    config = AutoConfig.from_pretrained(assets.model_dir)
    assert config.model_type == "llama" and config.vocab_size == len(tokenizer)
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == \
        (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    batch = tokenizer(["reverse: abc\n", "upper: hello\n"], return_tensors="pt", padding=True)
    logits = model(**batch).logits
    assert logits.shape == (2, batch["input_ids"].shape[1], len(tokenizer))
    assert set(presets.RECOMMENDED) == {"lr", "micro_batch_size", "max_steps", "warmup_steps",
                                   "max_length", "eval_every_n_steps", "batching"}
    longest = max(len(tokenizer(r["input"] + r["output"])["input_ids"]) + 1
                  for r in _read_jsonl(assets.train_path))
    assert longest <= presets.RECOMMENDED["max_length"]  # no default sample is ever truncated


# -- tokenizer ----------------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["reverse: abcd\n", "Hello, World!  two  spaces\nnext line",
                                  " leading and trailing ", "{json: [1, 2.5]} ~`|\\"])
def test_decode_gives_the_text_back(tokenizer, text):
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and len(ids) == len(text) + 1  # one id per character
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.decode(ids) == dt.BOS + text


def test_unknown_characters_become_unk(tokenizer):
    ids = tokenizer("a\u00e9b", add_special_tokens=False)["input_ids"]
    assert ids[1] == tokenizer.unk_token_id and len(ids) == 3


def test_chat_template_matches_training_prompts(tokenizer):
    row = dt.make_row("reverse", "abcd")
    user = [{"role": "user", "content": "reverse: abcd"}]
    prompt = tokenizer.apply_chat_template(user, add_generation_prompt=True, return_dict=True)
    assert prompt["input_ids"] == tokenizer(row["input"])["input_ids"]
    chat = user + [{"role": "assistant", "content": "dcba"},
                   {"role": "user", "content": "upper: ab"}]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == "<s>reverse: abcd\ndcba</s><s>upper: ab\n"
    enc = tokenizer.apply_chat_template(chat[:2], return_dict=True, return_assistant_tokens_mask=True)
    answer = [i for i, m in zip(enc["input_ids"], enc["assistant_masks"]) if m]
    assert tokenizer.decode(answer) == "dcba" + dt.EOS
    assert tokenizer.decode(enc["input_ids"], skip_special_tokens=True) == "reverse: abcd\ndcba"


# -- exact match --------------------------------------------------------------------------------

def _tiny_model(tokenizer, **overrides):
    torch.manual_seed(0)
    config = dt.default_model_config(len(tokenizer), hidden=64, intermediate=128, **overrides)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _greedy(model, tokenizer, prompt: str, max_new: int) -> str:
    """Reference decoding: one unpadded prompt, argmax token by token, no generate()."""
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    out: list[int] = []
    with torch.no_grad():
        for _ in range(max_new):
            nxt = int(model(input_ids=ids).logits[0, -1].argmax())
            if nxt == tokenizer.eos_token_id:
                break
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return tokenizer.decode(out)


def test_exact_match_against_a_reference_decoder(tokenizer):
    # Large init: well-separated logits, so padding's rounding cannot flip an argmax.
    model = _tiny_model(tokenizer, initializer_range=0.5).eval()
    prompts = [r["input"] for r in dt.make_examples(10, seed=5, split="eval")]  # mixed lengths
    answers = [_greedy(model, tokenizer, p, max_new=6) for p in prompts]
    right = [{"input": p, "output": f"  {a} "} for p, a in zip(prompts, answers)]
    wrong = [{"input": p, "output": a + "x"} for p, a in zip(prompts, answers)]
    assert dt.exact_match(model, tokenizer, right, batch_size=4, max_new_tokens=6) == 1.0
    assert dt.exact_match(model, tokenizer, wrong, batch_size=4, max_new_tokens=6) == 0.0
    mixed = right[:3] + wrong[3:]
    assert dt.exact_match(model, tokenizer, mixed, batch_size=8, max_new_tokens=6) == pytest.approx(0.3)
    with pytest.raises(ValueError, match="at least one row"):
        dt.exact_match(model, tokenizer, [])


@pytest.mark.slow
def test_exact_match_rises_with_training(tokenizer):
    rows = dt.make_examples(8, seed=11)
    model = _tiny_model(tokenizer)
    assert dt.exact_match(model, tokenizer, rows) == 0.0
    prompts = tokenizer([r["input"] for r in rows])["input_ids"]
    answers = tokenizer([r["output"] for r in rows], add_special_tokens=False)["input_ids"]
    seqs = [p + a + [tokenizer.eos_token_id] for p, a in zip(prompts, answers)]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [tokenizer.pad_token_id] * (width - len(s)) for s in seqs])
    labels = torch.tensor([[-100] * len(p) + s[len(p):] + [-100] * (width - len(s))
                           for p, s in zip(prompts, seqs)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(60):  # memorize the eight rows: seconds on a CPU
        loss = model(input_ids=ids, attention_mask=(ids != tokenizer.pad_token_id).long(),
                     labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert model.training  # exact_match leaves the mode as it found it
    assert dt.exact_match(model, tokenizer, rows, batch_size=3) == 1.0
