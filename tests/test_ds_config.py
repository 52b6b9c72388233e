"""The DeepSpeed config layer: "auto" filling, every mismatch named at once, bucket sizes,
optimizer/scheduler ownership, precision on this machine, and real 2-rank engines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dist_utils import SCRIPTS, parse_results, run_deepspeed
from contract.config.schema import ConfigError
from contract.config.load import load_config
from contract.deepspeed_config import (DeepSpeedConfigError, DsConfig, NO_LOG_STEPS, build_ds_config,
                                       inference_config)
from engine.parallel.ds_config import resolve_precision, transformers_zero3, zero3_init

HIDDEN = 64


def build(user: dict | None = None, *overrides: str, dp_size: int = 2, total: int = 50, warmup: int = 5,
          hidden: int | None = HIDDEN, precision: str = "fp32"):
    cfg = load_config(overrides=["nproc=2", *overrides], data={"parallel": {"deepspeed": user or {}}})
    return build_ds_config(cfg, world_size=cfg.world_size, dp_size=dp_size, total_steps=total,
                           warmup_steps=warmup, hidden_size=hidden, precision=precision)


def problems(user: dict, *overrides: str, **kw) -> dict[str, str]:
    with pytest.raises(DeepSpeedConfigError) as err:
        build(user, *overrides, **kw)
    assert isinstance(err.value, ConfigError)
    return dict(err.value.problems)


# -- the dotted-key wrapper ---------------------------------------------------------------------

def test_dotted_queries():
    ds = DsConfig({"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}})
    assert ds.get("zero_optimization.stage") == 3 and ds.get("optimizer.params.lr", 7) == 7
    assert ds.is_auto("zero_optimization.reduce_bucket_size") and not ds.is_auto("zero_optimization.stage")
    assert ds.has("zero_optimization.stage") and not ds.has("bf16.enabled")
    ds.fill("zero_optimization.reduce_bucket_size", 100)
    ds.fill("bf16.enabled", True)  # absent: set, parents created
    ds.fill("zero_optimization.stage", 2, "parallel.zero_stage")  # explicit and different: a problem
    assert ds.config == {"zero_optimization": {"stage": 3, "reduce_bucket_size": 100}, "bf16": {"enabled": True}}
    assert ds.problems == [("parallel.deepspeed.zero_optimization.stage",
                            'deepspeed.zero_optimization.stage is 3 but parallel.zero_stage is 2; '
                            'set it to "auto" or make them equal')]
    ds.delete("bf16.enabled")
    assert ds.config["bf16"] == {}


# -- "auto" filling, key by key -----------------------------------------------------------------

RUN = ["zero_stage=3", "parallel.offload_optimizer=true", "parallel.offload_param=true", "batch_size=4",
       "train.grad_accum=2", "optim.grad_clip=0.5", "lr=3e-4", "optim.betas=[0.9, 0.95]", "optim.eps=1e-6",
       "optim.weight_decay=0.1", "optim.scheduler=linear"]
ALL_AUTO = {
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto", "gradient_clipping": "auto",
    "optimizer": {"type": "auto", "params": {k: "auto" for k in ("lr", "betas", "eps", "weight_decay")}},
    "scheduler": {"type": "auto", "params": {k: "auto" for k in ("warmup_min_lr", "warmup_max_lr",
                                                                 "warmup_num_steps", "total_num_steps")}},
    "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
    "zero_optimization": {"stage": "auto", "offload_optimizer": {"device": "auto"},
                          "offload_param": "auto", "reduce_bucket_size": "auto",
                          "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto"},
}
FILLED = [
    ("train_micro_batch_size_per_gpu", 4), ("gradient_accumulation_steps", 2),
    ("train_batch_size", 2 * 4 * 2), ("gradient_clipping", 0.5),
    ("optimizer.type", "AdamW"), ("optimizer.params.lr", 3e-4), ("optimizer.params.betas", [0.9, 0.95]),
    ("optimizer.params.eps", 1e-6), ("optimizer.params.weight_decay", 0.1),
    ("scheduler.type", "WarmupDecayLR"), ("scheduler.params.warmup_min_lr", 0.0),
    ("scheduler.params.warmup_max_lr", 3e-4), ("scheduler.params.warmup_num_steps", 5),
    ("scheduler.params.total_num_steps", 50), ("scheduler.params.warmup_type", "linear"),
    ("bf16.enabled", True), ("fp16.enabled", False),
    ("zero_optimization.stage", 3), ("zero_optimization.offload_optimizer.device", "cpu"),
    ("zero_optimization.offload_param.device", "cpu"),
    ("zero_optimization.reduce_bucket_size", HIDDEN * HIDDEN),
    ("zero_optimization.stage3_prefetch_bucket_size", int(0.9 * HIDDEN * HIDDEN)),
    ("zero_optimization.stage3_param_persistence_threshold", 10 * HIDDEN),
]


@pytest.fixture(scope="module")
def auto_filled() -> dict:
    return build(ALL_AUTO, *RUN, precision="bf16").config


@pytest.mark.parametrize("key,expected", FILLED, ids=[k for k, _ in FILLED])
def test_auto_key_is_filled(auto_filled, key, expected):
    assert DsConfig(auto_filled).get(key) == pytest.approx(expected)


@pytest.mark.parametrize("key,expected", FILLED, ids=[k for k, _ in FILLED])
def test_absent_key_is_filled_too(key, expected):
    """No DeepSpeed config at all still gives the same values (sections the trainer owns aside)."""
    user = {"optimizer": {}, "scheduler": {}} if key.startswith(("optimizer", "scheduler")) else {}
    assert DsConfig(build(user, *RUN, precision="bf16").config).get(key) == pytest.approx(expected)


def test_no_auto_left_and_deepspeed_parses_it():
    from deepspeed.runtime.config import DeepSpeedConfig
    setup = build(ALL_AUTO, *RUN, dp_size=1, precision="bf16")
    assert "auto" not in json.dumps(setup.config)
    parsed = DeepSpeedConfig(setup.config)  # DeepSpeed's own reading of it (one rank: dp 1)
    assert (parsed.train_batch_size, parsed.zero_config.stage, parsed.bfloat16_config.enabled) == (8, 3, True)
    assert parsed.zero_config.prefetch_bucket_size == int(0.9 * HIDDEN * HIDDEN)
    assert parsed.gradient_clipping == 0.5 and parsed.steps_per_print == NO_LOG_STEPS


def test_empty_config_is_complete():
    config = build({}, "zero_stage=2", precision="bf16").config
    assert config == {
        "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "train_batch_size": 16,
        "gradient_clipping": 1.0, "bf16": {"enabled": True}, "fp16": {"enabled": False},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": HIDDEN * HIDDEN},
        "zero_allow_untested_optimizer": True, "steps_per_print": NO_LOG_STEPS, "wall_clock_breakdown": False}


def test_explicit_matching_and_other_keys_are_kept():
    user = {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 1, "steps_per_print": 10,
            "wall_clock_breakdown": True, "zero_optimization": {"stage": 1, "reduce_bucket_size": 123},
            "pipeline": {"activation_checkpoint_interval": 1}, "bfloat16": {"enabled": False}}
    config = build(user, "zero_stage=1").config
    assert config["steps_per_print"] == 10 and config["wall_clock_breakdown"] is True
    assert config["zero_optimization"] == {"stage": 1, "reduce_bucket_size": 123}
    assert config["pipeline"] == {"activation_checkpoint_interval": 1}
    assert config["bf16"] == {"enabled": False} and "bfloat16" not in config  # DeepSpeed's alias, folded


@pytest.mark.parametrize("scheduler,ds_type,params", [
    ("constant", "WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 5,
                              "warmup_type": "linear"}),
    ("cosine", "WarmupCosineLR", {"total_num_steps": 50, "warmup_min_ratio": 0.0, "warmup_num_steps": 5,
                                  "cos_min_ratio": 0.0, "warmup_type": "linear"}),
])
def test_auto_scheduler_type_follows_the_run(scheduler, ds_type, params):
    config = build({"scheduler": {"type": "auto"}}, f"optim.scheduler={scheduler}").config
    assert config["scheduler"] == {"type": ds_type, "params": params}


def test_no_warmup_asks_deepspeed_for_one_step():
    config = build({"scheduler": {"type": "WarmupLR"}}, warmup=0).config
    assert config["scheduler"]["params"]["warmup_num_steps"] == 1  # deepspeed >= 0.19.6 rejects 0


def test_sgd_gets_only_the_params_it_takes():
    config = build({"optimizer": {"type": "auto"}, "scheduler": {"type": "auto"}}, "optim.name=sgd").config
    assert config["optimizer"] == {"type": "SGD", "params": {"lr": 1e-3, "weight_decay": 0.0}}


def test_tensor_parallel_size():
    assert build({}, "tp=2", "zero_stage=1").config["tensor_parallel"]["autotp_size"] == 2
    assert "tensor_parallel" not in build({}).config
    assert build({"tensor_parallel": {"autotp_size": "auto"}}, "tp=2").config["tensor_parallel"]["autotp_size"] == 2


# -- mismatches ---------------------------------------------------------------------------------

MISMATCHES = [
    ({"train_micro_batch_size_per_gpu": 4}, [], "train_micro_batch_size_per_gpu",
     'deepspeed.train_micro_batch_size_per_gpu is 4 but train.micro_batch_size is 8; '
     'set it to "auto" or make them equal'),
    ({"gradient_accumulation_steps": 4}, ["train.grad_accum=2"], "gradient_accumulation_steps",
     "deepspeed.gradient_accumulation_steps is 4 but train.grad_accum is 2"),
    ({"train_batch_size": 64}, [], "train_batch_size",
     "deepspeed.train_batch_size is 64 but data-parallel size 2 x train.micro_batch_size 8 x "
     "train.grad_accum 1 is 16"),
    ({"gradient_clipping": 0.3}, [], "gradient_clipping",
     "deepspeed.gradient_clipping is 0.3 but optim.grad_clip is 1.0"),
    ({"bf16": {"enabled": True}}, ["precision=fp32"], "bf16.enabled",
     "deepspeed.bf16.enabled is true but train.precision is fp32"),
    ({"fp16": {"enabled": True}}, [], "fp16.enabled",
     "deepspeed.fp16.enabled is true but train.precision is auto (fp32 on this machine)"),
    ({"zero_optimization": {"stage": 2}}, ["zero_stage=1"], "zero_optimization.stage",
     "deepspeed.zero_optimization.stage is 2 but parallel.zero_stage is 1"),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}, ["zero_stage=2"],
     "zero_optimization.offload_optimizer.device",
     'deepspeed.zero_optimization.offload_optimizer.device is "cpu" but parallel.offload_optimizer is false'),
    ({"zero_optimization": {"offload_param": {"device": "none"}}},
     ["zero_stage=3", "parallel.offload_param=true"], "zero_optimization.offload_param.device",
     'deepspeed.zero_optimization.offload_param.device is "none" but parallel.offload_param is true'),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}, "scheduler": {"type": "WarmupLR"}}, [],
     "optimizer.params.lr", "deepspeed.optimizer.params.lr is 0.1 but optim.lr is 0.001"),
    ({"optimizer": {"type": "AdamW", "params": {"betas": [0.8, 0.9]}}, "scheduler": {"type": "WarmupLR"}}, [],
     "optimizer.params.betas", "deepspeed.optimizer.params.betas is [0.8, 0.9] but optim.betas is [0.9, 0.999]"),
    ({"optimizer": {"type": "AdamW", "params": {"eps": 1e-5}}, "scheduler": {"type": "WarmupLR"}}, [],
     "optimizer.params.eps", "deepspeed.optimizer.params.eps is 1e-05 but optim.eps is 1e-08"),
    ({"optimizer": {"type": "AdamW", "params": {"weight_decay": 0.1}}, "scheduler": {"type": "WarmupLR"}}, [],
     "optimizer.params.weight_decay", "deepspeed.optimizer.params.weight_decay is 0.1 but optim.weight_decay is 0.0"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.5}}}, [], "scheduler.params.warmup_max_lr",
     "deepspeed.scheduler.params.warmup_max_lr is 0.5 but optim.lr is 0.001"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 9}}}, ["optim.warmup_steps=5"],
     "scheduler.params.warmup_num_steps", "deepspeed.scheduler.params.warmup_num_steps is 9 but optim.warmup_steps is 5"),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 9}}}, [],
     "scheduler.params.total_num_steps",
     "deepspeed.scheduler.params.total_num_steps is 9 but the run's total optimizer steps is 50"),
    ({"tensor_parallel": {"autotp_size": 2}}, [], "tensor_parallel.autotp_size",
     "deepspeed.tensor_parallel.autotp_size is 2 but parallel.tp_size is 1"),
]


@pytest.mark.parametrize("user,overrides,key,message", MISMATCHES, ids=[m[2] for m in MISMATCHES])
def test_each_mismatch_is_named(user, overrides, key, message):
    found = problems(user, *overrides)
    assert list(found) == [f"parallel.deepspeed.{key}"]
    assert found[f"parallel.deepspeed.{key}"].startswith(message)


def test_several_mismatches_in_one_error():
    user = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 2.0, "bf16": {"enabled": True},
            "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto", "sub_group_size": "auto"},
            "optimizer": {"type": "AdamW", "params": {"lr": 0.5}}}
    with pytest.raises(DeepSpeedConfigError) as err:
        build(user, "zero_stage=2", "precision=fp32", hidden=None)
    keys = [k for k, _ in err.value.problems]
    assert keys == ["parallel.deepspeed." + k for k in (
        "train_micro_batch_size_per_gpu", "gradient_clipping", "bf16.enabled", "zero_optimization.stage",
        "zero_optimization.stage3_prefetch_bucket_size", "optimizer.params.lr", "optimizer",
        "zero_optimization.sub_group_size")]
    text = str(err.value)
    assert text.startswith("the DeepSpeed config does not fit the run config (8 problems):")
    assert "is 4 but train.micro_batch_size is 8" in text and "is 2.0 but optim.grad_clip is 1.0" in text
    assert "sub_group_size" in text and '"auto" but the run config has no value for it' in text


# -- bucket sizes -------------------------------------------------------------------------------

def test_bucket_sizes_from_hidden_size():
    z3 = build({}, "zero_stage=3", hidden=128).config["zero_optimization"]
    assert (z3["reduce_bucket_size"], z3["stage3_prefetch_bucket_size"],
            z3["stage3_param_persistence_threshold"]) == (128 * 128, int(0.9 * 128 * 128), 1280)
    z2 = build({}, "zero_stage=2", hidden=128).config["zero_optimization"]
    assert z2 == {"stage": 2, "reduce_bucket_size": 128 * 128}
    assert build({}, "zero_stage=0").config["zero_optimization"] == {"stage": 0}


def test_no_hidden_size():
    # absent keys keep DeepSpeed's defaults; "auto" ones cannot be computed: each is named
    assert build({}, "zero_stage=3", hidden=None).config["zero_optimization"] == {
        "stage": 3, "stage3_gather_16bit_weights_on_model_save": True}
    found = problems({"zero_optimization": {"reduce_bucket_size": "auto",
                                            "stage3_param_persistence_threshold": "auto"}},
                     "zero_stage=3", hidden=None)
    assert list(found) == ["parallel.deepspeed.zero_optimization.reduce_bucket_size",
                           "parallel.deepspeed.zero_optimization.stage3_param_persistence_threshold"]
    assert all("model config has no hidden_size" in msg for msg in found.values())


# -- optimizer and scheduler ownership ----------------------------------------------------------

def test_deepspeed_optimizer_without_scheduler_is_an_error():
    found = problems({"optimizer": {"type": "AdamW"}})
    assert "a DeepSpeed optimizer without a scheduler is an error" in found["parallel.deepspeed.optimizer"]


def test_who_builds_what():
    both = build({"optimizer": {"type": "auto"}, "scheduler": {"type": "auto"}}, "zero_stage=1")
    assert (both.ds_optimizer, both.ds_scheduler) == (True, True)
    assert "zero_allow_untested_optimizer" not in both.config  # DeepSpeed's own optimizer
    sched_only = build({"scheduler": {"type": "auto"}}, "zero_stage=1")
    assert (sched_only.ds_optimizer, sched_only.ds_scheduler) == (False, True)
    assert sched_only.config["zero_allow_untested_optimizer"] is True  # e.g. torch SGD under ZeRO
    neither = build({})
    assert (neither.ds_optimizer, neither.ds_scheduler, neither.warnings) == (False, False, [])


def test_torch_optimizer_with_offload_is_allowed_with_a_warning():
    setup = build({}, "zero_stage=2", "parallel.offload_optimizer=true")
    assert setup.config["zero_force_ds_cpu_optimizer"] is False
    assert setup.config["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    assert len(setup.warnings) == 1 and "zero_force_ds_cpu_optimizer false" in setup.warnings[0]
    found = problems({"zero_force_ds_cpu_optimizer": True}, "zero_stage=2", "parallel.offload_optimizer=true")
    assert "no DeepSpeed \"optimizer\" section" in found["parallel.deepspeed.zero_force_ds_cpu_optimizer"]
    with_ds = build({"optimizer": {"type": "auto"}, "scheduler": {"type": "auto"}},
                    "zero_stage=2", "parallel.offload_optimizer=true")
    assert "zero_force_ds_cpu_optimizer" not in with_ds.config and with_ds.warnings == []


def test_inference_config():
    built = build({"optimizer": {"type": "auto"}, "scheduler": {"type": "auto"}}, "zero_stage=3",
                  "parallel.offload_optimizer=true").config
    config = inference_config(built)
    assert "optimizer" not in config and "scheduler" not in config
    assert "offload_optimizer" not in config["zero_optimization"] and "optimizer" in built  # a copy
    with pytest.raises(DeepSpeedConfigError, match="only makes sense with ZeRO stage 3"):
        inference_config(build({}, "zero_stage=2").config)


# -- a config file ------------------------------------------------------------------------------

def test_config_from_a_json_file(tmp_path: Path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2},
                                "gradient_clipping": 0.25}))
    setup = build({"file": str(path)}, "zero_stage=2", "optim.grad_clip=0.25", "batch_size=3")
    assert setup.config["train_micro_batch_size_per_gpu"] == 3 and setup.config["gradient_clipping"] == 0.25
    assert json.loads(path.read_text())["train_micro_batch_size_per_gpu"] == "auto"  # file untouched
    assert "parallel.deepspeed.zero_optimization.stage" in problems({"file": str(path)}, "zero_stage=1")


def test_bad_config_files(tmp_path: Path):
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "list.json").write_text("[1, 2]")
    for spec, message in (({"file": str(tmp_path / "missing.json")}, "no such file"),
                          ({"file": str(tmp_path / "bad.json")}, "is not valid JSON"),
                          ({"file": str(tmp_path / "list.json")}, "must hold a JSON object")):
        assert message in problems(spec)["parallel.deepspeed.file"]
    assert "not both" in problems({"file": "x.json", "zero_optimization": {}})["parallel.deepspeed"]


# -- precision on this machine ------------------------------------------------------------------

def _cpu_has_native_bf16() -> bool:
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    return "avx512_bf16" in flags or "amx_bf16" in flags


def test_resolve_precision_here():
    import torch
    from deepspeed.accelerator import get_accelerator
    fast_bf16 = torch.cuda.is_bf16_supported() if torch.cuda.is_available() else _cpu_has_native_bf16()
    assert resolve_precision("auto") == ("bf16" if fast_bf16 else "fp32")
    assert resolve_precision("fp32") == "fp32"
    if fast_bf16:
        assert resolve_precision("bf16") == "bf16"
    if get_accelerator().is_fp16_supported():  # DeepSpeed's own test, the one initialize makes
        assert resolve_precision("fp16") == "fp16"
    else:
        with pytest.raises(ConfigError, match="DeepSpeed's fp16 needs a CUDA GPU or a CPU with native fp16"):
            resolve_precision("fp16")
    with pytest.raises(ConfigError, match="must be one of auto, bf16, fp16, fp32"):
        resolve_precision("fp8")


# -- ZeRO-3 construction switches (the real partitioning runs in the 2-rank test) ---------------

def test_transformers_zero3_switch():
    from transformers.integrations import deepspeed_config, is_deepspeed_zero3_enabled
    stage3 = build({}, "zero_stage=3").config
    try:
        assert transformers_zero3(stage3) is not None
        assert is_deepspeed_zero3_enabled() and deepspeed_config() == stage3  # kept alive by us
        with zero3_init(build({}, "zero_stage=2").config):  # not stage 3: nothing, and the switch off
            assert not is_deepspeed_zero3_enabled()
    finally:
        transformers_zero3({})


# -- real engines on 2 ranks --------------------------------------------------------------------

@pytest.mark.slow
def test_built_configs_run_real_engines():
    """ZeRO 0-3 (torch optimizer; torch optimizer under offload; DeepSpeed optimizer and
    scheduler) start from the built configs, train, and ZeRO-3 partitions at construction."""
    results = {(r["case"], r["rank"]): r for r in parse_results(
        run_deepspeed(SCRIPTS / "ds_config_check.py", nproc=2, timeout=400))}
    cases = ("zero0", "zero1", "zero2_offload", "zero3", "zero3_ds_optimizer")
    assert set(results) == {(c, r) for c in cases for r in (0, 1)}
    for (case, rank), r in results.items():
        assert r["losses"][-1] < r["losses"][0] - 0.5, (case, rank, r["losses"])
        assert r["std"] == pytest.approx(0.02, rel=0.2), (case, r["std"])  # Hugging Face's init
        assert r["zero3_mode"] == case.startswith("zero3")
    for rank in (0, 1):  # the same model and data at ZeRO 0, 1, 2 (+offload): the same steps
        for case in ("zero1", "zero2_offload"):
            assert results[case, rank]["losses"] == pytest.approx(results["zero0", rank]["losses"], abs=1e-4)
        for case in ("zero3", "zero3_ds_optimizer"):
            r = results[case, rank]
            assert r["whole"] == 0, "a rank held a whole parameter right after construction"
            assert r["held"] == pytest.approx(r["full"] / 2, rel=0.02), (r["held"], r["full"])
    assert results["zero2_offload", 0]["warnings"] and "zero_force_ds_cpu_optimizer" in results["zero2_offload", 0]["warnings"][0]
    assert results["zero3_ds_optimizer", 0]["ds_optimizer"] and not results["zero3", 0]["ds_optimizer"]
