"""The decisions the composition root makes once (engine.assembly): which layout object and
which method object a config gets, what each refuses, and the step counts of the loop. The
objects themselves run in the multi-rank tests (test_trainer_zero, test_tp, test_pp, test_peft,
test_lomo, test_trainer_script); here, without a process group, only what needs none."""

import pytest
import torch

from contract.config.load import load_config
from engine.model import methods
from engine.assembly import data as run_data
from engine.context import DistEnv
from engine.parallel import layouts
from engine.steps import EngineStep


def cfg(*overrides: str):
    return load_config(overrides=list(overrides))


def env(**sizes) -> DistEnv:
    return DistEnv(rank=0, local_rank=0, world_size=2, dp_rank=0, dp_size=2, dp_group=None,
                   device=torch.device("cpu"), **sizes)


@pytest.mark.parametrize("overrides, kind, split", [
    ((), layouts.DataParallel, False),
    (("zero_stage=3",), layouts.DataParallel, False),
    (("tp=2", "nproc=2"), layouts.TensorParallel, True),
    (("pp=2", "nproc=2"), layouts.Pipeline, True),
])
def test_the_layout_is_chosen_from_the_config(overrides, kind, split):
    chosen = layouts.layout_class(cfg(*overrides).parallel)
    assert chosen is kind and chosen.split is split


def test_tensor_and_pipeline_parallelism_together_are_refused():
    parallel = cfg().parallel
    parallel.tp_size, parallel.pp_size = 2, 2  # past the config's own check, as a script could
    with pytest.raises(ValueError, match="parallel.pp_size"):
        layouts.layout_class(parallel)


@pytest.mark.parametrize("method, kind, own_optimizer, adapter", [
    ("full", methods.FullMethod, True, False),
    ("lora", methods.PeftMethod, True, True),
    ("prompt_tuning", methods.PeftMethod, True, True),
    ("p_tuning", methods.PeftMethod, True, True),
    ("lomo", methods.FusedMethod, False, False),
    ("adalomo", methods.FusedMethod, False, False),
])
def test_the_method_is_chosen_from_the_config(method, kind, own_optimizer, adapter):
    chosen = methods.method_of(cfg(f"method={method}"))
    assert type(chosen) is kind and chosen.name == method
    assert chosen.builds_optimizer is own_optimizer and chosen.has_adapter is adapter


def test_the_step_strategy_comes_from_method_and_layout():
    from engine.lomo import FusedStep
    from engine.parallel.pipeline import PipelineStep

    data, pipe = layouts.DataParallel(env()), layouts.Pipeline(env(pp_size=2))
    assert isinstance(methods.FullMethod().step(data), EngineStep)
    assert isinstance(methods.FullMethod().step(pipe), PipelineStep)
    assert isinstance(methods.PeftMethod("lora").step(data), EngineStep)
    assert isinstance(methods.FusedMethod("lomo").step(data), FusedStep)
    with pytest.raises(ValueError, match="method.name: lomo"):
        methods.FusedMethod("lomo").step(pipe)


def test_a_fused_method_refuses_an_optimizer_of_the_users():
    model = torch.nn.Linear(2, 2)
    methods.FullMethod().check_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="method.name: adalomo updates inside backward"):
        methods.FusedMethod("adalomo").check_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))


def test_only_the_peft_method_answers_without_its_adapter():
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    base = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=32))
    model = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    with methods.PeftMethod("lora").base_model(model):
        assert layer.disable_adapters
    assert not layer.disable_adapters
    with methods.FullMethod().base_model(base):  # nothing to switch off
        pass
    with pytest.raises(ValueError, match="method.name: full trains the whole model"):
        methods.FullMethod().prepare_model(model, cfg("method=full"))


@pytest.mark.parametrize("overrides, micro_batches, steps, epochs", [
    (("epochs=3", "train.grad_accum=2"), 7, 9, 3),      # 3 whole steps per epoch (7 // 2)
    (("max_steps=10",), 4, 10, 3),                      # enough epochs of 4 steps to reach 10
    (("max_steps=8",), 4, 8, 2),
])
def test_steps_and_epochs_of_the_loop(overrides, micro_batches, steps, epochs):
    c = cfg(*overrides)
    assert run_data.total_steps(c, micro_batches) == steps
    assert run_data.epochs(c, micro_batches) == epochs
