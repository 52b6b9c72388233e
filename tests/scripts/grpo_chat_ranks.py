"""A GRPO run on the launcher's 2 ranks (ZeRO-3: the chat and the fresh samples are collective
generations) rates a chat answer: the chat answers at step 1's boundary, the answer is rated up at
step 2's, step 3 trains its group; then a second Trainer in the same process group resumes from
step 2's checkpoint and trains step 3 again. Rank 0 reports the replies and both runs' train
records (tests/test_grpo_chat_rating_ranks.py)."""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dist_utils import report  # noqa: E402

PROMPT = "reverse: abc\n"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--local_rank", type=int, default=0)
    a = p.parse_args()
    replies: dict = {}
    first = train(a, "a", replies)
    again = train(a, "b", {}, f"resume={first}/checkpoints/step-2")
    if replies:  # rank 0
        report(replies=replies, first=records(first), again=records(again))


def train(a, name: str, replies: dict, *extra: str) -> Path:
    from contract.config.load import load_config
    from contract.protocol.commands import Generate
    from contract.protocol.rating_commands import RateChat
    from engine.callbacks import Callback
    from engine.control.pending import Reply
    from engine.trainer import Trainer

    def said() -> str:
        return replies["1"]["result"]["text"]

    commands = {1: lambda: Generate(prompt=PROMPT, max_new_tokens=6, temperature=1.0, seed=5),
                2: lambda: RateChat(prompt=PROMPT, answer=said(), score="up", step=1)} if name == "a" else {}

    class Send(Callback):
        def on_train_batch_end(self, trainer, loss):
            step = trainer.state.global_step
            if trainer.env.rank == 0 and step in commands:
                cmd = commands[step]()
                trainer.control.commands.put(str(step), cmd, Reply(str(step), lambda f, s=str(step): replies.update({s: f}),
                                                                    cmd.returns))

    cfg = load_config(overrides=[
        f"output_dir={a.out}", f"run_name={name}", "nproc=2", "zero_stage=3", "max_steps=3", "batch_size=2",
        "precision=fp32", "train.seed=3", f"model.path={a.model}", f"data.train={a.data}", "data.max_length=40",
        "eval.every_n_steps=0", "logging.tensorboard=false", "lr=5e-3", "optim.scheduler=constant",
        "checkpoint.every_n_steps=1", "checkpoint.keep_last=0", "checkpoint.save_at_end=false",
        "control.enabled=true", "objective=grpo", "grpo.num_generations=4", "grpo.max_completion_length=4",
        "grpo.loss_type=grpo", "grpo.rewards=[{kind: exact_match, column: answer}]", *extra])
    trainer = Trainer(config=cfg, callbacks=[Send()])
    trainer.train()
    trainer.close()
    return Path(a.out) / name


def records(folder: Path) -> dict:
    lines = [json.loads(x) for x in (folder / "events.jsonl").read_text().splitlines() if x.strip()]
    return {str(e["step"]): {k: v for k, v in e.items() if k == "loss" or k.startswith(("reward", "completions"))}
            for e in lines if e.get("type") == "train"}


if __name__ == "__main__":
    from script_exit import exit_now
    main()
    exit_now()
