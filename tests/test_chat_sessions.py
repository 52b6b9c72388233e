"""Chat with what a run left behind, with no live run: the config a chat-only run gets
for each kind of source, and a real one: a finished run's checkpoint held in the engine answers
exactly what its final model answers in transformers; `resume` is refused, `stop` ends it."""

import json
from pathlib import Path

import pytest

from contract.config.load import load_config
from supervisor import RunManager
from supervisor.chat_sessions import ChatSourceError, chat_config
from supervisor.client import CommandError, RunClient
from test_runs import assert_no_process_left, events_of, wait_for


def _run_folder(root: Path, name: str, checkpoints: dict[str, bool], model: str | None) -> Path:
    """A run folder as a run leaves it: config.yaml, events, checkpoints (complete or not), model/."""
    run = root / name
    (run / "checkpoints").mkdir(parents=True)
    cfg = load_config(overrides=["nproc=2", "zero_stage=3", "lr=0.5", f"output_dir={root}", f"run_name={name}"])
    (run / "config.yaml").write_text(cfg.to_yaml())
    (run / "events.jsonl").write_text("")
    for step, complete in checkpoints.items():
        folder = run / "checkpoints" / step
        folder.mkdir()
        (folder / "trainer_state.json").write_text(json.dumps({"config": cfg.to_dict()}))
        if complete:
            (folder / "COMPLETE.json").write_text("{}")
    if model == "adapter":
        (run / "model").mkdir()
        (run / "model" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    elif model == "full":
        (run / "model").mkdir()
        (run / "model" / "config.json").write_text("{}")
    return run


def test_the_chat_config_of_each_kind_of_source(tmp_path):
    run = _run_folder(tmp_path, "r", {"step-4": True, "step-8": False}, model="full")
    cfg = chat_config(run)  # the newest COMPLETE checkpoint, in the run's own layout
    assert cfg.resume == str(run / "checkpoints" / "step-4")
    assert (cfg.parallel.nproc, cfg.parallel.zero_stage, cfg.optim.lr) == (2, 3, 0.5)
    assert cfg.control.chat_only and cfg.control.enabled and not cfg.checkpoint.save_at_end
    assert cfg.checkpoint.every_n_steps == 0 and cfg.eval.every_n_steps == 0
    assert cfg.logging.run_name.startswith("chat-r-step-4-")

    cfg = chat_config(run / "model")  # a final model folder: that model, one rank
    assert cfg.model.path == str(run / "model") and cfg.parallel.nproc == 1 and not cfg.resume

    lora = _run_folder(tmp_path, "l", {}, model="adapter")
    cfg = chat_config(lora)  # no checkpoint: the adapter, on the run's base model and layout
    assert cfg.control.chat_load == str(lora / "model") and cfg.parallel.nproc == 2 and not cfg.resume

    with pytest.raises(ChatSourceError, match="not marked complete"):
        chat_config(run / "checkpoints" / "step-8")
    with pytest.raises(ChatSourceError, match="no complete checkpoint and no final model"):
        chat_config(_run_folder(tmp_path, "empty", {"step-2": False}, model=None))
    with pytest.raises(ChatSourceError, match="not a run folder, a training checkpoint"):
        chat_config(tmp_path / "r" / "checkpoints")
    with pytest.raises(ChatSourceError, match="no such file or folder"):
        chat_config(tmp_path / "nothing")


@pytest.mark.slow
def test_a_finished_runs_checkpoint_answers_as_its_final_model(tmp_path):
    env = {"LIVETUNE_CACHE": str(tmp_path / "cache"), "LIVETUNE_HEARTBEAT_S": "0.5"}
    manager = RunManager(tmp_path / "runs")
    trained = manager.start(load_config(overrides=[
        f"output_dir={tmp_path / 'runs'}", "run_name=done", "max_steps=4", "data.max_length=32", "batch_size=8",
        "precision=fp32", "logging.tensorboard=false", "eval.at_end=false", "eval.every_n_steps=0",
        "checkpoint.every_n_steps=4", "checkpoint.save_at_end=true"]), env=env)
    assert trained.wait(timeout=300) and trained.info().state == "finished", trained.failure()

    chat = manager.start(chat_config(trained.folder.root), env=env)
    try:
        wait_for(lambda: any(e.get("chat_only") and e.get("state") == "paused" for e in events_of(chat.info())),
                 240, "the chat-only run to hold the model", chat)
        prompt = "capital: "
        with RunClient.connect(chat.folder.root) as client:
            answer = client.chat(prompt, max_new_tokens=12, temperature=0.0)
            with pytest.raises(CommandError, match="chat-only run"):
                client.resume()
        assert answer == _greedy(trained.folder.root / "model", prompt, 12)
    finally:
        pgid = chat.pid
        info = manager.stop(chat.name, timeout=60)
    assert_no_process_left(pgid)
    assert info.state == "finished" and not (chat.folder.root / "checkpoints" / "latest").exists()


def _greedy(model_dir: Path, prompt: str, n: int) -> str:
    """The answer transformers gives with the final model's own weights (greedy)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tok(prompt, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


def test_the_front_ends_name_a_source_nothing_can_chat_from(tmp_path):
    from app.notebook import api
    from app.session import Session, SessionError
    with pytest.raises(SessionError, match="not a run folder, a training checkpoint"):
        Session(tmp_path / "runs").chat_with(tmp_path)
    with pytest.raises(api.RunError, match="no such file or folder"):
        api.chat_with(tmp_path / "nothing", output_dir=tmp_path / "runs")
