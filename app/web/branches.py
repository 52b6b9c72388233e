"""The Checkpoints tab's branches section: the run's branch tree; Rewind and Branch
beside the list of every branch's checkpoints and the snapshots in memory; Snapshot now; the
loss, learning-rate and evaluation plots of every branch on one step axis, the steps a rewind
abandoned greyed and dashed. Read from the run folder (`app.branches`); the commands go through
`Session.command` by wire name (`rewind`, `branch`, `snapshot`), so the contract's checks and
messages are the ones shown. The Train tab's plots show the path training is on now."""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gradio as gr

from app.branches import BranchView, branch_view, tree_lines
from app.session import SessionError, allowed
from app.web.access import OPERATOR
from app.web.backend import Backend
from app.web.plots import batch, live_plot
from app.web.widgets import readable
from contract.run_folder import RunFolder
from contract.protocol.answers import RewindAnswer
from contract.protocol.roles import Role

PLOTS = ("branch_loss", "branch_lr", "branch_eval")


@dataclass
class BranchesSection:
    tree: gr.HTML
    target: gr.Dropdown
    rewind: gr.Button
    name: gr.Textbox
    lr: gr.Textbox
    branch: gr.Button
    snapshot_name: gr.Textbox
    snapshot: gr.Button
    result: gr.Markdown
    plots: dict[str, gr.HTML]

    def outputs(self) -> list:
        """What a look at the run updates."""
        return [self.tree, self.target, self.rewind, self.branch, self.snapshot, *self.plots.values()]


def build(backend: Backend, run_state: gr.State) -> BranchesSection:
    with gr.Accordion("Branches: rewind, branch, snapshot", open=True, elem_id="branch-fold"):
        tree = gr.HTML(_tree_html(None), elem_id="branch-tree")
        with gr.Row(equal_height=True):
            target = gr.Dropdown([], label="Checkpoint or snapshot (every branch's)", scale=3,
                                 elem_id="branch-target", allow_custom_value=False)
            rewind = gr.Button("Rewind to it", interactive=False, elem_id="branch-rewind", elem_classes=[OPERATOR], scale=1)
        with gr.Row(equal_height=True):
            name = gr.Textbox(label="New branch name", max_lines=1, scale=2, elem_id="branch-name",
                              placeholder="e.g. lower-lr (letters, digits, - _ .)")
            lr = gr.Textbox(label="Its learning rate (optional)", max_lines=1, scale=1, elem_id="branch-lr",
                            placeholder="empty: as it was")
            branch = gr.Button("Branch from it", interactive=False, elem_id="branch-branch", elem_classes=[OPERATOR], scale=1)
        with gr.Row(equal_height=True):
            snapshot_name = gr.Textbox(label="Snapshot name (optional)", max_lines=1, scale=3,
                                       elem_id="branch-snapshot-name", placeholder="empty: snap-<step>")
            snapshot = gr.Button("Snapshot now (host memory)", interactive=False, elem_id="branch-snapshot", elem_classes=[OPERATOR], scale=1)
        result = gr.Markdown("", elem_id="branch-result")
        plots: dict[str, gr.HTML] = {}
        with gr.Row(equal_height=True):
            for plot in PLOTS[:2]:
                plots[plot] = live_plot(plot, f"branch-plot-{plot.removeprefix('branch_')}")
        plots[PLOTS[2]] = live_plot(PLOTS[2], "branch-plot-eval")
    section = BranchesSection(tree, target, rewind, name, lr, branch, snapshot_name, snapshot, result, plots)
    outputs = [result, *section.outputs()]
    rewind.click(readable(lambda path, t: do_rewind(backend, section, path, t)), inputs=[run_state, target],
                 outputs=outputs, api_visibility="private", concurrency_limit=None)
    branch.click(readable(lambda path, t, n, rate: do_branch(backend, section, path, t, n, rate)),
                 inputs=[run_state, target, name, lr], outputs=outputs, api_visibility="private",
                 concurrency_limit=None)
    snapshot.click(readable(lambda path, n: do_snapshot(backend, section, path, n)), inputs=[run_state, snapshot_name],
                   outputs=outputs, api_visibility="private", concurrency_limit=None)
    return section


def show(backend: Backend, section: BranchesSection, path: str | None, seq: int = 1) -> dict:
    """One look at the run's branches: the tree, the targets, the buttons its state allows, the
    plots (whole: this section is redrawn on request, not ticked)."""
    try:
        path = backend.session.resolve(path)
    except SessionError as e:
        return {section.tree: _tree_html(None, str(e)), section.target: gr.update(choices=[], value=None),
                **_buttons(section, None), **{p: batch({}, None, "", seq) for p in section.plots.values()}}
    view = branch_view(RunFolder(Path(path)))
    state = backend.session.info(path).state
    choices = [(t.label, t.value) for t in view.targets]
    out: dict[Any, Any] = {section.tree: _tree_html(view), section.target: gr.update(choices=choices,
                                                                       value=choices[0][1] if choices else None)}
    out.update(_buttons(section, state, backend.session.role_of()))
    for plot, component in section.plots.items():
        out[component] = batch(view.series[plot.removeprefix("branch_")], None, path, seq)
    return out


def _buttons(section: BranchesSection, state: str | None, role: Role = Role.OPERATOR) -> dict:
    ok = allowed(state, role)  # a viewer's login: all off
    return {section.rewind: gr.update(interactive="rewind" in ok), section.branch: gr.update(interactive="branch" in ok),
            section.snapshot: gr.update(interactive="snapshot" in ok)}


def do_rewind(backend: Backend, section: BranchesSection, path: str | None, target: str | None) -> dict:
    """Rewind: the run loads the target in place and trains on from its step."""
    if not target:
        raise SessionError("pick a checkpoint or snapshot to rewind to")
    result = backend.verbs(path).rewind(target)
    return {section.result: f"**Rewound** to step {result.step}{_abandoned(result)}.",
            **show(backend, section, path)}


def do_branch(backend: Backend, section: BranchesSection, path: str | None, target: str | None, name: str,
              lr: str) -> dict:
    """Branch: as Rewind, then training goes on as the new branch `name` (with `lr`, if given)."""
    if not target:
        raise SessionError("pick a checkpoint or snapshot to branch from")
    settings: dict[str, Any] = {}
    if str(lr or "").strip():
        try:
            settings["lr"] = float(str(lr).strip())
        except ValueError:
            raise SessionError(f"branch: the learning rate must be a number, got {str(lr).strip()!r}") from None
    result = backend.verbs(path).branch(target, (name or "").strip(), **settings)
    changes = ", ".join(f"{k} {v}" for k, v in result.changes.items())
    return {section.result: f"**Branch {html.escape(result.branch)}** goes on from "
                            f"step {result.step}{' with ' + changes if changes else ''}; the branch it "
                            f"left keeps its steps{_abandoned(result, kept=True)}.",
            **show(backend, section, path)}


def do_snapshot(backend: Backend, section: BranchesSection, path: str | None, name: str) -> dict:
    """Snapshot now: the complete training state kept in host memory."""
    result = backend.verbs(path).snapshot((name or "").strip() or None)
    evicted = result.evicted
    mib = result.bytes / 2**20
    text = f"**Snapshot {result.name}** kept at step {result.step} ({mib:.1f} MiB in host memory)"
    text += f"; dropped to make room: {', '.join(evicted)}" if evicted else ""
    return {section.result: text + ".", **show(backend, section, path)}


def _abandoned(result: RewindAnswer, kept: bool = False) -> str:
    span = result.abandoned
    if len(span) != 2:
        return ""
    return (f" (steps {span[0]}-{span[1]} stay on the branch it left)" if kept else
            f"; steps {span[0]}-{span[1]} are abandoned (greyed in the plots below)")


def _tree_html(view: BranchView | None, note: str | None = None) -> str:
    if view is None:
        return f"<div class='muted'>{html.escape(note or 'No run yet.')}</div>"
    lines = "\n".join(f"<b>{html.escape(line)}</b>" if "◀" in line else html.escape(line)
                      for line in tree_lines(view))
    return f"<div class='branch-tree'><b>Branches</b> (where training goes on is marked)<pre>{lines}</pre></div>"
