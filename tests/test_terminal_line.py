"""The terminal's live line and its end (app.cli_live, app.cli_summary), without a run: the
events a run writes are fed to the terminal's own event reader (app.cli._Shown) and its progress
display is rendered by rich at 110, 80 and 50 columns. The bar stays, every value has its label,
the least useful values go first, a preference run shows its reward accuracy and margin. The end
of a finished run sums it up: steps, final metrics, the final model and the checkpoints."""

from __future__ import annotations

import io
import json

from rich.console import Console

from app.cli import _Shown, report
from app.cli_live import live_progress
from app.cli_summary import end_summary
from contract.run_folder import RunFolder
from supervisor import RunManager

DPO_STEP = {"type": "train", "step": 12, "epoch": 1, "total_steps": 100, "loss": 0.6931, "lr": 5e-6,
            "tokens_per_s": 1234.5, "rewards/chosen": 0.21, "rewards/rejected": -0.21,
            "rewards/accuracies": 0.75, "rewards/margins": 0.42, "logps/chosen": -12.0}
EVAL = {"type": "eval", "step": 10, "eval/loss": 0.9, "eval/rewards/accuracies": 0.5, "eval/exact_match": 0.0}


def _line(width: int, events: list[dict]) -> str:
    """The live line as a terminal `width` columns wide shows it after `events`."""
    console = Console(width=width, file=io.StringIO(), force_terminal=True, color_system=None, record=True)
    progress = live_progress(console)
    shown = _Shown(progress, progress.add_task("starting", total=None))
    for event in events:
        shown.event(event)
    console.print(progress.get_renderable())
    text = console.export_text()
    lines = text.rstrip("\n").split("\n")
    assert len(lines) == 1, text  # one line, never wrapped
    return lines[0]


def test_the_line_keeps_the_bar_and_labels_every_value_at_110_and_80_columns():
    setup = {"type": "setup", "total_steps": 100}
    wide = _line(110, [setup, DPO_STEP, EVAL])
    assert len(wide) <= 110 and "━" * 10 in wide and "12/100" in wide, wide
    for label in ("loss 0.6931", "reward acc 75%", "margin +0.420", "eval loss 0.9", "lr 5.0e-06", "tok/s 1234"):
        assert label in wide, (label, wide)
    assert wide.count("loss") == 2  # the step's and the evaluation's, each with its label

    narrow = _line(80, [setup, DPO_STEP, EVAL])
    assert len(narrow) <= 80 and "━" * 10 in narrow and "12/100" in narrow, narrow
    for label in ("loss 0.6931", "reward acc 75%", "margin +0.420"):  # the objective's own values stay
        assert label in narrow, (label, narrow)
    assert "tok/s" not in narrow and "eval exact_match" not in narrow  # the least useful went first
    assert "elapsed" not in narrow

    tiny = _line(50, [setup, DPO_STEP, EVAL])
    assert len(tiny) <= 50 and "━" * 10 in tiny and "loss 0.6931" in tiny, tiny


def test_an_sft_line_and_a_grpo_line():
    sft = _line(110, [{"type": "train", "step": 3, "epoch": 0, "total_steps": 30, "loss": 2.5, "lr": 1e-3,
                       "tokens_per_s": 900.0}])
    assert "loss 2.5000" in sft and "reward" not in sft and "margin" not in sft and "3/30" in sft, sft
    grpo = _line(80, [{"type": "train", "step": 4, "total_steps": 8, "loss": 0.01, "reward": 0.5, "kl": 0.002}])
    assert "reward 0.500" in grpo and "loss 0.0100" in grpo, grpo


def _write(folder: RunFolder, events: list[dict]) -> None:
    folder.events.write_text("".join(json.dumps(e) + "\n" for e in events))


def test_the_end_of_a_finished_run_sums_it_up(tmp_path, capsys):
    folder = RunFolder(tmp_path / "runs" / "dpo").create()
    ckpt = folder.checkpoints
    _write(folder, [
        {"type": "state", "state": "starting"}, {"type": "train", "step": 1, "loss": 9.0},
        {"type": "state", "state": "failed", "error": "an earlier life"},
        {"type": "state", "state": "starting"}, {"type": "setup", "total_steps": 20},
        {**DPO_STEP, "step": 10, "total_steps": 20},
        {"type": "checkpoint", "step": 10, "path": f"file://{ckpt / 'step-10'}"},
        EVAL, {**DPO_STEP, "step": 20, "total_steps": 20, "loss": 0.5},
        {"type": "checkpoint", "step": 20, "path": f"file://{ckpt / 'step-20'}"},
        {"type": "checkpoint_deleted", "step": 20, "names": ["step-10"]},
        {"type": "export", "kind": "model", "path": str(folder.model), "step": 20},
        {"type": "state", "state": "finished", "step": 20}])
    lines = end_summary(folder)
    assert lines[0] == "steps: 20 of 20 (epoch 1)", lines
    assert lines[1] == "final: loss 0.5000  reward acc 75%  margin +0.420  (step 20)", lines
    assert lines[2].startswith("eval at step 10: eval loss 0.9") and "eval exact_match 0" in lines[2], lines
    assert f"final model: {folder.model} (Hugging Face format)" in lines
    assert f"checkpoints: {ckpt} (step-20)" in lines

    # through the terminal's own ending (report), after `finished: <folder>`
    assert report(RunManager(tmp_path / "runs").get("dpo")) == 0
    err = capsys.readouterr().err
    assert f"finished: {folder.root}" in err and "final: loss 0.5000" in err and "step-20" in err, err

    # nothing saved: said so, not left out
    _write(folder, [{"type": "state", "state": "starting"}, {"type": "train", "step": 2, "loss": 1.0},
                    {"type": "state", "state": "finished", "step": 2}])
    lines = end_summary(folder)
    assert "steps: 2 (epoch ?)" in lines and any(line.startswith("final model: not saved") for line in lines)
    assert "checkpoints: none kept" in lines
