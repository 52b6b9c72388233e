"""The program every rank runs: `python -m engine.worker --run-dir RUN` (started by the launcher).

parse (the run folder's config.yaml) -> build (Trainer, through engine.assembly: the same run a
script gets) -> train -> clean up. Each rank writes its own log file; rank 0 records the run's
state in events.jsonl, including why it failed.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

from contract.config.load import load_config
from contract.run_folder import EventLog, RunFolder
from contract.protocol.states import RunState
from contract.events import StateEvent


def _redirect_output(folder: RunFolder, rank: int) -> None:
    """This rank's stdout and stderr go to logs/rank<N>.log (a file, never an undrained pipe)."""
    folder.logs.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder.rank_log(rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def run(run_dir: Path) -> int:
    from engine.trainer import Trainer  # heavy imports after the log redirection

    folder = RunFolder(run_dir)
    cfg = load_config(folder.config)
    trainer = None
    try:
        trainer = Trainer(config=cfg, run_dir=str(folder.root))
        trainer.train()
        return 0
    except BaseException as e:  # noqa: BLE001 - every failure is recorded, then re-raised as exit 1
        message = f"{type(e).__name__}: {e}"
        traceback.print_exc()
        if int(os.environ.get("RANK", "0")) == 0:
            log = trainer.events if trainer is not None and trainer.events else EventLog(folder.events)
            log.emit(StateEvent(state=RunState.FAILED, error=message,
                                rank=int(os.environ.get("RANK", "0"))))
        return 1
    finally:
        if trainer is not None:
            trainer.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="engine.worker")
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--local_rank", type=int, default=None)  # passed by the DeepSpeed launcher
    args = parser.parse_args(argv)
    _redirect_output(RunFolder(args.run_dir), int(os.environ.get("RANK", "0")))
    code = run(args.run_dir)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: gloo threads can hang a normal exit


if __name__ == "__main__":
    main()
