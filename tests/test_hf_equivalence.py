"""Our Trainer against the reference implementation, the Hugging Face Trainer: same model
weights, data, order and DeepSpeed config give the same per-step losses."""

import json

import pytest

from dist_utils import SCRIPTS, default_precision, parse_results, run_deepspeed


def write_inputs(tmp_path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from engine.data.default_task import ensure_default_assets
    assets = ensure_default_assets(tmp_path / "assets")
    from engine.model.loading import load_tokenizer
    tok = load_tokenizer(assets.model_dir)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=64, pad_token_id=tok.pad_token_id,
                                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id))
    model.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    rows = [json.loads(line) for line in assets.train_path.read_text().splitlines()[:400]]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.slow
@pytest.mark.parametrize("zero, precision", [(2, "default"), (3, "fp32")])
def test_losses_match_hf_trainer(tmp_path, zero, precision):
    # "default": what a user gets (bf16 where the CPU has it natively, else fp32)
    precision = default_precision() if precision == "default" else precision
    write_inputs(tmp_path)
    proc = run_deepspeed(SCRIPTS / "hf_equivalence.py", nproc=1,
                         args=("--work", str(tmp_path), "--zero", str(zero), "--precision", precision),
                         timeout=600)
    (result,) = parse_results(proc)
    ours, hf = result["ours"], result["hf"]
    assert len(ours) == len(hf) == 24
    assert ours == pytest.approx(hf, rel=2e-3, abs=2e-3), list(zip(ours, hf))
    assert ours[-1] < ours[0] * 0.9  # and it is really training
