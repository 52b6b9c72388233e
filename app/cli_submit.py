"""`./launch.sh submit [CONFIG.yaml] --slurm [options] [key=value ...]`: the terminal's way to hand
a run to Slurm instead of starting it here, through the session's `submit` (as the web app's
"Submit to Slurm"), after the same pre-flight check as `train`."""

from __future__ import annotations

import argparse
from pathlib import Path

from app.cli_text import say, show_preflight
from contract.args import resolve_args
from contract.config.schema import ConfigError
from contract.preflight import preflight

SUBMIT_HELP = """usage: ./launch.sh submit [CONFIG.yaml] --slurm [--nodes N] [--procs-per-node N]
           [--gpus-per-node N] [--cpus-per-task N] [--partition P] [--time T] [--account A] [key=value ...]

Submit the run to Slurm (sbatch) instead of starting it here: the run folder gets the job script
(job.sbatch) and the job id (slurm_job.json); the run is listed as queued, then as it runs. Watch
or stop it like any run: the web app's run list, `./launch.sh watch RUN_FOLDER`,
`./launch.sh stop RUN_FOLDER` (which scancels the job once the run stopped, or at once)."""


def submit(argv: list[str]) -> int:
    """`submit [CONFIG.yaml] --slurm [options] [key=value ...]`; returns the exit code."""
    from app.session import Session, SessionError  # imported late: only a submit needs them
    from supervisor.slurm import SlurmOptions
    if any(a in ("-h", "--help") for a in argv):
        print(SUBMIT_HELP)
        return 0
    parser = argparse.ArgumentParser(prog="./launch.sh submit", add_help=False)
    parser.add_argument("--slurm", action="store_true")
    for name in ("nodes", "procs-per-node", "gpus-per-node", "cpus-per-task"):
        parser.add_argument(f"--{name}", type=int, default=1 if name == "nodes" else 0)
    for name in ("partition", "time", "account"):
        parser.add_argument(f"--{name}", default="")
    try:
        known, rest = parser.parse_known_args(argv)
    except SystemExit:
        return 2
    unknown = [a for a in rest if a.startswith("--")]
    if unknown or not known.slurm:
        say(f"unknown option {unknown[0]}" if unknown else "submit needs --slurm (the only scheduler)", "red")
        say(SUBMIT_HELP)
        return 2
    opts = SlurmOptions(nodes=known.nodes, procs_per_node=known.procs_per_node,
                        gpus_per_node=known.gpus_per_node, cpus_per_task=known.cpus_per_task,
                        partition=known.partition, time=known.time, account=known.account)
    try:
        opts.check()
        resolved = resolve_args(rest)
    except (ConfigError, ValueError) as e:
        say(str(e), "red")
        return 2
    cfg = resolved.config
    if opts.procs_per_node:
        cfg.parallel.nproc = opts.procs_per_node
    checked = preflight(cfg)
    show_preflight(checked)
    if not checked.ok:
        return 2
    session = Session(cfg.logging.output_dir)  # the web app's "Submit to Slurm" goes the same way
    try:
        root = Path(session.submit(cfg, opts, checked=checked).path)
    except SessionError as e:
        say(str(e), "red")
        return 2 if e.problems else 1
    finally:
        session.close()
    job = (root / "slurm_job.json").read_text()
    say(f"run folder: {root}\nsubmitted: {job}\nwatch it with `./launch.sh watch {root}`, "
        f"stop it with `./launch.sh stop {root}`, or in the web app's run list.")
    return 0
