"""LoRA under ZeRO-3 on 2 ranks: the saved adapter (a non-default name, in its own sub-folder)
loads with `PeftModel.from_pretrained` and gives the engine's logits; the merged export gives
the logits of base + adapter; the adapter loads back into the engine; an unknown adapter name is
an error listing the adapters there are."""

from __future__ import annotations

import json

import pytest
import torch

from dist_utils import SCRIPTS, parse_results, run_deepspeed


@pytest.mark.slow
def test_adapter_and_merged_exports(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    proc = run_deepspeed(SCRIPTS / "ckpt_peft.py", nproc=2, args=("--out", str(tmp_path)), timeout=900)
    results = sorted(parse_results(proc), key=lambda r: r["rank"])
    assert len(results) == 2
    for r in results:
        assert r["unknown"] == "no adapter named 'nope'; this model has: mine"
        assert r["nothing_written"]
        assert r["wiped"] > 1e-3 and r["back"] == 0.0  # load_peft restored the wiped adapter
    adapter = tmp_path / "adapter" / "mine"  # PEFT's layout: a non-default adapter in its sub-folder
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 4
    reference = torch.load(tmp_path / "reference.pt")
    ids = reference["ids"]

    def logits(model):
        with torch.no_grad():
            return model.eval()(input_ids=ids).logits

    base_logits = logits(AutoModelForCausalLM.from_pretrained(str(tmp_path / "base")))
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tmp_path / "base")),
                                           str(adapter), adapter_name="mine")
    with_adapter = logits(peft_model)
    assert (with_adapter - reference["logits"]).abs().max().item() < 1e-5  # the engine's own output
    assert (with_adapter - base_logits).abs().max().item() > 1e-3  # the adapter did learn something
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
    assert not any("lora" in k for k in merged.state_dict())  # a plain model
    assert (logits(merged) - with_adapter).abs().max().item() < 1e-4
