"""GRPO's config and reward declarations, before launch (torch-free), and its advantages."""

import pytest

from contract.config.load import load_config
from contract.config.schema import ConfigError
from contract.rewards import build_reward, build_rewards


def _problems(*overrides):
    with pytest.raises(ConfigError) as info:
        load_config(None, ["objective=grpo", *overrides])
    return dict(info.value.problems)


def test_objective_grpo_from_the_command_line_has_trl_defaults():
    cfg = load_config(None, ["objective=grpo", "grpo.loss_type=bnpo", "grpo.num_generations=4"])
    assert cfg.preference.objective == "grpo" and cfg.grpo.loss_type == "bnpo"
    assert (cfg.grpo.beta, cfg.grpo.epsilon, cfg.grpo.scale_rewards, cfg.grpo.temperature) == (0.0, 0.2, "group", 1.0)
    assert cfg.grpo.rewards == []  # exact match against `answer`
    assert [r.name for r in build_rewards(cfg.grpo.rewards)] == ["exact_match"]


def test_bad_rewards_and_layouts_are_refused_each_named(tmp_path, monkeypatch):
    (tmp_path / "mine.py").write_text("def wrong(x):\n    return []\n")
    monkeypatch.chdir(tmp_path)
    problems = _problems("pp=2", "nproc=2", "grpo.rewards=[{function: mine:wrong}, {function: nowhere:f}, "
                         "{kind: regex}, {kind: exact, weight: 1}]")
    assert "pipeline" in problems["parallel.pp_size"]
    assert "(x)" in problems["grpo.rewards[0].function"] and "prompts, completions" in problems["grpo.rewards[0].function"]
    assert "cannot import 'nowhere'" in problems["grpo.rewards[1].function"]
    assert "pattern" in problems["grpo.rewards[2].pattern"]
    assert "exact_match" in problems["grpo.rewards[3].kind"]


def test_builtins_score_as_documented():
    c = ["  abc ", "<answer>12.5</answer>", "x"]
    cols = {"answer": ["abc", "12.5", None]}
    assert build_reward({"kind": "exact_match"}, "r").fn(prompts=[""] * 3, completions=c, **cols) == [1.0, 0.0, None]
    assert build_reward({"kind": "format"}, "r").fn(prompts=[], completions=c) == [0.0, 1.0, 0.0]
    assert build_reward({"kind": "numeric", "tolerance": 0.1}, "r").fn(prompts=[], completions=c, **cols)[1] == 1.0
    assert build_reward({"kind": "regex", "pattern": "^x$"}, "r").fn(prompts=[], completions=c) == [0.0, 0.0, 1.0]
    length = build_reward({"kind": "length", "max_tokens": 8, "cache": 4}, "r").fn
    assert length(prompts=[], completions=[""] * 3, completion_ids=[[1] * 4, [1] * 6, [1] * 9]) == [0.0, -0.5, -1.0]
    with pytest.raises(ValueError, match="named exact_match"):
        build_rewards([{"kind": "exact_match"}, {"kind": "exact_match"}])


def test_advantages_nan_aware_as_trl():
    torch = pytest.importorskip("torch")
    from engine.objectives.grpo import advantages_of
    from engine.objectives.rewards import total
    per_function = torch.tensor([[1.0, float("nan")], [0.0, 1.0], [float("nan"), float("nan")], [0.0, 0.0]])
    rewards = total(per_function, [1.0, 2.0])
    assert rewards[:2].tolist() == [1.0, 2.0] and rewards[2].isnan()
    adv, zero = advantages_of(rewards, 4, "group")
    # mean and Bessel std over the 3 scored samples (1, 2, 0): mean 1, std 1
    assert torch.allclose(adv, torch.tensor([0.0, 1 / (1 + 1e-4), 0.0, -1 / (1 + 1e-4)]))
    assert not zero.any()
