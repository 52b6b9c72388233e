"""Throughput, MFU, peak memory and chat latency on one GPU: this Trainer against the Hugging Face
Trainer, one script, one table.

    python bench/gpu.py                  # one GPU: Qwen2-0.5B and Llama-3.2-1B shapes, boxed in 8 min
    python bench/gpu.py --tiny           # tiny shapes, on CPU too (the test that keeps it alive)
    python bench/gpu.py --json out.json  # the rows as JSON as well

Models are built from configs with random weights (nothing is downloaded), with a word-level
tokenizer ("t0 t1 ..."), trained on fixed-length random token rows (no padding), micro-batch
`--batch` x `--seq` tokens, one rank. For each model shape:

- ours, full fine-tuning, ZeRO-2, precision auto (bf16 where the GPU has it), started as a user's
  run is (supervisor.launch.spawn -> DeepSpeed launcher -> engine.worker; NCCL on a GPU), its
  control socket open and a client connected; then chats to the live weights mid-training,
  then the same chats with the run paused (no training going on);
- the Hugging Face Trainer on the same model, data and DeepSpeed config (built by our layer),
  through its `deepspeed=` integration;
- the same two with LoRA (ours method=lora; the HF Trainer on the same PEFT model).

tokens/s: real tokens over the wall clock from step `--warmup` to the last timed step (ours: the
event log's step times; the HF Trainer: its step-end callback, the GPU synchronised at both ends).
MFU: 6 x parameters x tokens/s over the GPU's dense bf16 peak (printed; `--peak-tflops` for a GPU
the table below does not know); the 6N rule counts neither attention nor LoRA's saved weight
gradients, so it is a convention to compare with peers, not a count of the work done. Memory: the
CUDA peak of allocated tensor memory (torch.cuda.max_memory_allocated) per run; on CPU the peak
resident set size. Chat: time from sending a chat to its first streamed token, and decoding
tokens/s after it; mid-training, the run's delay per chat (the chat runs at a step boundary,
holding the step) in seconds and in steps.

Each case is time-boxed: after warm-up it is timed for at most `--case-seconds` and `--steps`
steps, and its processes are ended if it overruns (`--start-seconds` to start). Every run of ours
is its own process group; on a GPU each HF Trainer case gets a process of its own too (peaks do
not carry over), on CPU the two share one (start-up time; the test runs this on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from contract.events import EventType  # noqa: E402  (torch-free)
from contract import deepspeed_config

# dense bf16 tensor-core peaks (TFLOP/s, no sparsity), from the vendors' data sheets
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "GH200": 989.0, "A100": 312.0, "A800": 312.0,
               "L40S": 362.0, "L4": 121.0, "A10": 125.0, "RTX 4090": 165.2, "RTX 3090": 71.0}
SHAPES = {
    "Qwen2-0.5B": ("qwen2", dict(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                                 num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                                 max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
                                 tie_word_embeddings=True)),
    "Llama-3.2-1B": ("llama", dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                   num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                                   max_position_embeddings=131072, rope_theta=5e5, rms_norm_eps=1e-5,
                                   tie_word_embeddings=True)),
}
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
CASES = ("full", "hf-full", "lora", "hf-lora")
LABELS = {"full": "ours, full, ZeRO-2", "hf-full": "HF Trainer, full, ZeRO-2", "lora": "ours, LoRA, ZeRO-2",
          "hf-lora": "HF Trainer, LoRA, ZeRO-2", "chat-idle": "chat, no training (paused)",
          "chat-mid": "chat, mid-training"}
LR = {"full": 1e-5, "lora": 1e-4}


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


# -- assets -----------------------------------------------------------------------------------

def make_assets(root: Path, name: str, tiny: bool, seq: int, rows: int) -> tuple[Path, Path]:
    """A model folder (config + word-level tokenizer, no weights: built with the run's seed) and a
    file of `rows` random token rows of `seq` tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, PreTrainedTokenizerFast
    model_type, shape = SHAPES[name]
    shape = {**shape, **TINY} if tiny else shape
    folder = root / name
    AutoConfig.for_model(model_type, **shape, pad_token_id=0, bos_token_id=1, eos_token_id=2).save_pretrained(folder)
    vocab = {f"t{i}": i for i in range(shape["vocab_size"])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="t3"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=core, pad_token="t0", bos_token="t1", eos_token="t2",
                            unk_token="t3").save_pretrained(folder)
    rng = random.Random(0)
    data = root / f"{name}.jsonl"
    with open(data, "w") as f:
        for _ in range(rows):
            f.write(json.dumps({"input_ids": [rng.randrange(4, shape["vocab_size"]) for _ in range(seq)]}) + "\n")
    return folder, data


def run_overrides(a, model: Path, data: Path, method: str, name: str) -> list[str]:
    """Our run config of a case (the HF Trainer gets the DeepSpeed config built from it)."""
    return [f"model.path={model}", f"data.train={data}", "data.format=tokenized", "data.batching=random",
            f"data.max_length={a.seq}", f"max_steps={a.warmup + a.steps + 10_000}", "zero_stage=2", "nproc=1",
            f"batch_size={a.batch}", f"lr={LR[method]}", "optim.scheduler=constant", f"method={method}",
            f"precision={a.precision}", f"model.attn_implementation={a.attn}", "eval.at_end=false",
            "eval.evaluators=[]", "checkpoint.save_at_end=false", "logging.tensorboard=false",
            "logging.progress_bar=false", f"output_dir={a.out}", f"run_name={name}"]


# -- ours: the real entry point, measured from its event log ------------------------------------

def run_ours(a, model: Path, data: Path, method: str, name: str, chat: bool) -> list[dict]:
    """One run of ours; returns its row (and, with `chat`, the two chat rows)."""
    from contract.config.load import load_config
    from contract.run_folder import make_run_folder
    from supervisor.client import RunClient
    from supervisor.launch import spawn
    from supervisor.procs import kill_group

    if left(a) < 30:
        return [{"case": method, "error": f"not run: --total-seconds {a.total_seconds:.0f} reached"}]
    start_s = min(a.start_seconds, left(a))
    cfg = load_config(overrides=run_overrides(a, model, data, method, name))
    folder = make_run_folder(cfg)
    run = spawn(cfg, folder)
    started = time.monotonic()
    rows: list[dict] = []
    try:
        client = RunClient.connect(folder.root, timeout=start_s)
        last = wait_steps(run, folder, a.warmup + a.steps, start_s, min(a.case_seconds, left(a)))
        train = {e["step"]: e for e in read_train(folder.events)}
        rows.append(train_row(method, train, a.warmup, last, setup_of(folder.events)))
        if chat:
            method = "chat-mid"  # what a failure from here on is about
            rows += chat_rows(a, client, folder.events, rows[-1]["step_s"])
        client.stop(save=False)
        run.process.wait(timeout=max(30.0, left(a)))
    except Exception as e:  # noqa: BLE001 - a failed case is a row that says so, not a lost table
        rows.append({"case": method, "error": f"{type(e).__name__}: {e}", "log": log_tail(folder.root)})
    finally:
        if run.process.poll() is None:
            kill_group(run.pid, grace_s=5.0, run_dir=folder.root)
        say(f"{name}: done in {time.monotonic() - started:.0f} s")
    return rows


def wait_steps(run, folder, want: int, start_s: float, case_s: float) -> int:
    """Wait for step `want`, or for `case_s` after the first step; the newest logged step."""
    from contract.run_folder import EventTail
    tail, last, first_at = EventTail(folder.events), 0, None
    deadline = time.monotonic() + start_s
    while last < want:
        if run.process.poll() is not None:
            raise RuntimeError(f"the run ended at step {last} (exit {run.process.returncode})")
        steps = [e["step"] for e in tail.poll() if e.get("type") == EventType.TRAIN.value]
        if steps:
            first_at = first_at or time.monotonic()
            last = max(last, *steps)
        if first_at is not None:
            deadline = first_at + case_s
        if time.monotonic() > deadline:
            if first_at is None:
                raise TimeoutError(f"no step within {start_s:.0f} s of the start")
            break
        time.sleep(0.1)
    return last


def read_train(events: Path, kind: EventType = EventType.TRAIN) -> list[dict]:
    """The run's events of type `kind` (its training records by default)."""
    from contract.run_folder import read_events
    return [e for e in read_events(events) if e.get("type") == kind.value]


def setup_of(events: Path) -> dict:
    return read_train(events, EventType.SETUP)[0]


def train_row(method: str, train: dict, first: int, last: int, setup: dict) -> dict:
    if last <= first + 1:
        raise RuntimeError(f"only {last} steps in the time box (warm-up {first}): nothing to time")
    tokens = sum(train[s]["tokens"] for s in range(first + 1, last + 1))
    return {"case": method, "tokens_per_s": tokens / (train[last]["time"] - train[first]["time"]),
            "peak_mib": max(e.get("mem_peak_mb", e.get("mem_mb", 0.0)) for e in train.values()),
            "parameters": setup["parameters"], "trainable": setup["trainable_parameters"],
            "precision": setup["precision"], "steps": last - first,
            "step_s": statistics.median(train[s]["time"] - train[s - 1]["time"] for s in range(first + 1, last + 1))}


def chat_rows(a, client, events: Path, step_s: float) -> list[dict]:
    """Chats at a random moment of a step while training, then the same chats paused. The run's
    delay per chat: the chat phase's wall time beyond its steps at the median step time."""
    before = max(e["step"] for e in read_train(events))
    mid = []
    for _ in range(a.chats):
        time.sleep(random.uniform(0, step_s))
        mid.append(one_chat(a, client))
    t1 = time.time()
    steps = {e["step"]: e["time"] for e in read_train(events)}
    after = [s for s, t in steps.items() if t >= t1]
    while not after:  # the first step after the chats
        time.sleep(0.05)
        steps = {e["step"]: e["time"] for e in read_train(events)}
        after = [s for s, t in steps.items() if t >= t1]
    end = min(after)
    delay = ((steps[end] - steps[before]) - (end - before) * step_s) / a.chats
    client.pause()
    idle = [one_chat(a, client) for _ in range(a.chats)]
    client.resume()
    return [chat_row("chat-idle", idle, None, step_s), chat_row("chat-mid", mid, delay, step_s)]


def one_chat(a, client) -> tuple[float, float, int]:
    """(first-token seconds, decode seconds after it, tokens) of one chat, sampled (seeded): a
    random model's greedy answer is often its special tokens, which decode to nothing."""
    prompt = " ".join(f"t{4 + i}" for i in range(16))
    sent = time.perf_counter()
    first = None
    gen = client.generate(prompt, max_new_tokens=a.chat_tokens, temperature=1.0, seed=0)
    for _ in gen:
        first = first or time.perf_counter()
    end = time.perf_counter()
    first = first or end
    return first - sent, end - first, len(gen.result.text.split())


def chat_row(case: str, chats: list, delay: float | None, step_s: float) -> dict:
    tokens = sum(n for _, _, n in chats)
    decode = sum(d for _, d, _ in chats)
    return {"case": case, "first_token_s": statistics.median(f for f, _, _ in chats),
            "tokens_per_s": (tokens - len(chats)) / decode if decode > 0 and tokens > len(chats) else float("nan"),
            "tokens": tokens, "delay_s": delay, "step_s": step_s}


def left(a) -> float:
    """Seconds left of the whole benchmark's time box."""
    return a.deadline - time.monotonic()


def log_tail(root: Path) -> str:
    logs = sorted((root / "logs").glob("*.log")) if (root / "logs").is_dir() else []
    return "".join(p.read_text(errors="replace")[-1500:] for p in logs)


# -- the Hugging Face Trainer: a child process per case -------------------------------------------

def run_hf(a, model: Path, data: Path, cases: list[str]) -> list[dict]:
    """The HF Trainer cases in one child process (its RESULT lines), ended if it overruns."""
    from supervisor.launch import free_port
    cmd = [sys.executable, __file__, "--hf-child", "--model", str(model), "--data", str(data),
           *[x for c in cases for x in ("--case", c)], *child_args(a)]
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))  # carried wheels too
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": path,
           "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    if left(a) < 30:
        return [{"case": c, "error": f"not run: --total-seconds {a.total_seconds:.0f} reached"} for c in cases]
    limit = min(len(cases) * (a.start_seconds + a.case_seconds), left(a))
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=limit)
        out, err = proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
        out, err = (e.stdout or b"").decode(errors="replace"), f"timed out after {limit:.0f} s"
    rows = [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
    done = {r["case"] for r in rows}
    return rows + [{"case": c, "error": "no result", "log": (out + err)[-2000:]} for c in cases if c not in done]


def child_args(a) -> list[str]:
    return ["--seq", str(a.seq), "--batch", str(a.batch), "--steps", str(a.steps), "--warmup", str(a.warmup),
            "--case-seconds", str(a.case_seconds), "--precision", a.precision, "--attn", a.attn,
            "--out", str(a.out)]


def hf_child(a) -> None:
    """Each --case in turn: the HF Trainer on our model, data and DeepSpeed config."""
    import deepspeed
    import torch
    cuda = torch.cuda.is_available()
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")  # as HF's own launch would
    for case in a.case:
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        else:
            reset_peak_rss()
        try:
            row = hf_case(a, case.removeprefix("hf-"), case)
        except Exception as e:  # noqa: BLE001 - the next case still runs; this one's row says why
            row = {"case": case, "error": f"{type(e).__name__}: {e}", "log": traceback.format_exc()[-3000:]}
        print("RESULT " + json.dumps(row), flush=True)


def hf_case(a, method: str, case: str) -> dict:
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from contract.config.load import load_config
    from engine.parallel import ds_config
    from engine.model import methods
    from engine.data import PaddingCollator, build_dataset
    from engine.model.loading import build_model, count_parameters, hidden_size, load_tokenizer
    from engine.monitors import peak_rss_mb

    cuda = torch.cuda.is_available()
    cfg = load_config(overrides=run_overrides(a, a.model, a.data, method, f"hf-{method}"))
    precision = ds_config.resolve_precision(cfg.train.precision)
    steps = a.warmup + a.steps
    ds = deepspeed_config.build_ds_config(cfg, world_size=1, dp_size=1, total_steps=steps, warmup_steps=0,
                                   hidden_size=hidden_size(a.model), precision=precision).config
    model = build_model(a.model, seed=cfg.train.seed, precision=precision, attn_implementation=a.attn)
    if method == "lora":
        model = methods.wrap_with_adapter(model, cfg)
    total, trainable = count_parameters(model)
    tok = load_tokenizer(a.model)
    dataset, _ = build_dataset(str(a.data), tok, format="tokenized", max_length=a.seq)
    rows = [{"input_ids": x["input_ids"], "labels": x["labels"]} for x in dataset]
    collate, clock = PaddingCollator(tok), {"tokens": [], "times": []}

    def counting_collate(items):
        batch = collate(items)
        clock["tokens"].append(int(batch["attention_mask"].sum()))
        return batch

    class Clock(TrainerCallback):
        """Step-end times; the GPU synchronised at the window's ends (HF keeps the loss on the
        GPU between logging steps, so its steps would otherwise end before their kernels do)."""
        started = None

        def on_step_end(self, args, state, control, **kw):
            if cuda and state.global_step in (a.warmup, steps):
                torch.cuda.synchronize()
            clock["times"].append(time.perf_counter())
            if state.global_step == a.warmup:
                self.started = time.monotonic()
            elif self.started is not None and time.monotonic() - self.started > a.case_seconds:
                if cuda:
                    torch.cuda.synchronize()
                    clock["times"][-1] = time.perf_counter()
                control.should_training_stop = True

    args = TrainingArguments(output_dir=str(Path(a.out) / f"hf-{method}"), per_device_train_batch_size=a.batch,
                             max_steps=steps, learning_rate=LR[method], lr_scheduler_type="constant",
                             bf16=precision == "bf16", fp16=precision == "fp16", deepspeed=ds,
                             logging_steps=10**6, save_strategy="no", report_to=[], optim="adamw_torch",
                             dataloader_num_workers=0, use_cpu=not cuda, seed=cfg.train.seed)
    trainer = Trainer(model=model, args=args, train_dataset=_Rows(rows), data_collator=counting_collate,
                      callbacks=[Clock()])
    trainer.train()
    times, last = clock["times"], len(clock["times"])
    tokens = sum(clock["tokens"][a.warmup:last])
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else peak_rss_mb()
    return {"case": case, "tokens_per_s": tokens / (times[last - 1] - times[a.warmup - 1]), "peak_mib": peak,
            "parameters": total, "trainable": trainable, "precision": precision, "steps": last - a.warmup,
            "step_s": statistics.median(b - c for b, c in zip(times[a.warmup:], times[a.warmup - 1:]))}


class _Rows:
    """A list of rows as a map-style dataset (the HF Trainer samples it at random)."""

    def __init__(self, rows: list[dict]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


def reset_peak_rss() -> None:
    """Start the kernel's high-water mark of this process's memory afresh (Linux)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


# -- the table ----------------------------------------------------------------------------------

def device_facts(peak_override: float | None) -> dict:
    import torch
    if not torch.cuda.is_available():
        return {"device": f"CPU ({os.cpu_count()} cores)", "peak_tflops": None, "cuda": False}
    name = torch.cuda.get_device_name()
    known = [v for k, v in sorted(PEAK_TFLOPS.items(), key=lambda kv: -len(kv[0])) if k in name]
    return {"device": name, "peak_tflops": peak_override or (known[0] if known else None), "cuda": True,
            "torch": torch.__version__, "bf16": torch.cuda.is_bf16_supported()}


def finish_rows(rows: list[dict], facts: dict) -> list[dict]:
    """MFU and the ratio against the HF Trainer's same case."""
    by_case = {r["case"]: r for r in rows}
    for r in rows:
        hf = by_case.get(f"hf-{r['case']}")
        if r["case"] in ("full", "lora") and hf and "error" not in hf and "error" not in r:
            r["x_hf"] = r["tokens_per_s"] / hf["tokens_per_s"]
        if "parameters" in r and facts["peak_tflops"]:
            r["mfu"] = 6 * r["parameters"] * r["tokens_per_s"] / (facts["peak_tflops"] * 1e12)
    return rows


def print_table(results: dict[str, list[dict]], facts: dict, a) -> None:
    peak = f"{facts['peak_tflops']:.0f} TFLOP/s dense bf16" if facts["peak_tflops"] else "n/a"
    print(f"\n{facts['device']}; peak used for MFU: {peak}; micro-batch {a.batch} x {a.seq} tokens, "
          f"{a.warmup} warm-up steps, then up to {a.steps} steps / {a.case_seconds:.0f} s per case; "
          f"attention {a.attn}\n")
    print("| model | run | precision | tokens/s | MFU | peak memory (MiB) | x HF Trainer | notes |")
    print("|---|---|---|---|---|---|---|---|")
    for model, rows in results.items():
        for r in rows:
            print(table_line(model, r))


def table_line(model: str, r: dict) -> str:
    label = LABELS.get(r["case"], r["case"])
    if "error" in r:
        return f"| {model} | {label} | | failed | | | | {r['error'][:120]} |"
    if r["case"].startswith("chat"):
        note = f"first token {r['first_token_s'] * 1e3:.0f} ms, {r['tokens']} tokens"
        if r.get("delay_s") is not None:
            note += f"; run delayed {r['delay_s']:.2f} s per chat = {r['delay_s'] / r['step_s']:.1f} steps"
        return f"| {model} | {label} | | {r['tokens_per_s']:.1f} (decode) | | | | {note} |"
    mfu = f"{r['mfu']:.1%}" if "mfu" in r else "n/a"
    ratio = f"{r['x_hf']:.2f}" if "x_hf" in r else ""
    note = f"{r['steps']} steps timed, {r['step_s'] * 1e3:.0f} ms/step, {r['trainable'] / 1e6:.1f}M of " \
           f"{r['parameters'] / 1e6:.1f}M parameters trained"
    return f"| {model} | {label} | {r['precision']} | {r['tokens_per_s']:.0f} | {mfu} | {r['peak_mib']:.0f} | " \
           f"{ratio} | {note} |"


def parse_args(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU; the test)")
    p.add_argument("--models", default=",".join(SHAPES), help="which shapes, comma-separated")
    p.add_argument("--seq", type=int, default=None, help="tokens per row (1024; tiny 32)")
    p.add_argument("--batch", type=int, default=None, help="rows per micro-batch (16; tiny 4)")
    p.add_argument("--steps", type=int, default=None, help="most timed steps per case (30; tiny 4)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (5; tiny 2)")
    p.add_argument("--case-seconds", type=float, default=None, help="most timed seconds per case (40; tiny 60)")
    p.add_argument("--start-seconds", type=float, default=180.0, help="most seconds a case may take to start")
    p.add_argument("--total-seconds", type=float, default=480.0,
                   help="the whole run's time box: cases that would start later are not run")
    p.add_argument("--chats", type=int, default=None, help="chats mid-training and paused (4; tiny 2)")
    p.add_argument("--chat-tokens", type=int, default=None, help="new tokens per chat (32; tiny 8)")
    p.add_argument("--precision", default="auto")
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "eager", "flash_attention_2"])
    p.add_argument("--peak-tflops", type=float, default=None, help="the GPU's dense bf16 peak, if not known")
    p.add_argument("--json", default=None, help="also write the rows to this file")
    p.add_argument("--out", default=None, help="folder for the runs (a temporary one by default)")
    p.add_argument("--hf-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--case", action="append", default=[], help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    defaults = dict(seq=(32, 1024), batch=(4, 16), steps=(4, 30), warmup=(2, 5), case_seconds=(60.0, 40.0),
                    chats=(2, 4), chat_tokens=(8, 32))
    for key, (tiny, full) in defaults.items():
        if getattr(a, key) is None:
            setattr(a, key, tiny if a.tiny else full)
    return a


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    if a.hf_child:
        hf_child(a)
        os._exit(0)  # no interpreter teardown: gloo / NCCL threads can hang a normal exit
    random.seed(0)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    facts = device_facts(a.peak_tflops)
    say(f"device: {facts['device']}")
    results: dict[str, list[dict]] = {}
    began = time.monotonic()
    a.deadline = began + a.total_seconds
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp:
        a.out = Path(a.out or tmp)
        for name in a.models.split(","):
            model, data = make_assets(a.out / "assets", name, a.tiny, a.seq,
                                      rows=a.batch * (a.warmup + a.steps + 100))
            say(f"{name}: ours, full fine-tuning, then chats")
            rows = run_ours(a, model, data, "full", f"{name}-full", chat=True)
            say(f"{name}: ours, LoRA")
            rows += run_ours(a, model, data, "lora", f"{name}-lora", chat=False)
            for group in ([["hf-full"], ["hf-lora"]] if facts["cuda"] else [["hf-full", "hf-lora"]]):
                say(f"{name}: HF Trainer, {' and '.join(group)}")
                rows += run_hf(a, model, data, group)
            results[name] = finish_rows(order(rows), facts)
            for r in results[name]:
                say(table_line(name, r))
                if "log" in r:  # the whole reason, for a run on a machine held for minutes
                    print(r["log"][-3000:], flush=True)
    print_table(results, facts, a)
    say(f"total {time.monotonic() - began:.0f} s")
    if a.json:
        Path(a.json).write_text(json.dumps({"facts": facts, "results": results}, indent=1, default=str))


def order(rows: list[dict]) -> list[dict]:
    rank = {c: i for i, c in enumerate(("full", "hf-full", "lora", "hf-lora", "chat-idle", "chat-mid"))}
    return sorted(rows, key=lambda r: rank.get(r["case"], 99))


if __name__ == "__main__":
    main()
