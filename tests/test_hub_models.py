"""A model named by its hub ID: read from a Hugging Face cache the test writes in the
hub's own layout, with HF_HUB_OFFLINE=1; an ID the cache lacks is refused before any rank
starts, saying it is not in the cache; a local folder of the same name wins."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from contract import hub
from contract.config.load import load_config
from contract.preflight import preflight
from control_runs import task_files

REPO = Path(__file__).resolve().parent.parent
REPO_ID = "acme/tiny-qwen"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def write_hub_cache(cache: Path, tokenizer) -> Path:
    """A tiny Qwen2 model and its tokenizer where huggingface_hub keeps `acme/tiny-qwen`:
    models--acme--tiny-qwen/{refs/main, snapshots/<commit>/...}."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    repo = cache / ("models--" + REPO_ID.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    Qwen2ForCausalLM(config).save_pretrained(snapshot)
    tokenizer.save_pretrained(snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


@pytest.fixture
def cache(tmp_path, tiny_tokenizer, monkeypatch):
    from huggingface_hub import constants
    folder = tmp_path / "hf-cache"
    write_hub_cache(folder, tiny_tokenizer)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(folder))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return folder


def test_a_cached_hub_id_passes_the_checks_and_stays_an_id(cache, tmp_path):
    task = task_files(tmp_path / "task")
    cfg = load_config(overrides=[f"model.path={REPO_ID}", f"data.train={task['train']}"])
    assert cfg.model.path == REPO_ID  # not made into a path under the current folder
    report = preflight(cfg)
    assert report.ok, report.text()
    assert any(key == "model.path" and "Hugging Face cache" in msg for key, msg in report.notes)
    assert hub.local_folder(REPO_ID) == cache / f"models--acme--tiny-qwen/snapshots/{COMMIT}"


def test_an_id_the_cache_lacks_is_refused_offline_naming_the_cache(cache, tmp_path):
    task = task_files(tmp_path / "task")
    report = preflight(load_config(overrides=["model.path=acme/absent", f"data.train={task['train']}"]))
    (problem,) = [msg for key, msg in report.problems if key == "model.path"]
    assert "acme/absent" in problem and str(cache) in problem and "HF_HUB_OFFLINE=1" in problem
    with pytest.raises(hub.HubModelMissing, match="does not hold it"):
        hub.local_folder("acme/absent")


def test_the_refusal_names_the_cache_variable_the_user_set(monkeypatch, tmp_path):
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    said = hub.missing_message("acme/absent")
    assert f"point HF_HUB_CACHE (set to {tmp_path / 'cache'}) at a cache that holds it" in said
    assert "HF_HOME" not in said
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert "point HF_HOME (set to" in hub.missing_message("acme/absent")
    monkeypatch.delenv("HF_HOME")
    assert "point HF_HUB_CACHE at a cache" in hub.missing_message("acme/absent")  # neither set: both named


def test_a_local_folder_of_the_same_name_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "acme" / "tiny-qwen").mkdir(parents=True)
    assert not hub.is_hub_id(REPO_ID) and hub.is_hub_id("acme/elsewhere")
    assert not hub.is_hub_id("./acme/x") and not hub.is_hub_id("/abs/x") and not hub.is_hub_id("a/b/c")


# a script as a user writes it; it also shows that the end of train() cleans up as a launched
# run does (no control.json left with its token and a dead port), and `with` closes the rest
SCRIPT = """
import sys
from contract.config.load import load_config
from engine import Trainer
with Trainer(config=load_config(overrides=sys.argv[1:])) as t:
    print("control.json during the run:", t.folder.control.exists())
    t.train()
    print("control.json after train():", t.folder.control.exists())
print("event log closed after the with block:", t.events is None)
"""


@pytest.mark.slow
def test_a_run_trains_a_model_named_by_its_hub_id_offline(tmp_path, tiny_tokenizer):
    cache = tmp_path / "hf-cache"
    write_hub_cache(cache, tiny_tokenizer)
    task = task_files(tmp_path / "task")
    env = dict(os.environ, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1", LIVETUNE_CACHE=task["cache"],
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    args = [f"model.path={REPO_ID}", f"data.train={task['train']}", f"output_dir={tmp_path / 'runs'}",
            "run_name=hub", "max_steps=3", "batch_size=4", "data.max_length=32", "precision=fp32",
            "logging.tensorboard=false", "eval.at_end=false",
            "checkpoint.save_at_end=false"]
    proc = subprocess.run([sys.executable, "-c", SCRIPT, *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for said in ("control.json during the run: True", "control.json after train(): False",
                 "event log closed after the with block: True"):
        assert said in proc.stdout, proc.stdout[-3000:]
    assert not (tmp_path / "runs" / "hub" / "control.json").exists()
    events = [json.loads(line) for line in (tmp_path / "runs" / "hub" / "events.jsonl").read_text().splitlines()]
    setup = next(e for e in events if e["type"] == "setup")
    assert setup["parameters"] == sum(p.numel() for p in _cached_model(cache).parameters())
    assert [e["step"] for e in events if e["type"] == "train"] == [1, 2, 3]
    assert f"path: {REPO_ID}" in (tmp_path / "runs" / "hub" / "config.yaml").read_text()  # the ID, as given


def _cached_model(cache: Path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(cache / f"models--acme--tiny-qwen/snapshots/{COMMIT}")
