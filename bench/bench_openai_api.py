"""What the OpenAI-compatible API costs, on a 2-rank ZeRO-3 run of the tiny default model. By hand:

    .venv/bin/python bench/bench_openai_api.py [--steps 300] [--requests 12]

1. First token: a streamed chat through the API (the `openai` client, supervisor.openai_api)
   against the same request through the control plane's own client (RunClient.generate), on the
   same run at the same moments (alternating, mid-training), medians (target: at most 1.2x).
2. Training tokens/s while one `openai` client keeps streaming chats, against the same run with
   no client (two runs one after the other, never at once; target: at least 0.95x), and, for
   reference, while the control plane's own client streams the same chats: each chat is a
   generation at a step boundary, so what it costs is the generation's, API or not.
3. lm-evaluation-harness wall time for the tests' small task (tests/lm_eval_task) through the
   live API (the run paused) against its own `hf` model on the same weights, exported.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from openai import OpenAI  # noqa: E402

from bench_control import WINDOW_SKIP, reach_step, throughput  # noqa: E402
from control_runs import launch, task_files, wait_exit  # noqa: E402
from supervisor.client import RunClient  # noqa: E402
from supervisor.openai_api import ApiServer, key_of  # noqa: E402
from supervisor.procs import kill_group  # noqa: E402

PROMPT = "reverse: planet\n"
ZERO3 = ("zero_stage=3",)


def api_first_token_s(api: OpenAI, model: str) -> float:
    started = time.perf_counter()
    first = None
    for chunk in api.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=0,
                                        stream=True):
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.perf_counter()
    return (first or time.perf_counter()) - started


def client_first_token_s(client: RunClient) -> float:
    started = time.perf_counter()
    first = None
    for _ in client.generate(PROMPT, max_new_tokens=8, temperature=1.0, seed=0):
        first = first or time.perf_counter()
    return (first or time.perf_counter()) - started


def quiet_tps(tmp: Path, task: dict, steps: int) -> float:
    run = launch(tmp, "quiet", task, *ZERO3, f"max_steps={steps + 100000}")
    reach_step(run, steps)
    tps = throughput(run, WINDOW_SKIP, steps)
    kill_group(run.process.pid)
    run.process.wait(timeout=60)
    return tps


def served_run(tmp: Path, task: dict, steps: int, requests: int) -> dict:
    run = launch(tmp, "served", task, *ZERO3, f"max_steps={steps + 100000}")
    server = ApiServer(tmp / "runs").start()
    client = RunClient.connect(run.folder.root, timeout=300)
    api = OpenAI(base_url=server.url, api_key=key_of(run.folder.root), max_retries=0)
    messages = [{"role": "user", "content": PROMPT}]

    def through_api() -> None:
        for _ in api.chat.completions.create(model="served", max_tokens=16, stream=True, messages=messages):
            pass

    def through_client() -> None:
        for _ in client.generate(messages=messages, max_new_tokens=16):
            pass

    reach_step(run, WINDOW_SKIP)
    streams = streaming_window(run, through_api, steps)
    tps = throughput(run, WINDOW_SKIP, steps)
    client_streams = streaming_window(run, through_client, 2 * steps - WINDOW_SKIP)
    client_tps = throughput(run, steps, 2 * steps - WINDOW_SKIP)
    through_api, through_client = [], []
    for _ in range(requests):
        through_api.append(api_first_token_s(api, "served"))
        through_client.append(client_first_token_s(client))
    client.pause()
    saved = client.save()
    result = {"tps": tps, "streams": streams, "client_tps": client_tps, "client_streams": client_streams,
              "api": statistics.median(through_api),
              "client": statistics.median(through_client), **lm_eval_times(tmp, server, run, saved, api)}
    client.stop(save=False)
    wait_exit(run, timeout=600)
    server.close()
    return result


def streaming_window(run, stream_once, until_step: int) -> int:
    """Stream chats one after another until the run reaches `until_step`; how many."""
    count, stop = [0], threading.Event()

    def loop() -> None:
        while not stop.is_set():
            stream_once()
            count[0] += 1

    streamer = threading.Thread(target=loop, daemon=True)
    streamer.start()
    reach_step(run, until_step)
    stop.set()
    streamer.join()
    return count[0]


def lm_eval_times(tmp: Path, server: ApiServer, run, saved: dict, api: OpenAI) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from test_openai_api import _evaluate  # the tests' task and settings
    from engine.checkpoint.export import export
    exported = tmp / "exported"
    export(saved["checkpoint"], str(exported))
    os.environ["OPENAI_API_KEY"] = key_of(run.folder.root)
    started = time.perf_counter()
    _evaluate("local-completions", {"base_url": f"{server.url}/completions", "model": "served",
                                    "tokenizer": str(exported), "tokenizer_backend": "huggingface",
                                    "add_bos_token": True, "max_length": 256})
    live = time.perf_counter() - started
    started = time.perf_counter()
    _evaluate("hf", {"pretrained": str(exported), "dtype": "float32"})
    return {"lm_eval_api_s": live, "lm_eval_hf_s": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--requests", type=int, default=12)
    args = parser.parse_args()
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-openai-") as tmp_dir:
        tmp = Path(tmp_dir)
        task = task_files(tmp / "task")
        quiet = quiet_tps(tmp, task, args.steps)
        served = served_run(tmp, task, args.steps, args.requests)
    print(f"\nOpenAI-compatible API: 2 ranks ZeRO-3, tiny default model, {args.steps} steps, load average "
          f"{load:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"first token (median of {args.requests}): API {served['api'] * 1e3:.1f} ms, control plane "
          f"{served['client'] * 1e3:.1f} ms, ratio {served['api'] / served['client']:.3f} (target <= 1.2)")
    print(f"training tokens/s: {served['tps']:.0f} with a client streaming ({served['streams']} chats) vs "
          f"{quiet:.0f} without, ratio {served['tps'] / quiet:.3f} (target >= 0.95)")
    print(f"  the same chats through the control plane's own client ({served['client_streams']}): "
          f"{served['client_tps']:.0f} tokens/s, ratio {served['client_tps'] / quiet:.3f} (what generating "
          "at every boundary costs, API or not)")
    print(f"lm-evaluation-harness, tests/lm_eval_task: {served['lm_eval_api_s']:.1f} s through the live API, "
          f"{served['lm_eval_hf_s']:.1f} s with its hf model on the export")


if __name__ == "__main__":
    main()
