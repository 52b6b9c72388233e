"""`./launch.sh command RUN_FOLDER NAME [key=value ...]`: send one command of the protocol
(contract.protocol: pause, resume, save, evaluate, set, status, rewind, branch, snapshot,
branches, add_source, set_weight, remove_source, teach, inbox, forget, and a GRPO run's
add_reward, remove_reward, rate) to a running run through
the one Python client (supervisor.client.RunClient.command), and print its answer as JSON. The
values are JSON (lr=1e-4, save=false, stop='["a"]'; anything else is a string), checked by the
command's model: a bad one gets the same words as in the web app, the notebook and Python.
`export_gguf target=DIR [dtype=f16]` is the client's verb of that name: the live model, saved at
the next step boundary, as a GGUF file with its Ollama Modelfile in DIR."""

from __future__ import annotations

import json
from typing import Any

from supervisor.client import CommandError, RunClient, RunGone

USAGE = "usage: ./launch.sh command RUN_FOLDER NAME [key=value ...]"


def command(argv: list[str], say: Any) -> int:
    """Send the command and print its answer (exit 0), or say why not (exit 2: refused or bad
    input; 1: the run is not there)."""
    if len(argv) < 2 or any("=" not in a for a in argv[2:]):
        say(USAGE, "red")
        return 2
    folder, name = argv[0], argv[1]
    args = dict(_value(a) for a in argv[2:])
    client = RunClient(folder, connect_timeout=10.0)
    try:
        if name == "export_gguf":  # a verb of the client (save, then convert), not one command
            if "target" not in args or set(args) - {"target", "dtype"}:
                say("usage: ./launch.sh command RUN_FOLDER export_gguf target=DIR [dtype=f16]", "red")
                return 2
            say(client.export_gguf(str(args["target"]), str(args.get("dtype", "f16"))))
            return 0
        answer = client.command(name, **args)
    except CommandError as e:
        say(str(e), "red")
        return 2
    except (RunGone, TimeoutError, OSError) as e:
        say(str(e), "red")
        return 1
    finally:
        client.close()
    say(json.dumps(answer.wire(), indent=2))
    return 0


def _value(pair: str) -> tuple[str, Any]:
    key, _, text = pair.partition("=")
    try:
        return key, json.loads(text)
    except ValueError:
        return key, text
