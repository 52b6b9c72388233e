"""Shared fixtures: a tiny tokenizer trained here with `tokenizers`, and file writers."""

from __future__ import annotations

import json
import os
import string
import sys
from pathlib import Path

import pytest

# DeepSpeed's CPU communication op is compiled into TORCH_EXTENSIONS_DIR: the venv's own folder,
# as launch.sh sets it (a test started without launch.sh must not share ~/.cache/torch_extensions
# with other venvs); every engine the tests launch inherits it.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))

SPECIAL = ["<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]

# ChatML-like, without {% generation %} marks: each turn is "<|role|>\n{content}<|end|>\n".
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def make_tiny_tokenizer(chat_template: str = CHAT_TEMPLATE):
    """A character-level fast tokenizer (one token per character; bos in front of every text)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    trainer = trainers.WordLevelTrainer(special_tokens=SPECIAL, min_frequency=1)
    tok.train_from_iterator([string.printable], trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B:1", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        unk_token="<unk>", additional_special_tokens=SPECIAL[4:], chat_template=chat_template,
        clean_up_tokenization_spaces=False, padding_side="right")


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """Session-wide tiny tokenizer; copy it (copy.deepcopy) before changing it."""
    return make_tiny_tokenizer()


@pytest.fixture
def tmp_jsonl(tmp_path: Path):
    """Factory: tmp_jsonl(rows, name="data.jsonl") writes one JSON value per line, returns the path."""
    def write(rows: list, name: str = "data.jsonl") -> Path:
        path = tmp_path / name
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        return path
    return write


@pytest.fixture(autouse=True)
def _remove_deepspeed_shm_buffers():
    """DeepSpeed's CPU all-reduce maps a 66 MB /dev/shm file per rank; the engine unlinks its
    own once every rank has mapped them, but a run killed before that leaves them behind, and over
    a whole suite that fills memory. After each test, the ones no process maps any more are
    removed (never one a run in another test worker is still setting up)."""
    yield
    left = list(Path("/dev/shm").glob("deepspeed_allreduce_buffer_*"))
    if not left:
        return
    import time
    mapped, now = _mapped_shm_names(), time.time()
    for path in left:
        try:  # a minute old: not one being written by a rank that has yet to map it
            if path.name not in mapped and now - path.stat().st_mtime > 60:
                path.unlink()
        except OSError:
            pass


def _mapped_shm_names() -> set[str]:
    names = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:
            continue
        if "deepspeed_allreduce_buffer_" in text:
            names |= {line.rsplit("/", 1)[-1].split(" ")[0] for line in text.splitlines()
                      if "/dev/shm/deepspeed_allreduce_buffer_" in line}
    return names


def save_tiny_llama(folder) -> None:
    """The preference and serving tests' model, saved with save_pretrained into `folder`: a Llama
    of 2 layers, hidden 32, 4 heads (2 key-value), 64 positions, on the character tokenizer,
    weights drawn with seed 0 (the same model in every test that asks)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    tok = make_tiny_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=64, pad_token_id=tok.pad_token_id,
                                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id))
    model.save_pretrained(folder)
    tok.save_pretrained(folder)


def pytest_collection_modifyitems(config, items):
    """The costliest files first (tests/file_costs.py says why): the two workers end together."""
    from file_costs import costliest_first  # tests/ is on sys.path (rootdir conftest)
    costliest_first(items)
