"""contract.protocol, contract.events and the event-log tailer: pure and fast (no engine, no socket).

Each command's defaults and bounds come from its pydantic model; these tests pin the values a user
relies on (literals, not read back from the declaration) and check that every declared bound is
enforced at both ends, on the wire and when a command is built in Python.
"""

import json
import math

import pytest

from contract.protocol import commands as P
from contract.protocol import wire
from contract.events import EventType, run_state, state_event
from contract.protocol.commands import ALLOWED_COMMANDS, COMMANDS, GENERATION_DEFAULTS, Generate, GenerationParams, Pause, Set, Status, Stop, Subscribe, allowed_commands, parse_command
from contract.protocol.states import RunState
from contract.protocol.base import ProtocolError
from contract.run_folder import EventLog, EventTail, read_events
from supervisor.client import CommandError, RunClient


def _parse(cmd, args=None, id="r1"):
    return parse_command({"id": id, "cmd": cmd, "args": {} if args is None else args})


# -- defaults --------------------------------------------------------------------------------------
def test_the_defaults_a_user_relies_on():
    assert Stop().save is True  # stop saves, in every front end
    assert _parse("stop")[1] == Stop(save=True)
    assert Status().ranks is False and Subscribe().from_line == 0
    g = Generate(prompt="hi")
    assert g.compare_base is False and g.sampling() == {}  # nothing given: the run's defaults apply
    assert GENERATION_DEFAULTS == {"max_new_tokens": 64, "temperature": 0.0, "top_p": 1.0, "top_k": 0,
                                   "repetition_penalty": 1.0, "seed": None, "stop": []}
    assert P.GENERATION_PARAMS == tuple(GENERATION_DEFAULTS)
    assert sorted(COMMANDS) == sorted(["evaluate", "generate", "pause", "resume", "save", "set", "status", "stop",
                                       "rewind", "branch", "snapshot", "branches",
                                       "add_source", "set_weight", "remove_source", "teach", "inbox", "forget",
                                       "complete", "add_reward", "remove_reward", "rate", "rate_chat"])
    assert P.IMMEDIATE == {"status", "subscribe"}
    assert Status().answered_at_once and not Status(ranks=True).answered_at_once
    assert not Stop().answered_at_once and Subscribe().answered_at_once


def test_every_field_is_documented_where_it_is_declared():
    for cls in [*COMMANDS.values(), Subscribe, GenerationParams]:
        for name, f in cls.model_fields.items():
            assert f.description, f"{cls.__name__}.{name} has no description"
        assert cls.model_json_schema()["additionalProperties"] is False  # the schema says: nothing else


# -- validation ------------------------------------------------------------------------------------
@pytest.mark.parametrize("cmd, args, message", [
    ("rm -rf", {}, "unknown command 'rm -rf'; allowed: add_reward, add_source, branch, branches, complete, evaluate, "
                   "forget, generate, inbox, pause, rate, rate_chat, remove_reward, remove_source, resume, rewind, save, set, "
                   "set_weight, snapshot, status, stop, teach, subscribe"),
    ("stop", {"save": "yes"}, "stop: argument 'save' must be true or false, got 'yes'"),
    ("stop", {"save": None}, "stop: argument 'save' must not be null"),
    ("set", {"lr": -1}, "set: argument 'lr' must be at least 0.0 and at most 10.0, got -1"),
    ("set", {"lr": "fast"}, "set: argument 'lr' must be a number, got 'fast'"),
    ("set", {"lr": True}, "set: argument 'lr' must be a number, got True (true / false is not a number)"),
    ("set", {"lr": math.inf}, "set: argument 'lr' must be a number, got inf (nan and inf are not numbers)"),
    ("set", {"momentum": 1}, "set: unknown argument 'momentum'; allowed: lr, lr_scale, grad_clip, "
                             "eval_every_n_steps, save_every_n_steps, generation"),
    ("set", {}, "set: name at least one of"),
    ("set", {"lr_scale": 0}, "set: argument 'lr_scale' must be above 0.0"),
    ("set", {"eval_every_n_steps": 2.5}, "set: argument 'eval_every_n_steps' must be an integer, got 2.5"),
    ("set", {"generation": {"beams": 4}}, "set generation: unknown argument 'beams'"),
    ("set", {"generation": {"top_k": True}}, "set generation: argument 'top_k' must be an integer, got True"),
    ("set", {"generation": {"stop": ["", "x"]}}, "set generation: argument 'stop' must be a list of non-empty"),
    ("set", {"generation": [1]}, "set: argument 'generation' must be a mapping, got [1]"),
    ("generate", {}, "generate: give exactly one of `prompt` or `messages`"),
    ("generate", {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, "generate: give exactly one"),
    ("generate", {"messages": []}, "generate: `messages` must not be empty"),
    ("generate", {"messages": [{"role": "x", "content": "a"}]}, "generate: messages[0] must be"),
    ("generate", {"prompt": "a", "top_p": 0}, "generate: argument 'top_p' must be above 0.0 and at most 1.0, got 0"),
    ("generate", {"prompt": "a", "max_new_tokens": 4097}, "generate: argument 'max_new_tokens' must be at least 1 and at most 4096, got 4097"),
    ("generate", {"prompt": "a", "max_new_tokens": 0}, "generate: argument 'max_new_tokens' must be at least 1"),
    ("generate", {"prompt": "a", "stop": "x"}, "generate: argument 'stop' must be a list, got 'x'"),
    ("generate", {"prompt": 3}, "generate: argument 'prompt' must be a string, got 3"),
    ("pause", {"now": True}, "pause: unknown argument 'now'; allowed: none"),
    ("subscribe", {"from_line": -1}, "subscribe: argument 'from_line' must be at least 0"),
    ("set", {"lr": None}, "set: argument 'lr' must not be null: leave it out for the run's setting"),
    ("set", {"grad_clip": "x"}, "set: argument 'grad_clip' must be a number, got 'x'"),
    ("forget", {}, "forget: argument 'id' is required (The entry's id"),
    ("add_source", {"path": "x", "format": "csv"}, "add_source: argument 'format' must be one of 'auto', 'text'"),
    ("generate", {"messages": [{"role": "user", "content": 3}]},
     "generate: argument 'messages[0].content' must be a string, got 3"),
])
def test_bad_commands_are_refused_with_a_message_naming_the_field(cmd, args, message):
    with pytest.raises(ProtocolError) as refused:
        _parse(cmd, args)
    assert str(refused.value).startswith(message)


def test_every_problem_is_named_at_once():
    with pytest.raises(ProtocolError) as refused:
        _parse("set", {"lr": -1, "grad_clip": "x", "generation": {"beams": 4}})
    assert str(refused.value).splitlines() == [
        "set: argument 'lr' must be at least 0.0 and at most 10.0, got -1",
        "set: argument 'grad_clip' must be a number, got 'x'",
        "set generation: unknown argument 'beams'; allowed: max_new_tokens, temperature, top_p, top_k, "
        "repetition_penalty, stop, seed"]
    assert Set(lr=None, grad_clip=0.5) == Set(grad_clip=0.5)  # in Python, None is "not given"


def test_bad_messages_are_refused():
    for msg, message in [([1], "a message must be a JSON object"),
                         ({"id": True, "cmd": "pause"}, "field `id` must be a string or integer"),
                         ({"cmd": "pause"}, "field `id` must be a string or integer"),
                         ({"id": 1, "cmd": "pause", "args": []}, "field `args` must be an object")]:
        with pytest.raises(ProtocolError, match=message.replace("`", ".")):
            parse_command(msg)
    with pytest.raises(ProtocolError, match="malformed JSON"):
        wire.decode(b"{nope")
    with pytest.raises(ProtocolError, match="larger than"):
        wire.decode(b"1" * (wire.MAX_MESSAGE_BYTES + 1))


def _bounded_fields():
    """(command, argument, its JSON schema) of every argument with bounds."""
    for cls in [*COMMANDS.values(), Subscribe]:
        for name, schema in cls.model_json_schema()["properties"].items():
            schema = next((s for s in schema.get("anyOf", [schema]) if "maximum" in s), None)
            if schema is not None:
                yield cls, name, schema


def _valid_base(cls):
    """The arguments a command needs besides the bounded one."""
    return {"generate": {"prompt": "x"}, "branch": {"target": "step-4", "branch": "b1"},
            "add_source": {"path": "x.jsonl"}, "set_weight": {"source": "a"},
            "teach": {"prompt": "x", "answer": "y"}, "complete": {"prompts": ["x"], "echo": True},
            "rate": {"step": 1, "sample": 0, "score": 1.0},
            "rate_chat": {"prompt": "x", "answer": "y", "score": 1.0}}.get(cls.name, {})


@pytest.mark.parametrize("cls, name, schema", list(_bounded_fields()),
                         ids=lambda x: getattr(x, "name", x if isinstance(x, str) else ""))
def test_every_declared_bound_holds_on_the_wire_and_in_python(cls, name, schema):
    exclusive = "exclusiveMinimum" in schema
    lo, hi = schema["exclusiveMinimum"] if exclusive else schema["minimum"], schema["maximum"]
    is_int = schema["type"] == "integer"
    below = lo - 1 if is_int else lo - 1e-9
    above = hi + 1 if is_int else hi * 1.0001
    base = _valid_base(cls)
    for bad in ([below, above] + ([lo] if exclusive else [])):
        with pytest.raises(ProtocolError, match=f"argument '{name}' must be"):
            _parse(cls.name, {**base, name: bad})
        with pytest.raises(ProtocolError, match=f"argument '{name}' must be"):
            cls(**{**base, name: bad})
    for good in ([hi] + ([] if exclusive else [lo])):
        assert getattr(_parse(cls.name, {**base, name: good})[1], name) == good


def test_numbers_are_normalised_to_their_declared_type():
    cmd = _parse("set", {"lr": 1, "grad_clip": 0})[1]
    assert isinstance(cmd.lr, float) and isinstance(cmd.grad_clip, float)
    assert Generate(prompt="x", temperature=1).temperature == 1.0


# -- the wire form ---------------------------------------------------------------------------------
@pytest.mark.parametrize("command", [
    Generate(prompt="reverse: ab\n", max_new_tokens=5, temperature=0.7, stop=["\n"], seed=3),
    Generate(messages=[{"role": "user", "content": "hi"}], compare_base=True),
    Pause(), Stop(), Stop(save=False), Status(ranks=True), Subscribe(from_line=12),
    Set(lr=1e-4, grad_clip=0.5, generation=GenerationParams(max_new_tokens=5, top_p=0.9)),
    Set(eval_every_n_steps=0),
])
def test_a_command_survives_the_wire(command):
    line = wire.encode({"token": "t", "id": 7, **command.to_wire()})
    req_id, back = parse_command(wire.decode(line))
    assert req_id == "7" and back == command and type(back) is type(command)


def test_the_wire_form_leaves_out_what_was_not_given():
    assert Stop().to_wire() == {"cmd": "stop", "args": {"save": True}}
    assert Set(generation=GenerationParams(seed=1)).to_wire() == {"cmd": "set", "args": {"generation": {"seed": 1}}}
    assert Generate(prompt="p").args() == {"prompt": "p", "compare_base": False}


def test_the_client_refuses_a_bad_command_before_sending_it(tmp_path):
    client = RunClient(tmp_path / "no-run")  # nothing listens: a refusal cannot come from a server
    with pytest.raises(CommandError, match="set: argument 'lr' must be a number"):
        client.set(lr="fast")
    with pytest.raises(CommandError, match="generate: give exactly one"):
        client.generate()
    with pytest.raises(CommandError, match="unknown argument 'beams'"):
        client.generate("x", beams=2)
    with pytest.raises(CommandError, match="unknown command"):
        client.command("explode")


# -- states ----------------------------------------------------------------------------------------
def test_the_commands_allowed_in_each_state():
    everything = {"generate", "complete", "stop", "save", "evaluate", "set", "status",
                  "rewind", "branch", "snapshot", "branches",
                  "add_source", "set_weight", "remove_source", "teach", "inbox", "forget", "add_reward",
                  "remove_reward", "rate", "rate_chat"}
    assert allowed_commands("running") == everything | {"pause"}
    assert allowed_commands(RunState.PAUSED) == everything | {"resume"}
    assert allowed_commands("starting") == {"status", "stop"}
    assert allowed_commands("stopping") == {"status", "stop"}  # a second stop ends the group at once
    assert allowed_commands("finished") == allowed_commands("failed") == frozenset()
    assert set(ALLOWED_COMMANDS) == set(RunState)
    assert all(names <= set(COMMANDS) for names in ALLOWED_COMMANDS.values())
    assert [s.value for s in RunState if s.final] == ["finished", "failed"]
    with pytest.raises(ValueError):
        allowed_commands("exploded")


def test_state_events_name_only_run_states():
    assert state_event(RunState.PAUSED, step=3).record() == {"type": "state", "state": "paused", "step": 3}
    assert state_event("running").state == RunState.RUNNING
    with pytest.raises(ValueError):
        state_event("sleeping")
    log = [state_event("starting").record(), {"type": "train", "step": 1}, state_event("running").record(),
           {"type": "state", "state": "from-the-future"}]
    assert run_state(log) is RunState.RUNNING and run_state([]) is None
    assert EventType("checkpoint") is EventType.CHECKPOINT


def test_events_are_checked_against_their_models_where_written_and_read(tmp_path):
    from contract.events import EventError, TrainEvent, check_event, parse_event
    from contract.run_folder import EventLog, read_events
    log = EventLog(tmp_path / "events.jsonl")
    log.emit(TrainEvent(step=1, loss=2.5, custom_metric=0.5))  # a monitor's own number rides along
    log.emit({"type": EventType.EVAL, "step": 1, "eval/loss": 2.0})
    for bad, names in (({"type": "trian", "step": 1}, "trian"),
                       ({"type": "train", "step": "one"}, "train event: step"),
                       ({"type": "state", "state": "sleeping"}, "state event: state")):
        with pytest.raises(EventError, match=names):
            log.emit(bad)
    with open(tmp_path / "events.jsonl", "a") as f:  # a line no model matches is skipped by readers
        f.write('{"type": "train", "step": "x"}\n{"type": "a_later_version", "x": 1}\n')
    log.close()
    read = list(read_events(tmp_path / "events.jsonl"))
    assert [e["type"] for e in read] == ["train", "eval", "a_later_version"]
    assert read[0]["custom_metric"] == 0.5 and "time" in read[0]
    assert check_event(TrainEvent(step=2))["type"] == "train"
    assert parse_event({"type": "state", "state": "running"}).state == RunState.RUNNING


# -- the event log's one tailer --------------------------------------------------------------------
def test_the_tailer_numbers_lines_like_the_file_and_waits_for_whole_lines(tmp_path):
    path = tmp_path / "events.jsonl"
    tail, late = EventTail(path), EventTail(path, start_line=2)
    assert tail.poll() == [] and late.poll_numbered() == []  # no file yet
    log = EventLog(path)
    log.emit({"type": "train", "step": 1})
    with open(path, "a") as f:
        f.write("{broken\n")  # skipped, but it keeps its line number
    log.emit({"type": "train", "step": 2})
    with open(path, "a") as f:
        f.write('{"type": "train", "step": 3')  # half written
    assert [e["step"] for e in tail.poll()] == [1, 2]
    assert [(n, e["step"]) for n, e in late.poll_numbered()] == [(2, 2)]
    assert [e["step"] for e in read_events(path)] == [1, 2]
    with open(path, "a") as f:
        f.write("}\n")
    assert [e["step"] for e in tail.poll()] == [3] and tail.poll() == []
    assert [(n, e["step"]) for n, e in late.poll_numbered()] == [(3, 3)]
    assert [e["step"] for e in read_events(path, 2)] == [2, 3]
    log.close()
    lines = path.read_text().splitlines()
    assert json.loads(lines[0])["time"] > 0 and len(lines) == 4


def test_the_tailer_reads_raw_lines_in_bounded_chunks(tmp_path):
    """The control server's use: lines passed on unparsed, a slow reader's backlog read a chunk
    at a time from the file."""
    path = tmp_path / "events.jsonl"
    log = EventLog(path)
    for i in range(100):
        log.emit({"type": "train", "step": i, "pad": "x" * 50})
    log.emit({"type": "train", "step": 100, "pad": "y" * 5000})  # longer than a chunk
    log.close()
    tail, got = EventTail(path, start_line=10), []
    while chunk := tail.read(max_bytes=1000):
        assert sum(len(raw) for _, raw in chunk) < 1000 or len(chunk) == 1
        got += chunk
    assert [n for n, _ in got] == list(range(10, 101))
    assert all(json.loads(raw)["step"] == n for n, raw in got)
    assert tail.read() == [] and tail.line == 101


def test_frames_are_models_on_both_ends_of_the_wire():
    """What the run sends (engine.control.pending.Reply, the server's event feed) is what the client
    parses (supervisor.connection): each kind its model, and a line that is no frame is refused."""

    from contract.protocol.frames import Ack, Done, Error, EventLine, Token, event_frame_bytes, parse_frame
    from contract.protocol.wire import encode
    from engine.control.pending import Reply

    sent: list[dict] = []
    reply = Reply("r-1", sent.append, Status.returns)
    reply.ack(2)
    reply.token("he", "base")
    reply.error("no")
    frames = [parse_frame(json.loads(encode(m))) for m in sent]
    assert frames == [Ack(id="r-1", queued=2), Token(id="r-1", text="he", model="base"), Error(id="r-1", message="no")]
    assert "step" not in sent[1] and sent[2]["id"] == "r-1"  # unset optional fields stay off the wire
    assert parse_frame(Done(id="x", result={"step": 3}).wire()).result == {"step": 3}
    raw = json.dumps({"type": "train", "step": 4}).encode()
    line = parse_frame(json.loads(event_frame_bytes(7, raw)))
    assert isinstance(line, EventLine) and line.line == 7 and line.event["step"] == 4
    for bad in ({"type": "dun", "id": "x"}, {"type": "token", "id": "x"}, {"type": "ack", "queued": -1}):
        with pytest.raises(ProtocolError, match="not a message of the control protocol"):
            parse_frame(bad)
