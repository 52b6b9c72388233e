"""How the terminal front end prints (app.cli and its commands): on stderr, run text as text,
never as rich markup (a log line such as `[/__w/pytorch/third_party/gloo/pair.cc:537]` is not a
closing tag), and the pre-flight check's findings by how much they matter."""

from __future__ import annotations

from rich.console import Console

from contract.preflight import PreflightError, PreflightReport

console = Console(stderr=True)


def say(text: str, style: str | None = None) -> None:
    """Print run text as text (never markup). A terminal that is gone (SIGHUP) is not an error:
    the run is still stopped properly."""
    try:
        console.print(text, style=style, markup=False, highlight=False, soft_wrap=True)
    except OSError:
        pass


def show_preflight(report: PreflightReport) -> None:
    """The pre-flight findings: facts dim, warnings yellow, the loud ones bold, problems red."""
    for key, message in report.notes:
        say(f"{key}: {message}", "dim")
    for key, message in report.loud:
        say(f"WARNING {key}: {message}", "bold yellow")
    for key, message in report.warnings:
        say(f"warning {key}: {message}", "yellow")
    if report.problems:
        say(str(PreflightError(report.problems)), "red")
