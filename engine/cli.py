"""Terminal entry point: `./launch.sh train [CONFIG.yaml] [key=value ...]`.

parse the config -> make the run folder -> start the ranks as a supervised process group ->
follow events.jsonl with a progress bar -> exit 0, or non-zero with the reason.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from contract import presets
from contract.config import ConfigError, load_config
from supervisor.launch import kill_group, make_run_folder, spawn
from contract.run_folder import EventTail, tail_lines

console = Console(stderr=True)


def parse_train_args(argv: list[str]):
    config_path = None
    overrides = []
    for arg in argv:
        if "=" not in arg and config_path is None:
            config_path = arg
        else:
            overrides.append(arg)
    data = None if config_path else presets.DEFAULT
    return load_config(config_path, overrides, data=data)


TRAIN_HELP = """usage: ./launch.sh train [CONFIG.yaml] [key=value ...]

Train from the terminal. No config: the embedded default task. Overrides are dotted field names
(optim.lr=1e-4, data.train=my.jsonl) or the short names:
  {shortcuts}
Every field, its type and its meaning: README.md, "Run config" (contract/config.py declares them).
Paths are read relative to the directory the command is typed in."""


def train(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        from contract.config import SHORTCUTS
        print(TRAIN_HELP.format(shortcuts="\n  ".join(f"{k:<11} {v}" for k, v in SHORTCUTS.items())))
        return 0
    try:
        cfg = parse_train_args(argv)
    except ConfigError as e:
        console.print(f"[red]{e}[/red]")
        return 2
    folder = make_run_folder(cfg)
    console.print(f"run folder: {folder.root}")
    run = spawn(cfg, folder)
    try:
        return follow(run)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: stopping every rank ...[/yellow]")
        kill_group(run.pid)
        return 130


def follow(run) -> int:
    """Render progress from the event log until the launcher exits; report failures."""
    tail = EventTail(run.folder.events)
    failed = None
    columns = [TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[metrics]}"), TimeElapsedColumn(), TimeRemainingColumn()]
    with Progress(*columns, console=console, transient=False,
                  disable=not console.is_terminal) as progress:
        task = progress.add_task("starting", total=None, metrics="")
        metrics: dict[str, str] = {}
        while True:
            for event in tail.poll():
                kind = event.get("type")
                if kind == "setup":
                    progress.update(task, description="training", total=event["total_steps"])
                    for w in event.get("warnings", []):
                        progress.console.print(f"[yellow]warning: {w}[/yellow]")
                elif kind == "train":
                    metrics.update(loss=f"loss {event['loss']:.4f}", lr=f"lr {event['lr']:.2e}",
                                   tps=f"{event.get('tokens_per_s', 0):.0f} tok/s")
                    progress.update(task, completed=event["step"], total=event.get("total_steps"),
                                    description=f"epoch {event['epoch']}")
                elif kind == "eval":
                    shown = {k: v for k, v in event.items() if k.startswith("eval/")}
                    text = "  ".join(f"{k[5:]} {v:.4g}" for k, v in shown.items())
                    metrics["eval"] = text
                    progress.console.print(f"step {event['step']} eval: {text}")
                elif kind == "state" and event.get("state") == "failed":
                    failed = event.get("error", "failed")
                if not console.is_terminal and kind == "train":
                    console.print(f"step {event['step']}/{event.get('total_steps')} {metrics['loss']}")
                progress.update(task, metrics="  ".join(metrics.values()))
            code = run.process.poll()
            if code is not None:
                for event in tail.poll():
                    if event.get("type") == "state" and event.get("state") == "failed":
                        failed = event.get("error")
                break
            time.sleep(0.25)
    if code != 0 or failed:
        console.print(f"[red]run failed{': ' + failed if failed else f' (exit code {code})'}[/red]")
        for log in sorted(run.folder.logs.glob("rank*.log")) or [run.folder.logs / "launcher.log"]:
            console.print(f"[dim]--- last lines of {log.name} ---[/dim]")
            console.print("\n".join(tail_lines(log, 15)), markup=False, highlight=False)
        return code or 1
    console.print(f"[green]finished[/green]: {run.folder.root}")
    return 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="launch.sh", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["train"])
    parser.add_argument("args", nargs=argparse.REMAINDER, help="CONFIG.yaml and/or key=value overrides")
    ns = parser.parse_args(argv)
    sys.exit(train(ns.args))


if __name__ == "__main__":
    main()
