"""Pipeline parallelism: the stage split reproduces each Llama-family model exactly (one
process), and pp = 2 on 2 real DeepSpeed ranks trains like one rank, chats with exactly the
one-rank model's tokens, exports one Hugging Face model, loads one back and resumes exactly
(a new Trainer in the same launch, from the run's step-4 checkpoint)."""

import os
import types

import pytest
import torch

from conftest import make_tiny_tokenizer
from dist_utils import free_port
from parallel_runs import (CKPT_STEP, STEPS, assert_close_losses, assert_learns, data_files, hf_logits,
                           losses_of, run_layouts)

pytestmark = pytest.mark.slow  # engine processes: the slow tier

FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "llama-tied": ("LlamaConfig", {"tie_word_embeddings": True}),
    "qwen2": ("Qwen2Config", {}),
    "mistral-sliding": ("MistralConfig", {"sliding_window": 4}),
}


@pytest.fixture(scope="module")
def one_process_group():
    """A one-rank gloo group in this process (reused when another test made one)."""
    import torch.distributed as dist
    if not dist.is_initialized():
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
        import deepspeed
        deepspeed.init_distributed(dist_backend="gloo")
    assert dist.get_world_size() == 1
    os.environ.setdefault("LOCAL_RANK", "0")


def build_pair(family: str, tok):
    """(the Hugging Face model, the same weights as a one-stage HFPipelineModule in a stand-in
    engine exposing what stage_forward and generation use)."""
    import transformers
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    from engine.parallel.pipeline import build_pipeline_module
    cls_name, extra = FAMILIES[family]
    config = getattr(transformers, cls_name)(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **extra)
    torch.manual_seed(0)
    whole = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    torch.manual_seed(0)
    split = build_pipeline_module(transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa"),
                                  topology=PipeDataParallelTopology(num_pp=1, num_dp=1)).eval()
    engine = types.SimpleNamespace(module=split, grid=split._grid, device=torch.device("cpu"))
    return whole, engine


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_stage_layers_reproduce_the_model(one_process_group, family):
    from engine.generation.generate import encode_prompts
    from engine.parallel.pipeline import pipe_inputs, stage_forward
    from engine.generation.pipeline import pipeline_generate

    tok = make_tiny_tokenizer()
    whole, engine = build_pair(family, tok)
    torch.manual_seed(1)
    ids = torch.randint(8, len(tok), (3, 12))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0  # right padding
    padded = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    packed = {"input_ids": ids, "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 0, 0]] * 3),
              "labels": ids}
    with torch.no_grad():
        for batch in (padded, packed):
            want = whole(**batch, use_cache=False)
            inputs, labels = pipe_inputs(batch, "cpu")
            logits = stage_forward(engine, inputs)
            assert torch.equal(logits, want.logits)
            assert torch.equal(engine.module.loss_fn(logits, labels), want.loss)

    prompts = ["reverse: kcodw\n", "ab", "upper: hello world\n"]
    enc = encode_prompts(tok, prompts, "cpu")
    trainer = types.SimpleNamespace(engine=engine, tokenizer=tok)
    for sample in (False, True):
        torch.manual_seed(5)
        with torch.no_grad():
            ref = whole.generate(**enc, max_new_tokens=10, do_sample=sample, top_k=None,
                                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        want = tok.batch_decode(ref[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        got = pipeline_generate(trainer, prompts, max_new_tokens=10, temperature=1.0 if sample else 0.0,
                                seed=5)
        assert got == want
    streamed: list[str] = []
    got = pipeline_generate(trainer, prompts[:1], max_new_tokens=10, on_text=streamed.append)
    assert "".join(streamed) == got[0] and len(streamed) > 1  # piece by piece as tokens arrive


@pytest.mark.parametrize("family", ["llama", "llama-tied"])
def test_the_last_stage_runs_the_head_at_labelled_rows_only(one_process_group, family):
    """The head only at labelled positions on the last stage (and in chunks): the same loss and
    gradients as the head everywhere, the head's rows are the labelled ones."""
    from engine.objectives.losses import Window
    from engine.parallel.pipeline import pipe_inputs, stage_forward

    tok = make_tiny_tokenizer()
    _, engine = build_pair(family, tok)
    module, loss_fn = engine.module.train(), engine.module.loss_fn
    torch.manual_seed(2)
    ids = torch.randint(8, len(tok), (3, 12))
    labels = ids.clone()
    labels[0, :5], labels[1, :3], labels[2, 9:] = -100, -100, -100  # prompts and padding: 24 targets
    inputs, labels = pipe_inputs({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}, "cpu")
    rows: list[int] = []
    head = dict(module.local_parts())["lm_head" if family == "llama" else "model.embed_tokens"]
    hook = (head.lm_head.register_forward_hook(lambda m, i, o: rows.append(o.shape[0])) if family == "llama"
            else None)

    def loss_and_grads(at_labels: bool, chunk_rows: int = 0):
        module.zero_grad()
        loss_fn.window = Window(num_items=30, scale=1.0)
        loss_fn.labelled(at_labels, chunk_rows)
        try:
            loss = loss_fn(stage_forward(engine, inputs), labels)
        finally:
            loss_fn.labelled(False)
        loss.backward()
        return float(loss), {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}

    everywhere, want = loss_and_grads(False)
    for chunk_rows in (0, 5):
        rows.clear()
        got, grads = loss_and_grads(True, chunk_rows)
        assert got == pytest.approx(everywhere, rel=1e-6)
        assert grads.keys() == want.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, want[name], rtol=1e-5, atol=1e-6, msg=name)
        if hook is not None:  # 24 labelled rows: at once, or 5, 5, 5, 5, 4 and again in the backward
            assert rows == ([24] if chunk_rows == 0 else [5, 5, 5, 5, 4, 4, 5, 5, 5, 5])
    if hook is not None:
        hook.remove()


def test_weights_keep_their_hugging_face_names(one_process_group):
    tok = make_tiny_tokenizer()
    for family in ("llama", "llama-tied"):
        whole, engine = build_pair(family, tok)
        names = set(engine.module.hf_state_dict())
        assert names == set(whole.state_dict()) - ({"lm_head.weight"} if family == "llama-tied" else set())
        changed = {k: v + 1 for k, v in whole.state_dict().items()}
        assert engine.module.load_hf_state_dict(changed) == []
        got = engine.module.hf_state_dict()
        assert all(torch.equal(got[k], changed[k]) for k in names)


# -- 2 ranks ------------------------------------------------------------------------------------

# Each 2-rank start costs ~20-60 s (more on a loaded machine): the runs are a module fixture
# paid for by the first test, which gets a longer timeout; the pp run is resumed in its launch.
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pp")
    data = data_files(root / "task")
    cache = str(root / "task" / "cache")
    return {"root": root, **run_layouts("single", root, data, cache=cache),
            **run_layouts("pp", root, data, resume="pp", cache=cache)}


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_pp2_trains_like_one_rank(runs):
    single, pp = runs["single"][0], runs["pp"]
    assert [(r["stage"], r["dp_rank"], r["dp_size"]) for r in pp] == [(0, 0, 1), (1, 0, 1)]
    losses = losses_of(pp[0])
    assert losses_of(pp[1]) == losses  # the last stage's loss, broadcast to every stage
    assert_learns(losses)
    assert_close_losses(losses, losses_of(single))
    assert pp[0]["eval"]["loss"] == pytest.approx(single["eval"]["loss"], rel=2e-3)
    assert pp[0]["parameters"] == pp[1]["parameters"]  # the whole model's count on every stage


@pytest.mark.slow
def test_pp2_chat_gives_the_one_rank_models_tokens(runs):
    for report in runs["pp"]:
        chat = report["chat"]
        assert chat["texts"] == runs["pp"][0]["chat"]["texts"]  # every stage returns the answer
        assert chat["streamed"] == chat["first"]
    chat = runs["pp"][0]["chat"]
    assert chat["texts"] == chat["reference"]           # greedy, the gathered weights on one rank
    assert chat["sampled"] == chat["reference_sampled"]  # sampled with the same seed
    assert len(set(chat["sampled"])) > 1 and all(chat["sampled"])


@pytest.mark.slow
def test_pp2_saves_and_loads_one_hugging_face_model(runs):
    out = runs["root"] / "pp"
    logits, engine_logits = hf_logits(out / "model", out / "engine_logits.pt")
    assert torch.equal(logits, engine_logits)
    logits, engine_logits = hf_logits(out / "model", out / "engine_logits_loaded.pt", scale=0.5)
    assert torch.allclose(logits, engine_logits, atol=1e-6)
    assert runs["pp"][0]["loaded_round_trip"]["round_trip"] is True
    for report in runs["pp"]:  # a folder lacking a tensor: refused on every rank, nothing loaded
        assert "missing from the folder: model.norm.weight" in report["loaded_round_trip"]["refused"]


@pytest.mark.slow
def test_pp2_resumes_exactly(runs):
    resumed = runs["pp-resumed"][0]["losses"]
    full = losses_of(runs["pp"][0])
    assert sorted(map(int, resumed)) == list(range(CKPT_STEP + 1, STEPS + 1))
    assert [resumed[str(s)] for s in range(CKPT_STEP + 1, STEPS + 1)] == full[CKPT_STEP:]
