"""The terminal front end: `./launch.sh train [--detach] [CONFIG.yaml] [key=value ...]`.

parse the config -> start the run through the supervisor (`supervisor.RunManager`, the same one
the web app and the notebook use) -> follow its event log with a progress bar while waiting on
its processes -> exit 0, or non-zero with the reason.

The terminal owns the run it started: SIGINT (Ctrl-C), SIGTERM and SIGHUP (the terminal window
closed) stop it the way Stop does everywhere (`contract.protocol.commands.Stop`: save first, by default),
then end its whole process group; nothing is left behind. A second signal ends it at once,
without waiting for the save. Should the command itself be killed (SIGKILL: no handler runs),
the kernel sends its run's launcher SIGTERM (a parent-death signal), which ends the ranks: no
save then, but no orphan either. `--detach` starts a run meant to outlive the terminal: the command
returns once it is started, and the run shows in the web app's run list (which lists the run
folders of its output folder) and can be followed or stopped from there, or with
`./launch.sh watch RUN_FOLDER` / `./launch.sh stop RUN_FOLDER`.

Text that comes from a run (log lines, errors, warnings) is printed as text, never as rich
markup: a log line such as `[/__w/pytorch/third_party/gloo/pair.cc:537]` is not a closing tag.
"""

from __future__ import annotations

import signal
import sys
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any, Callable, Iterator

from rich.progress import Progress

from app.cli_command import command
from app.cli_submit import submit
from app.cli_live import Value, eval_values, live_progress, plain, train_values
from app.cli_preview import preview
from app.cli_summary import end_summary, since_last_start
from app.cli_text import console, say, show_preflight
from contract.args import resolve_args
from contract.config.schema import ConfigError, RunConfig, SHORTCUTS
from contract.preflight import PreflightReport, preflight
from contract.protocol.commands import Stop
from contract.protocol.states import RunState
from contract.run_folder import EventTail
from contract.events import EventType
from supervisor import Failure, RunError, RunHandle, RunManager, RunRefused, remote_stop, warm_start
from supervisor.procs import signal_group

# How long a stop asked for by a signal may take before the group is ended without its save.
STOP_TIMEOUT_S = 120.0
# How often the progress bar takes in new events (the run's end wakes the wait at once).
REFRESH_S = 0.25
HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

TRAIN_HELP = """usage: ./launch.sh train [--detach] [CONFIG.yaml] [key=value ...]
       ./launch.sh watch RUN_FOLDER
       ./launch.sh stop RUN_FOLDER [save=false]
       ./launch.sh preview DATA_FILE [format=... max_length=N start=N ...]   (a page of rows: tokens, kept / truncated / dropped)
       ./launch.sh command RUN_FOLDER NAME [key=value ...]   (pause, set lr=1e-4, status ...: its answer)

Train from the terminal. No config: the embedded default task. Overrides are dotted field names
(optim.lr=1e-4, data.train=my.jsonl) or the short names:
  {shortcuts}
Every field, its type and its meaning: README.md, "Run config" (contract/config.py declares them).
Paths are read relative to the directory the command is typed in.

Ctrl-C, closing the terminal or SIGTERM stop the run{save}, and end every
process of it; a second Ctrl-C ends it at once. --detach: start the run and return; it goes on
without this terminal (watch or stop it in the web app's run list, or with watch / stop)."""


class Signals:
    """The stop signals received so far. The handler only records them; the follow loop, which
    wakes at least every REFRESH_S, acts on them (nothing is interrupted half-way)."""

    def __init__(self) -> None:
        self.received: list[int] = []

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)


# -- train -----------------------------------------------------------------------------------

def train(argv: list[str]) -> int:
    """`train [--detach] [CONFIG.yaml] [key=value ...]`; returns the exit code."""
    if any(a in ("-h", "--help") for a in argv):
        save = " (saving a checkpoint and the final model first)" if Stop().save else ""
        print(TRAIN_HELP.format(shortcuts="\n  ".join(f"{k:<11} {v}" for k, v in SHORTCUTS.items()),
                                save=save))
        return 0
    detach = "--detach" in argv
    args = [a for a in argv if a != "--detach"]
    unknown = [a for a in args if a.startswith("--")]
    if unknown:
        say(f"unknown option {unknown[0]}; allowed: --detach, --help", "red")
        return 2
    try:
        resolved = resolve_args(args)
    except ConfigError as e:
        say(str(e), "red")
        return 2
    cfg = resolved.config
    say(resolved.provenance(), "dim")
    checked = preflight(cfg)  # before any rank starts: every problem by field, file and row
    show_preflight(checked)
    if not checked.ok:
        return 2
    if warm_start.wanted(cfg):  # the embedded default's GRPO variant: from the SFT model
        code = _warm_start(cfg)
        if code != 0:
            return code
        checked = preflight(cfg)
        if not checked.ok:
            show_preflight(checked)
            return 2
    if detach:
        return _start_detached(RunManager(cfg.logging.output_dir), cfg, checked)
    return _train_here(cfg, checked)


def _warm_start(cfg: RunConfig) -> int:
    """0 with `cfg.model.path` set to the default task's SFT model, trained first (and followed
    here) when the output folder has none yet (supervisor.warm_start); else the SFT run's code."""
    found = warm_start.ready(cfg.logging.output_dir)
    if found is None:
        sft = warm_start.sft_config(cfg)
        say(f"GRPO starts from the default task's SFT model (from random weights a right answer is "
            f"almost never sampled): training it first, {sft.train.max_steps} steps, kept in "
            f"{cfg.logging.output_dir} for the next GRPO run ...", "yellow")
        code = _train_here(sft, preflight(sft))
        found = warm_start.ready(cfg.logging.output_dir)
        if code != 0 or found is None:
            say("the SFT run did not finish with its model: GRPO not started", "red")
            return code or 1
    cfg.model.path = str(found)
    say(f"GRPO from model.path={found} (the default task's SFT model)")
    return 0


def _train_here(cfg: RunConfig, checked: PreflightReport) -> int:
    """Start the run as this terminal's and follow it to its end (a stop signal stops it)."""
    signals = Signals()
    previous = {sig: signal.signal(sig, signals) for sig in HANDLED_SIGNALS}
    try:
        # the run is this terminal's: it ends with this process, even one killed by SIGKILL
        handle = _start(RunManager(cfg.logging.output_dir), cfg, checked, die_with_this_process=True)
        if isinstance(handle, int):
            return handle
        code = follow(handle, signals)
        if signals.received:
            return _stop_on_signal(handle, signals.received[0])
        return code
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _stop_on_signal(handle: RunHandle, signum: int) -> int:
    """Stop the run as Stop does by default (save first); a second signal ends it at once."""
    pgid = handle.pid

    def end_now(again: int, frame: FrameType | None) -> None:
        remote_stop.signal_remote(handle.folder.root, "KILL")  # ranks on other machines, if any
        if pgid is not None:
            signal_group(pgid, signal.SIGCONT)
            signal_group(pgid, signal.SIGKILL)

    for sig in HANDLED_SIGNALS:
        signal.signal(sig, end_now)
    how = "saving, then stopping the run" if Stop().save else "stopping the run"
    say(f"{signal.Signals(signum).name}: {how} the run (again to end it at once) ...", "yellow")
    info = handle.stop(timeout=STOP_TIMEOUT_S)
    say(f"stopped at step {info.step}")
    report(handle)
    return 128 + signum


def _start(manager: RunManager, cfg: RunConfig, checked: PreflightReport | None,
           die_with_this_process: bool = False):
    """The started run's handle, or the exit code when it could not start (2: refused)."""
    try:
        handle = manager.start(cfg, checked=checked, die_with_this_process=die_with_this_process)
    except RunRefused as e:
        say(str(e), "red")
        return 2
    except RunError as e:
        say(str(e), "red")
        return 1
    say(f"run folder: {handle.folder.root}")
    return handle


def _start_detached(manager: RunManager, cfg: RunConfig, checked: PreflightReport | None = None) -> int:
    handle = _start(manager, cfg, checked)
    if isinstance(handle, int):
        return handle
    say(f"detached (process group {handle.pid}): the run goes on without this terminal. Watch "
        f"and stop it in the web app's run list (`./launch.sh --output-dir {manager.output_dir}`), "
        f"or with `./launch.sh watch {handle.folder.root}` and `./launch.sh stop {handle.folder.root}`.")
    return 0


# -- following a run -------------------------------------------------------------------------

def follow(handle: RunHandle, signals: Signals | None = None) -> int:
    """Show the run's progress until no process of it is left (or a stop signal came: then
    -1 at once); then its outcome. Liveness is the supervisor's: `handle.wait` wakes when a
    process of the run exits, and `evaluate` judges (a dead rank, a hang) and ends what is left
    of a failed run."""
    reported: Failure | None = None
    with _progress_bar() as progress:
        task = progress.add_task(str(RunState.STARTING), total=None, metrics="")
        shown = _Shown(progress, task)
        events = _current_run_events(EventTail(handle.folder.events))
        while True:
            for event in events():
                shown.event(event)
            if signals is not None and signals.received:
                return -1
            if handle.wait(REFRESH_S):
                # every process gone: judged now, and a failed group ended and, where
                # fault.max_restarts allows, relaunched (supervisor.restart): then go on following
                reported = reported or handle.evaluate()
                handle.wait_cleaned_up()
                if not handle.relaunched():
                    break
                reported = None
                continue
            failure = handle.evaluate()
            if failure is not None and failure.kind != "hung":
                reported = failure  # the supervisor now ends the rest of the group
            elif failure is not None:
                say(str(failure), "yellow")
        for event in events():
            shown.event(event)
    return report(handle, reported)


def report(handle: RunHandle, reported: Failure | None = None) -> int:
    """The run's outcome: 0 when it finished; else its failure, naming the rank, how it ended
    and the last lines of its log, printed as text."""
    info = handle.info()
    if info.state == RunState.FINISHED:
        by_user = " (stopped by the user)" if info.stopped_by_user else ""
        say(f"finished{by_user}: {handle.folder.root}", "green")
        for line in end_summary(handle.folder):  # steps, final metrics, the model and checkpoints
            say(line)
        return 0
    failure = reported or handle.failure()
    if failure is None:
        say(f"run failed: {info.error or info.state}", "red")
    else:
        print_failure(failure)
    return 1


def print_failure(failure: Failure) -> None:
    """The failure as the terminal shows it: the reason (which rank, how it ended), then the
    last lines of its log, as text."""
    say(f"run failed: {failure.message}", "red")
    if failure.lines:
        where = Path(failure.log).name if failure.log else "the rank logs"
        say(f"--- last lines of {where} ---", "dim")
        say("\n".join(failure.lines))


@contextmanager
def _progress_bar() -> Iterator[Progress]:
    """A progress bar (plain lines when the output is no terminal) that survives its terminal
    going away (SIGHUP): the run is still stopped and reported properly."""
    progress = live_progress(console)  # one labelled line that fits the terminal (app.cli_live)
    try:
        progress.start()
    except OSError:
        pass
    try:
        yield progress
    finally:
        try:
            progress.stop()
        except OSError:
            pass


def _current_run_events(tail: EventTail) -> Callable[[], Iterator[dict]]:
    """A poll of the run's new events that skips what a run before it (resumed in the same
    folder) wrote: the history starts over at the last `starting` state."""
    first = True

    def poll() -> Iterator[dict]:
        nonlocal first
        batch = tail.poll()
        if first:
            first = False
            batch = since_last_start(batch)
        return iter(batch)
    return poll


class _Shown:
    """What the progress bar shows, fed one event at a time."""

    def __init__(self, progress: Progress, task: Any):
        self.progress, self.task = progress, task
        self.metrics: dict[str, Value] = {}
        self.plain = not console.is_terminal

    def event(self, event: dict) -> None:
        kind, p = event.get("type"), self.progress
        if kind == EventType.SETUP:
            p.update(self.task, description="training", total=event.get("total_steps"))
            for w in event.get("warnings", []):
                say(f"warning: {w}", "yellow")
        elif kind == EventType.TRAIN:
            self.metrics.update(train_values(event))
            p.update(self.task, completed=event.get("step", 0), total=event.get("total_steps"),
                     description=f"epoch {event.get('epoch', 0)}")
            if self.plain:
                say(f"step {event.get('step')}/{event.get('total_steps')}  {plain(train_values(event).values())}")
        elif kind == EventType.EVAL:
            self.metrics.update(eval_values(event))
            say(f"step {event.get('step')}: {plain(eval_values(event).values())}")
        elif kind == EventType.WARNING:
            say(f"warning: {event.get('message', '')}", "yellow")
        elif kind == EventType.CHECKPOINT_FAILED:
            say(f"checkpoint failed ({event.get('kind', 'save')}): {event.get('error', '')}", "red")
        elif kind == EventType.RANK_FAILED:
            say(f"rank {event.get('rank', '?')} failed at step {event.get('step', '?')}: "
                f"{str(event.get('error', '')).splitlines()[0] if event.get('error') else event.get('kind', '')}", "red")
        elif kind == EventType.RESTART:
            say(f"restart {event.get('attempt')} of {event.get('max_restarts')}: from "
                f"{Path(str(event.get('checkpoint', ''))).name} (step {event.get('step')})", "yellow")
        elif kind == EventType.STATE and event.get("state") in (RunState.STOPPING, RunState.PAUSED):
            say(f"{event['state']} at step {event.get('step', '?')}", "yellow")
        p.update(self.task, values=dict(self.metrics))


# -- runs started elsewhere ------------------------------------------------------------------

def _handle_of(run_folder: str) -> RunHandle:
    root = Path(run_folder).resolve()
    return RunManager(root.parent).get(root.name)


def watch(argv: list[str]) -> int:
    """`watch RUN_FOLDER`: follow a run (a detached one, say) to its end. Ctrl-C stops watching,
    not the run."""
    if len(argv) != 1:
        say("usage: ./launch.sh watch RUN_FOLDER", "red")
        return 2
    try:
        handle = _handle_of(argv[0])
        return follow(handle)
    except RunError as e:
        say(str(e), "red")
        return 2
    except KeyboardInterrupt:
        say("stopped watching; the run goes on")
        return 130


def stop(argv: list[str]) -> int:
    """`stop RUN_FOLDER [save=false]`: stop a run as Stop does (save unless save=false)."""
    if not argv or any(a not in ("save=false", "save=true") for a in argv[1:]):
        say("usage: ./launch.sh stop RUN_FOLDER [save=false]", "red")
        return 2
    save = "save=false" not in argv[1:] and ("save=true" in argv[1:] or Stop().save)
    try:
        handle = _handle_of(argv[0])
    except RunError as e:
        say(str(e), "red")
        return 2
    info = handle.stop(save=save, timeout=STOP_TIMEOUT_S)
    why = info.error or info.reason
    say(f"{info.name}: {info.state} at step {info.step}" + (f" ({why})" if why else ""))
    return 0 if info.state == RunState.FINISHED else 1


COMMANDS = {"train": train, "watch": watch, "stop": stop, "submit": submit, "preview": preview,
            "command": lambda argv: command(argv, say)}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        say(f"usage: python -m app.cli {{{','.join(COMMANDS)}}} ...  (train --help for more)", "red")
        sys.exit(2)
    sys.exit(COMMANDS[argv[0]](argv[1:]))


if __name__ == "__main__":
    main()
