"""LOMO / AdaLomo: the fused update against a plain-PyTorch reference (one rank and two, ZeRO 0
and 3, through our Trainer), fp16 overflow skipping and recovery, clipping passes, memory held,
and the config checks."""

import math

import pytest
import torch

from dist_utils import SCRIPTS, parse_results, run_deepspeed
from contract.config.schema import ConfigError
from contract.config.load import load_config
from engine.lomo import AdaLomoRule, DynamicLossScaler, FusedOptimizer, LomoRule, scaler_from_ds_config


def tiny_model(dtype=torch.float32, seed=0):
    from transformers import AutoModelForCausalLM, LlamaConfig
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=dtype)


def batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 64, (4, 12), generator=g)
    return {"input_ids": x, "labels": x}


def snapshot(model):
    return [p.detach().clone() for p in model.parameters()]


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


# -- config ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["lomo", "adalomo"])
def test_config_rejects_pipeline_and_accumulation_naming_fields(method):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=[f"method={method}", "nproc=2", "pp=2", "train.grad_accum=4"])
    fields = [k for k, _ in e.value.problems]
    assert "method.name" in fields and "train.grad_accum" in fields
    message = str(e.value)
    assert "pipeline" in message and "parallel.pp_size" in message and "grad_accum 1" in message
    with pytest.raises(ConfigError, match="parallel.offload_optimizer"):
        load_config(overrides=[f"method={method}", "zero_stage=2", "parallel.offload_optimizer=true"])
    with pytest.raises(ConfigError, match="parallel.deepspeed"):
        load_config(data={"method": {"name": method},
                          "parallel": {"deepspeed": {"optimizer": {"type": "AdamW"}}}})
    load_config(overrides=[f"method={method}", "zero_stage=3", "nproc=2"])  # fine


# -- fp16 loss scaling -------------------------------------------------------------------------------

def test_fp16_overflow_skips_the_step_and_the_scale_grows_back():
    model = tiny_model(torch.float16)
    scaler = DynamicLossScaler(scale=2.0**24, growth_interval=3)
    opt = FusedOptimizer(model.parameters(), LomoRule(), lr=1e-2, max_grad_norm=1.0, scaler=scaler)
    b = batch()
    scales, skipped, losses = [], [], []
    for _ in range(14):
        before = snapshot(model)
        losses.append(float(opt.fused_step(lambda: model(**b).loss)))
        skipped.append(opt.last_skipped)
        scales.append(scaler.scale)
        assert same(before, snapshot(model)) == opt.last_skipped  # skipped <=> nothing changed
        assert all(p.grad is None for p in model.parameters())
    assert skipped[0] and not all(skipped), skipped           # 2**24 overflows fp16 gradients
    first_ok = skipped.index(False)
    assert scales[first_ok] < 2.0**24                            # the scale came down ...
    assert max(scales[first_ok:]) > scales[first_ok]             # ... and grew back after 3 clean steps
    assert skipped[first_ok + 3:].count(True) >= 1               # growing too far overflows again, and
    assert losses[-1] < losses[0]                                # training goes on regardless
    assert scaler.overflows == sum(skipped) == opt.skipped_steps


class _InfGrad(torch.autograd.Function):
    """Identity forward; an inf gradient backward (a poisoned parameter)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return torch.full_like(grad, math.inf)


@pytest.mark.parametrize("rule", [LomoRule(), AdaLomoRule()], ids=["lomo", "adalomo"])
def test_an_inf_gradient_skips_the_step_everywhere(rule):
    model = tiny_model()
    opt = FusedOptimizer(model.parameters(), rule, lr=1e-2, max_grad_norm=1.0)
    b = batch()
    last = model.model.layers[-1].mlp.down_proj.weight  # its gradient comes early in backward
    poisoned = lambda: model(**b).loss + (_InfGrad.apply(last) * 0).sum()  # noqa: E731
    opt.fused_step(lambda: model(**b).loss)
    before, states = snapshot(model), {id(p): dict(s) for p, s in opt.state.items()}
    opt.fused_step(poisoned)
    assert opt.last_skipped and opt.skipped_steps == 1 and math.isinf(opt.last_grad_norm)
    assert same(before, snapshot(model))
    assert all(opt.state[p]["step"] == states[id(p)]["step"] for p in opt.state)  # AdaLomo's t stays
    opt.fused_step(lambda: model(**b).loss)
    assert not opt.last_skipped and not same(before, snapshot(model))


def test_scaler_follows_deepspeed_fp16_section():
    assert scaler_from_ds_config({"bf16": {"enabled": True}}) is None
    s = scaler_from_ds_config({"fp16": {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 50,
                                        "min_loss_scale": 4}})
    assert (s.scale, s.growth_interval, s.min_scale, s.dynamic) == (2.0**12, 50, 4.0, True)
    static = scaler_from_ds_config({"fp16": {"enabled": True, "loss_scale": 128}})
    static.update(overflow=True)
    assert static.scale == 128 and not static.dynamic
    s.update(overflow=True)
    s.update(overflow=True)
    assert s.scale == 2.0**10
    for _ in range(50):
        s.update(overflow=False)
    assert s.scale == 2.0**11


# -- passes and memory ---------------------------------------------------------------------------

@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_one_forward_and_one_or_two_backwards_without_zero3(clip):
    model = tiny_model()
    opt = FusedOptimizer(model.parameters(), LomoRule(), lr=1e-2, max_grad_norm=clip)
    forwards = []
    b = batch()

    def forward():
        forwards.append(1)
        return model(**b).loss

    seen = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: seen.append(1))
    before = snapshot(model)
    opt.fused_step(forward)
    assert not same(before, snapshot(model))      # the one pass did update the weights
    n = sum(1 for _ in model.parameters())
    assert len(forwards) == 1                      # the update pass reuses the retained graph
    assert len(seen) == n * (2 if clip else 1)     # measuring is a second backward, only with clipping
    assert (opt.last_grad_norm is not None) == bool(clip)


def test_adalomo_keeps_only_factored_moments():
    model = tiny_model()
    opt = FusedOptimizer(model.parameters(), AdaLomoRule(), lr=1e-2, max_grad_norm=1.0)
    b = batch()
    opt.fused_step(lambda: model(**b).loss)
    for p in model.parameters():
        state = {k: v for k, v in opt.state[p].items() if torch.is_tensor(v)}
        expected = sum(p.shape) if p.dim() == 2 else p.numel()  # a row and a column per matrix
        assert sum(t.numel() for t in state.values()) == expected
        assert p.grad is None
    saved = opt.state_dict()
    assert saved["state"] and saved["loss_scaler"] is None


def test_step_outside_a_fused_step_leaves_gradients_alone():
    model = tiny_model()
    FusedOptimizer(model.parameters(), LomoRule(), lr=1e-2)
    before = snapshot(model)
    model(**batch()).loss.backward()
    assert same(before, snapshot(model))
    assert all(p.grad is not None for p in model.parameters())


# -- through the Trainer on real DeepSpeed engines -----------------------------------------------

def _check(nproc: int, out, extra=()) -> dict[int, list[dict]]:
    """Both stages (0 and 3) and both methods on `nproc` ranks in one launch (a start costs more
    than the steps): each its own Trainer and engine, one after the other; results by stage."""
    proc = run_deepspeed(SCRIPTS / "fused_check.py", nproc=nproc,
                         args=("--zero", "0", "3", "--nproc", str(nproc), "--out", str(out), *extra),
                         timeout=1500)
    results = parse_results(proc)
    by_stage = {z: [r for r in results if r["zero"] == z] for z in (0, 3)}
    for stage in by_stage.values():
        assert sorted({r["method"] for r in stage}) == ["adalomo", "lomo"]
        assert len(stage) == 2 * nproc
    return by_stage


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> dict[int, list[dict]]:
    return _check(1, tmp_path_factory.mktemp("fused1"))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict[int, list[dict]]:
    return _check(2, tmp_path_factory.mktemp("fused2"), extra=("--set-lr-at", "6", "--steps", "16"))


def _assert_matches_reference(r):
    # the fused update equals the reference step for step: every loss, and the final weights
    assert r["losses"] == pytest.approx(r["ref_losses"], abs=2e-5), r["method"]
    assert r["weight_diff"] < 1e-5 * max(1.0, r["weight_moved"]) and r["weight_moved"] > 1e-3, r
    assert r["grads_left"] == 0 and r["skipped"] == 0
    if r["method"] == "lomo":
        assert r["state_numel"] == 0
    else:
        assert 0 < r["state_numel"] < 0.05 * r["params_numel"]  # factored moments only


def _assert_cosine_schedule(lrs, peak, warmup=2):
    from transformers import get_scheduler
    dummy = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=peak)
    sched = get_scheduler("cosine", dummy, num_warmup_steps=warmup, num_training_steps=len(lrs))
    expected = []
    for _ in lrs:
        expected.append(dummy.param_groups[0]["lr"])
        dummy.step()
        sched.step()
    assert lrs == pytest.approx(expected, rel=1e-9, abs=1e-12)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("zero", [0, 3])
def test_fused_step_matches_reference_on_one_rank(one_rank, zero):
    for r in one_rank[zero]:
        _assert_matches_reference(r)
        _assert_cosine_schedule(r["lrs"], 5e-2 if r["method"] == "lomo" else 1e-2)
        assert r["engine_optimizer"] == ("DeepSpeedZeRoOffload" if zero == 3 else "NoneType")


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("zero", [0, 3])
def test_fused_step_on_two_ranks_averages_and_learns(two_ranks, zero):
    results = two_ranks[zero]
    for method in ("lomo", "adalomo"):
        r0, r1 = sorted((r for r in results if r["method"] == method), key=lambda r: r["rank"])
        assert r0["losses"] == r1["losses"] and r0["digest"] == r1["digest"]  # one model, not two
        _assert_matches_reference(r0)  # the reference averages both ranks' gradients
        losses = r0["losses"]
        assert sum(losses[-4:]) / 4 < 0.95 * sum(losses[:4]) / 4, losses
        # set_lr at step 6: the next rate is the one asked for, and the schedule goes on scaled
        assert r0["lrs"][6] == pytest.approx(r0["asked_lr"])
        assert r0["lrs"][7] < r0["lrs"][6]


@pytest.mark.parametrize("name", ["lomo", "adalomo"])
def test_a_live_grad_clip_change_reaches_the_fused_update(name):
    """`set grad_clip` goes through the method object: for LOMO / AdaLomo it changes the fused
    optimizer's own clipping (DeepSpeed's is unused), so the next update is the one an optimizer
    built with the new value makes, and differs from the old value's."""
    from types import SimpleNamespace

    from engine.model.methods import FusedMethod

    def one_step(built_with: float, set_to: float | None):
        model = tiny_model()
        model.train()
        opt = FusedOptimizer(model.parameters(), AdaLomoRule() if name == "adalomo" else LomoRule(), lr=5e-2,
                             max_grad_norm=built_with)
        if set_to is not None:
            run, method = SimpleNamespace(optimizer=opt, engine=None), FusedMethod(name)
            method.set_grad_clip(run, set_to)
            assert method.grad_clip(run) == set_to
        b = batch(1)
        opt.fused_step(lambda: model(**b).loss)
        return snapshot(model)

    changed, built, unchanged = one_step(1.0, 0.01), one_step(0.01, None), one_step(1.0, None)
    assert same(changed, built)
    assert not same(changed, unchanged)  # the value matters at all for this batch


@pytest.mark.parametrize("rule", [LomoRule(), AdaLomoRule()], ids=["lomo", "adalomo"])
def test_gradient_checkpointing_gives_the_same_update(rule):
    results, initial = [], None
    for checkpointing in (False, True):
        model = tiny_model()
        initial = snapshot(model)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        opt = FusedOptimizer(model.parameters(), rule, lr=1e-2, max_grad_norm=0.5)
        for seed in (1, 2):
            b = batch(seed)
            opt.fused_step(lambda: model(**b, use_cache=False).loss)
        results.append(snapshot(model))
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*results))
    moved = max(float((a - b).abs().max()) for a, b in zip(results[1], initial))
    assert moved > 1e-4, moved  # the same update, and a real one
