"""GGUF export (engine.checkpoint.gguf through `python -m engine.checkpoint export --format gguf`),
checked by the libraries that read GGUF: transformers (`from_pretrained(..., gguf_file=)`, logits
against the model the file came from) and llama.cpp itself (llama-cpp-python, greedy tokens
against transformers' greedy tokens).

The models are tiny Llama, Qwen2 and Mistral folders written here with save_pretrained, on a
SentencePiece tokenizer trained here (byte fallback, so any text is representable): GGUF holds a
SentencePiece or BPE tokenizer, and the converter reads `tokenizer.model` for both architectures.
"""

from __future__ import annotations

import io
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("gguf")

from engine.checkpoint import gguf  # noqa: E402

PROMPTS = [[1, 279, 284, 273], [1, 200, 5, 77, 91]]
ARCHS = ["llama", "qwen2", "mistral"]

needs_converter = pytest.mark.skipif(not (gguf.converter_dir() / "convert_hf_to_gguf.py").is_file(),
                                     reason="llama.cpp's converter is installed by the set-up "
                                            "(python -m engine.checkpoint.gguf install)")


def _sentencepiece(folder: Path) -> None:
    import sentencepiece as spm
    from transformers import AutoTokenizer
    rng = random.Random(0)
    words = ["hello", "world", "reverse", "twice", "the", "cat", "sat", "on", "mat", "answer"]
    lines = [" ".join(rng.choice(words) for _ in range(8)) for _ in range(500)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, vocab_size=300,
                                   model_type="bpe", byte_fallback=True, character_coverage=1.0, bos_id=1,
                                   eos_id=2, unk_id=0, pad_id=-1, num_threads=1, minloglevel=2)
    folder.mkdir(parents=True)
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant:{% endif %}"}))
    AutoTokenizer.from_pretrained(str(folder)).save_pretrained(str(folder))


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    from transformers import (AutoTokenizer, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                              Qwen2Config, Qwen2ForCausalLM)
    root = tmp_path_factory.mktemp("gguf")
    _sentencepiece(root / "tok")
    tok = AutoTokenizer.from_pretrained(str(root / "tok"))
    common = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1,
                  eos_token_id=2, tie_word_embeddings=False)
    kinds = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
             "mistral": (MistralConfig, MistralForCausalLM)}
    out = {}
    for name, (config, cls) in kinds.items():
        torch.manual_seed(0)
        folder = root / name
        cls(config(**common)).save_pretrained(str(folder))
        tok.save_pretrained(str(folder))
        shutil.copy(root / "tok" / "tokenizer.model", folder / "tokenizer.model")
        out[name] = folder
    return out


pytestmark = pytest.mark.slow  # nine conversions, each llama.cpp's converter in a process of its own


def _export_cli(src: Path, dst: Path, dtype: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine.checkpoint", "export", str(src), str(dst), "--format",
                           "gguf", "--dtype", dtype], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def exported(models, tmp_path_factory) -> dict[tuple[str, str], Path]:
    if not (gguf.converter_dir() / "convert_hf_to_gguf.py").is_file():
        pytest.skip("llama.cpp's converter is not installed (python -m engine.checkpoint.gguf install)")
    from engine.checkpoint.export import export
    root = tmp_path_factory.mktemp("gguf-out")
    out = {}
    for arch in ARCHS:
        for dtype in ("f32", "f16", "q8_0"):
            dst = root / f"{arch}-{dtype}"
            said = export(str(models[arch]), str(dst), fmt="gguf", dtype=dtype, say=lambda _: None)
            assert "as GGUF" in said
            out[arch, dtype] = dst
    return out


@needs_converter
@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_reads_the_gguf_with_the_logits_of_its_source(models, exported, arch):
    from transformers import AutoModelForCausalLM
    source = AutoModelForCausalLM.from_pretrained(str(models[arch]), dtype=torch.float32).eval()
    ids = torch.tensor([PROMPTS[1]])
    want = source(ids).logits
    for dtype, bound in (("f32", 0.0), ("f16", 1e-3), ("q8_0", 1e-2)):
        folder = exported[arch, dtype]
        loaded = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=gguf.GGUF_FILE,
                                                      dtype=torch.float32).eval()
        diff = (loaded(ids).logits - want).abs().max().item()
        assert diff <= bound, f"{arch} {dtype}: max abs logit difference {diff} > {bound}"


@needs_converter
@pytest.mark.parametrize("arch", ARCHS)
def test_llama_cpp_generates_the_greedy_tokens_of_transformers(models, exported, arch, monkeypatch):
    pytest.importorskip("llama_cpp")
    from transformers import AutoModelForCausalLM
    source = AutoModelForCausalLM.from_pretrained(str(models[arch]), dtype=torch.float32).eval()
    for dtype in ("f32", "f16"):
        assert_llama_cpp_greedy(exported[arch, dtype] / gguf.GGUF_FILE, source, monkeypatch, f"{arch} {dtype}")


def assert_llama_cpp_greedy(path: Path, source, monkeypatch, label: str) -> None:
    """llama.cpp, loading the GGUF at `path`, generates transformers' greedy tokens of `source`
    for each of PROMPTS (8 tokens)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    # No weight repacking into AVX-512/AMX buffers: a q8_0 model crashed (signal 11) there on such
    # a CPU. The set-up's build is a portable one (GGML_NATIVE=OFF, AVX2) for the same reason;
    # llama_cpp.Llama has no argument for it, so its model parameters are given the flag.
    defaults = llama_cpp.llama_cpp.llama_model_default_params

    def without_repacking():
        params = defaults()
        params.use_extra_bufts = False
        return params
    monkeypatch.setattr(llama_cpp.llama_cpp, "llama_model_default_params", without_repacking)
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, verbose=False, seed=0, n_threads=1)
    for prompt in PROMPTS:
        want = source.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        got = []
        for token in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            got.append(token)
            if len(got) == len(want):
                break
        assert got == want, f"{label} prompt {prompt}: llama.cpp {got} vs transformers {want}"


@needs_converter
def test_the_folder_holds_an_ollama_modelfile(exported):
    text = (exported["llama", "f16"] / gguf.MODELFILE).read_text()
    assert text.startswith(f"FROM ./{gguf.GGUF_FILE}\n")
    assert 'TEMPLATE """{{ if .System }}system: {{ .System }}\nuser: {{ else }}user: {{ end }}{{ .Prompt }}\nassistant:"""' in text
    assert 'PARAMETER stop "</s>"' in text
    marker = json.loads((exported["llama", "f16"] / "COMPLETE.json").read_text())
    assert marker["kind"] == "gguf" and set(marker["files"]) >= {gguf.GGUF_FILE, gguf.MODELFILE}


@needs_converter
def test_refused_before_any_work(models, tmp_path):
    odd = tmp_path / "odd"
    shutil.copytree(models["llama"], odd)
    config = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**config, "architectures": ["NoSuchForCausalLM"]}))
    done = _export_cli(odd, tmp_path / "out", "f16")  # the terminal's words and exit code
    assert done.returncode == 2 and "does not know the architecture NoSuchForCausalLM" in done.stderr
    assert not (tmp_path / "out").exists()
    # the web app's Export GGUF button runs that command and shows its error line
    from app.web.backend.store import export as web_export
    with pytest.raises(RuntimeError, match="^llama.cpp's converter does not know the architecture NoSuchForCausalLM"):
        web_export(str(odd), str(tmp_path / "out"), gguf="q8_0")
    from engine.checkpoint.export import ExportError, export
    with pytest.raises(ExportError, match="dtype: 'q4_k' is not one of f32, f16, bf16, q8_0"):
        export(str(models["llama"]), str(tmp_path / "out2"), fmt="gguf", dtype="q4_k")
    # the embedded default's character tokenizer (WordLevel) cannot be held by a GGUF
    from engine.data import default_task
    assets = default_task.ensure_default_assets(tmp_path / "default")
    word = tmp_path / "word"
    shutil.copytree(models["llama"], word)
    for name in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json"):
        (word / name).unlink(missing_ok=True)
    for f in Path(assets.model_dir).glob("tokenizer*"):
        shutil.copy(f, word / f.name)
    with pytest.raises(gguf.GGUFError, match="is a WordLevel model; a GGUF holds a SentencePiece or a BPE"):
        export(str(word), str(tmp_path / "out3"), fmt="gguf", dtype="f16")
    assert not (tmp_path / "out3").exists()


@needs_converter
def test_a_lora_runs_checkpoint_as_gguf_is_the_merged_export(models, tmp_path):
    """A LoRA run's training checkpoint exported as GGUF (merged into the base first) loads in
    transformers with the logits of the same checkpoint's merged Hugging Face export, exactly
    (f32); and the adapter made a difference (the base's logits differ). The run and both exports
    in this process (the Trainer the worker builds, the function the export command calls; the
    command's own words are test_refused_before_any_work's): what is tested is the checkpoint's
    merge into the GGUF, not a launch."""
    from transformers import AutoModelForCausalLM
    from contract.args import resolve_args
    from engine.checkpoint.export import export
    from engine.trainer import Trainer
    cfg = resolve_args([  # the configuration `train` of the terminal resolves from these words
        "nproc=1", "max_steps=2", "batch_size=4", "method=lora", "precision=fp32", "lr=0.05",
        f"model.path={models['llama']}", "checkpoint.every_n_steps=2", "eval.every_n_steps=0", "eval.at_end=false",
        f"output_dir={tmp_path}", "run_name=lora", "logging.progress_bar=false", "logging.tensorboard=false",
        "control.enabled=false"]).config
    with Trainer(config=cfg) as trainer:
        trainer.train()
    checkpoint = tmp_path / "lora" / "checkpoints" / "step-2"
    said = export(str(checkpoint), str(tmp_path / "gguf"), fmt="gguf", dtype="f32", say=lambda _: None)
    assert "LoRA merged into the base weights" in said and "as GGUF" in said
    export(str(checkpoint), str(tmp_path / "merged"), merge_lora=True, say=lambda _: None)
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32)(ids).logits
        got = AutoModelForCausalLM.from_pretrained(str(tmp_path / "gguf"), gguf_file=gguf.GGUF_FILE,
                                                   dtype=torch.float32)(ids).logits
        base = AutoModelForCausalLM.from_pretrained(str(models["llama"]), dtype=torch.float32)(ids).logits
    assert torch.equal(got, want)
    assert (got - base).abs().max() > 1e-4  # the adapter is in the file
