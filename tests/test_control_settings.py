"""The control plane's pieces that need no engine: the live settings object (what the loop reads,
what checkpoints record) and a queued command's trip to the other ranks."""

import json

from contract.config.load import load_config
from contract.protocol.commands import Generate, GenerationParams, Set, Status, Stop
from engine.control.pending import NO_REPLY, CommandQueue, Pending, Reply
from engine.control.settings import LiveSettings, live_settings


def test_unchanged_settings_are_the_run_configs():
    cfg = load_config(overrides=["eval.every_n_steps=7", "checkpoint.every_n_steps=9",
                                 "checkpoint.save_at_end=true"])
    live = LiveSettings()
    assert (live.eval_every(cfg), live.save_every(cfg), live.save_at_end(cfg)) == (7, 9, True)
    live.eval_every_n_steps, live.save_every_n_steps, live.final_save = 0, 3, False
    assert (live.eval_every(cfg), live.save_every(cfg), live.save_at_end(cfg)) == (0, 3, False)
    # the config object itself is never written
    assert (cfg.eval.every_n_steps, cfg.checkpoint.every_n_steps, cfg.checkpoint.save_at_end) == (7, 9, True)


def test_generation_params_layer_request_over_run_over_defaults():
    live = LiveSettings(generation={"max_new_tokens": 5, "temperature": 0.5})
    params = live.generation_params(Generate(prompt="x", temperature=0.9).sampling())
    assert params["max_new_tokens"] == 5 and params["temperature"] == 0.9 and params["top_p"] == 1.0


def test_checkpoints_record_only_what_set_changed():
    live = LiveSettings()
    assert live.state_dict() == {"lr_scale": 1.0, "generation": {}}
    live.grad_clip, live.lr_scale, live.final_save = 0.5, 0.25, False
    live.generation.update(max_new_tokens=5)
    state = live.state_dict()
    # the format older checkpoints have: a plain dict of the changed values (no stop decision)
    assert state == {"lr_scale": 0.25, "generation": {"max_new_tokens": 5}, "grad_clip": 0.5}
    json.dumps(state)
    again = LiveSettings(eval_every_n_steps=4)
    again.load_state_dict(state)
    assert again.grad_clip == 0.5 and again.lr_scale == 0.25 and again.generation == {"max_new_tokens": 5}
    assert again.eval_every_n_steps is None and again.final_save is None
    state["generation"]["max_new_tokens"] = 6  # no sharing between the two
    assert again.generation == {"max_new_tokens": 5}


def test_a_run_without_control_plane_reads_its_config():
    class Run:
        pass

    run = Run()
    assert live_settings(run) == LiveSettings()
    run.live_settings = LiveSettings(save_every_n_steps=2)
    assert live_settings(run).save_every_n_steps == 2


def test_a_queued_command_reaches_the_other_ranks_as_the_same_command():
    sent: list[dict] = []
    queue = CommandQueue()
    command = Set(lr=1e-4, generation=GenerationParams(max_new_tokens=5))
    item = queue.put("a-1", command, Reply("a-1", sent.append))
    assert sent == [{"type": "ack", "queued": 1, "id": "a-1"}]
    # the broadcast payload is JSON; another rank rebuilds the typed command and answers nobody
    other = Pending.from_wire(json.loads(json.dumps(item.wire())))
    assert other.command == command and other.seq == item.seq and other.id == "a-1"
    assert other.reply is NO_REPLY and other.cmd == "set" and other.args == command.args()
    queue.put("a-2", Stop(), Reply("a-2", sent.append))
    assert sent[-1] == {"type": "ack", "queued": 2, "id": "a-2"}
    assert [p.command for p in queue.drain()] == [command, Stop()]
    queue.put("a-3", Status(), NO_REPLY)
    assert len(queue) == 1
