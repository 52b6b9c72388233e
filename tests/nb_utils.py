"""Running notebooks in a real Jupyter kernel (nbclient) for the notebook and widget tests.

The kernel is this interpreter (the project's venv) through a kernel spec written to a temporary
folder, so no kernel registered elsewhere on the machine can stand in for it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import nbformat
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parent.parent
KERNEL_NAME = "livetune-venv"


def kernel_manager(tmp: Path) -> KernelManager:
    """A manager for a kernel that runs `sys.executable -m ipykernel_launcher`."""
    spec_dir = tmp / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True, exist_ok=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "livetune (venv)", "language": "python"}))
    specs = KernelSpecManager(kernel_dirs=[str(tmp / "kernels")])
    return KernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=specs)


def run_notebook(nb: nbformat.NotebookNode, cwd: Path, tmp: Path, timeout: int = 600) -> NotebookClient:
    """Execute every cell of `nb` top to bottom in a fresh kernel working in `cwd`; raises
    nbclient's CellExecutionError (with the cell and its traceback) on the first failing cell."""
    client = NotebookClient(nb, km=kernel_manager(tmp), timeout=timeout, allow_errors=False,
                            resources={"metadata": {"path": str(cwd)}})
    client.execute()
    return client


def code_notebook(*cells: str) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source) for source in cells]
    return nb


def widget_states(client: NotebookClient, model_name: str) -> list[dict]:
    """The states of every widget model of that kind, as the front end (nbclient) received them."""
    return [s for s in client.widget_state.values() if s.get("_model_name") == model_name]


def errors_in(nb: nbformat.NotebookNode) -> list[str]:
    return [f"{o.get('ename')}: {o.get('evalue')}" for cell in nb.cells if cell.cell_type == "code"
            for o in cell.get("outputs", []) if o.get("output_type") == "error"]
