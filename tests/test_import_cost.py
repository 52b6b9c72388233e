"""What a plain run imports: a full fine-tuning run's ranks never import peft or bitsandbytes.

peft imports bitsandbytes (whose import runs torch.compile: dynamo and inductor) and
transformers' bloom model: ~4 s of every rank's start-up, and every test that launches a run
pays it once per rank. The engine imports them only inside the functions that need them (PEFT
methods, adapter files, quantized models), and builds its learning-rate schedules itself
(engine.assembly.schedule) because `transformers.get_scheduler`'s module imports peft; here the
import graph is checked in a fresh interpreter, and the schedules against transformers' own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
HEAVY = ("peft", "bitsandbytes")

# What a rank of a full fine-tuning run imports and asks before its first step: the trainer and
# its assembly, a model built from a config, prepared by the run's method (which refuses a PEFT
# model: the question must not import peft), an optimizer with the run's schedule.
_PLAIN_RUN = """
import sys
import torch
import engine.worker, engine.trainer
from contract.config.load import load_config
from contract.presets import DEFAULT
from engine.assembly.schedule import lr_schedule
from engine.model.methods import method_of
from transformers import AutoModelForCausalLM, LlamaConfig
model = AutoModelForCausalLM.from_config(LlamaConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=2))
cfg = load_config(data=DEFAULT, overrides=["method=full"])
model = method_of(cfg).prepare_model(model, cfg)
lr_schedule("cosine", torch.optim.AdamW(model.parameters()), 2, 10).step()
print("loaded:" + ",".join(m for m in %r if m in sys.modules))
"""


def test_a_plain_run_imports_neither_peft_nor_bitsandbytes():
    out = subprocess.run([sys.executable, "-c", _PLAIN_RUN % (HEAVY,)], cwd=REPO, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    loaded = [ln for ln in out.stdout.splitlines() if ln.startswith("loaded:")]
    assert loaded == ["loaded:"], f"a plain run imported {loaded} (make that import lazy, inside its function)"


@pytest.mark.parametrize("name,hf_name", [("constant", "constant_with_warmup"), ("linear", "linear"),
                                          ("cosine", "cosine")])
@pytest.mark.parametrize("warmup,total", [(0, 1), (0, 7), (3, 7), (5, 5), (10, 37), (1, 1000)])
def test_the_schedules_are_transformers_own(name, hf_name, warmup, total):
    """Every step's factor equals transformers.get_scheduler's, exactly (and past the end)."""
    import torch
    from transformers import get_scheduler
    from engine.assembly.schedule import lr_schedule

    def rates(make) -> list[float]:
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.37)
        sched = make(opt)
        out = []
        for _ in range(total + 3):
            out.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return out

    ours = rates(lambda opt: lr_schedule(name, opt, warmup, total))
    theirs = rates(lambda opt: get_scheduler(hf_name, opt, num_warmup_steps=warmup, num_training_steps=total))
    assert ours == theirs


def test_an_unknown_schedule_is_named():
    import torch
    from engine.assembly.schedule import lr_schedule
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ValueError, match="optim.scheduler.*constant, linear, cosine"):
        lr_schedule("step", opt, 0, 10)
