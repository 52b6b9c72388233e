"""Tensor parallelism (DeepSpeed AutoTP): layouts refused before a run starts, with the reason;
tp = 2 on 2 real DeepSpeed ranks trains like one rank (ZeRO 0 and 2), chats with exactly the
one-rank model's tokens, exports one Hugging Face model, loads one back and resumes exactly (a
new Trainer in the same launch); a live tp run and a live pp run answer chat through the
control plane."""

import json

import pytest
import torch

from supervisor.client import RunClient
from control_runs import launch, logs_of, states, task_files, wait_exit, wait_for_step
from contract.config.schema import ConfigError
from contract.config.load import load_config
from contract.deepspeed_config import DeepSpeedConfigError, build_ds_config
from parallel_runs import (CKPT_STEP, STEPS, assert_close_losses, assert_learns, data_files, hf_logits,
                           losses_of, run_layouts)


def model_folder(tmp_path, **config) -> str:
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    base = {"model_type": "llama", "num_attention_heads": 6, "num_key_value_heads": 2,
            "num_hidden_layers": 2, "hidden_size": 96}
    (folder / "config.json").write_text(json.dumps({**base, **config}))
    return str(folder)


def problems_of(*overrides: str) -> dict[str, str]:
    with pytest.raises(ConfigError) as err:
        load_config(overrides=list(overrides))
    return dict(err.value.problems)


def test_layouts_that_cannot_run_are_refused_with_the_reason(tmp_path):
    odd_heads = model_folder(tmp_path)  # 6 heads, 2 key/value heads
    got = problems_of(f"model={odd_heads}", "nproc=4", "tp=4")
    assert "must divide the model's attention heads (6) and key/value heads (2)" in got["parallel.tp_size"]
    assert "cannot be combined" in problems_of("nproc=4", "tp=2", "pp=2")["parallel.pp_size"]
    assert "PEFT adapter" in problems_of("nproc=2", "tp=2", "method=lora")["method.name"]
    assert "PEFT adapter" in problems_of("nproc=2", "pp=2", "method=prompt_tuning")["method.name"]
    assert "AutoTP" in problems_of("nproc=2", "tp=2", "method=lomo")["method.name"]
    assert "ZeRO 0, 1 and 2" in problems_of("nproc=2", "tp=2", "zero_stage=3")["parallel.tp_size"]
    assert "ZeRO 0 and 1" in problems_of("nproc=2", "pp=2", "zero_stage=2")["parallel.pp_size"]
    assert "at least 4 decoder layers" in problems_of(f"model={odd_heads}", "nproc=4", "pp=4")["parallel.pp_size"]
    # what can run passes: 6 heads / 2 kv heads split 2 ways; the default model (4 heads) 2 ways
    load_config(overrides=[f"model={odd_heads}", "nproc=4", "tp=2", "zero_stage=2"])
    load_config(overrides=["nproc=4", "pp=2", "zero_stage=1"])
    gpt2 = model_folder(tmp_path, model_type="gpt2")  # the same folder, rewritten: checked last
    assert "'gpt2'" in problems_of(f"model={gpt2}", "nproc=2", "pp=2")["parallel.pp_size"]


def test_deepspeed_keeps_the_vocabulary_whole():
    cfg = load_config(overrides=["nproc=2", "tp=2"])
    built = build_ds_config(cfg, world_size=2, dp_size=1, total_steps=10, warmup_steps=0,
                            hidden_size=128, precision="fp32").config
    assert built["tensor_parallel"] == {"autotp_size": 2, "vocab_parallel_lm_head": False}
    assert built["train_batch_size"] == cfg.train.micro_batch_size  # sized by dp (1), not the world
    cfg = load_config(overrides=["nproc=2", "tp=2"],
                      data={"parallel": {"deepspeed": {"tensor_parallel": {"vocab_parallel_lm_head": True}}}})
    with pytest.raises(DeepSpeedConfigError, match="whole-vocabulary logits"):
        build_ds_config(cfg, world_size=2, dp_size=1, total_steps=10, warmup_steps=0,
                        hidden_size=128, precision="fp32")


# -- 2 ranks ------------------------------------------------------------------------------------

# Each start costs ~20-60 s (more on a loaded machine): the runs are module fixtures, each paid
# for by the first test that needs it, and those tests get a longer timeout. The 2-rank layouts
# share one launch (dp 2 first: a tensor-parallel engine leaves DeepSpeed's model-parallel groups
# behind), the tp run resumed in it; the 4-rank layouts share another.
@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    return {"root": root, "data": data_files(root / "task"), "cache": str(root / "task" / "cache")}


def _run(task, layouts, resume=""):
    return run_layouts(layouts, task["root"], task["data"], resume=resume, cache=task["cache"])


@pytest.fixture(scope="module")
def runs(task):
    return {"root": task["root"], **_run(task, "single"), **_run(task, "dp2,tp,tp_zero2", resume="tp")}


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_tp2_trains_like_one_rank_under_zero_0_and_2(runs):
    single = losses_of(runs["single"][0])
    for layout, ranks in (("tp", runs["tp"]), ("tp_zero2", runs["tp_zero2"])):
        assert [(r["tp_rank"], r["dp_rank"], r["dp_size"]) for r in ranks] == [(0, 0, 1), (1, 0, 1)]
        losses = losses_of(ranks[0])
        assert losses_of(ranks[1]) == losses
        assert_learns(losses)
        assert_close_losses(losses, single)
        assert ranks[0]["eval"]["loss"] == pytest.approx(runs["single"][0]["eval"]["loss"], rel=2e-3)


@pytest.mark.slow
def test_tp2_chat_gives_the_one_rank_models_tokens(runs):
    for ranks in (runs["tp"], runs["tp_zero2"]):
        chat = ranks[0]["chat"]
        assert ranks[1]["chat"]["texts"] == chat["texts"]  # every rank generated the same
        assert chat["texts"] == chat["reference"]
        assert chat["sampled"] == chat["reference_sampled"]
        assert len(set(chat["sampled"])) > 1 and all(chat["sampled"])
        assert chat["streamed"] == chat["first"]


@pytest.mark.slow
def test_tp2_saves_and_loads_one_hugging_face_model(runs):
    out = runs["root"] / "tp"
    logits, engine_logits = hf_logits(out / "model", out / "engine_logits.pt")
    assert torch.allclose(logits, engine_logits, atol=1e-5)  # the shards' matmuls sum in another order
    logits, engine_logits = hf_logits(out / "model", out / "engine_logits_loaded.pt", scale=0.5)
    assert torch.allclose(logits, engine_logits, atol=1e-5)
    assert runs["tp"][0]["loaded_round_trip"]["round_trip"] is True
    for report in runs["tp"]:  # a folder lacking a tensor: refused on every rank, nothing loaded
        assert "missing from the folder: model.norm.weight" in report["loaded_round_trip"]["refused"]


@pytest.mark.slow
def test_tp2_resumes_exactly(runs):
    full, resumed = losses_of(runs["tp"][0]), runs["tp-resumed"][0]["losses"]
    assert sorted(map(int, resumed)) == list(range(CKPT_STEP + 1, STEPS + 1))
    assert [resumed[str(s)] for s in range(CKPT_STEP + 1, STEPS + 1)] == full[CKPT_STEP:]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_dp_times_tp_and_dp_times_pp_on_4_ranks(runs, task):
    """4 ranks on 2 cores (a start ~30 s here): dp 2 x tp 2 and dp 2 x pp 2 (one launch) against dp 2."""
    want, four = runs["dp2"], _run(task, "dp2_tp2,dp2_pp2")
    for layout in ("dp2_tp2", "dp2_pp2"):
        ranks = four[layout]
        coords = [(r["dp_rank"], r["tp_rank"], r["stage"]) for r in ranks]
        if layout == "dp2_tp2":  # tensor ranks adjacent: [0, 1] [2, 3]
            assert coords == [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]
        else:  # DeepSpeed's pipe x data topology: rank = stage * dp + data rank
            assert coords == [(0, 0, 0), (1, 0, 0), (0, 0, 1), (1, 0, 1)]
        assert all(r["dp_size"] == 2 for r in ranks)
        losses = losses_of(ranks[0])
        assert all(losses_of(r) == losses for r in ranks)
        assert_close_losses(losses, losses_of(want[0]))
        chat = ranks[0]["chat"]
        assert chat["texts"] == chat["reference"] and chat["sampled"] == chat["reference_sampled"]


# -- the control plane ---------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("layout", ["tp=2", "pp=2"])
def test_live_run_chats_through_the_control_plane(tmp_path, layout):
    task = task_files(tmp_path / "task")
    run = launch(tmp_path, layout.replace("=", ""), task, layout, "max_steps=100000",  # stopped by the test
                 "optim.scheduler=constant")
    client = RunClient.connect(run.folder.root, timeout=300)
    try:
        wait_for_step(run, 2, timeout=300)
        paused = client.pause().step
        pieces = list(chat := client.generate("reverse: kcodw\n", max_new_tokens=8))
        answer = chat.wait()
        again = client.generate("reverse: kcodw\n", max_new_tokens=8).wait()
        sampled = [client.generate("sort: abc\n", max_new_tokens=8, temperature=1.0, seed=3).wait()
                   for _ in range(2)]
        assert answer.step == again.step == paused  # paused: the same weights answer
        assert "".join(pieces) == answer.text == again.text
        assert sampled[0].text == sampled[1].text  # every rank drew the same tokens
        client.resume()
        wait_for_step(run, paused + 2, timeout=300)
        client.stop(save=False)
        assert wait_exit(run, timeout=300) == 0, logs_of(run)
        assert "paused" in states(run) and states(run)[-1] == "finished"
    finally:
        client.close()
