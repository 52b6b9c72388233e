"""Every example notebook, executed top to bottom by a real Jupyter kernel (nbclient). Their own
cells assert on what they produced: the loss went down, the chat answered, the exported adapter
loads with PeftModel.from_pretrained, the Trainer's custom parts were called."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from nb_utils import REPO, errors_in, run_notebook

pytestmark = pytest.mark.slow  # a browser, a kernel or engine processes: the slow tier

NOTEBOOKS = REPO / "notebooks"
REQUIRED = ("quickstart", "lora_local_model", "lomo", "trainer_api", "preference", "rewards")
# what the tests set after a notebook's parameters cell (papermill's convention: a cell tagged
# "parameters", the values injected in a cell after it): a user's run is long enough to watch,
# the tests' short
PARAMETERS = {"quickstart": "WATCH_STEPS = 20", "preference": "WATCH_STEPS = 8", "rewards": "WATCH_STEPS = 8"}


def parameters_cell(nb: nbformat.NotebookNode) -> int | None:
    return next((i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])), None)


def with_parameters(nb: nbformat.NotebookNode, source: str | None) -> nbformat.NotebookNode:
    """`nb` with `source` injected after its parameters cell (as papermill does)."""
    if source is not None:
        at = parameters_cell(nb)
        assert at is not None, "the notebook has no cell tagged 'parameters'"
        nb.cells.insert(at + 1, nbformat.v4.new_code_cell(source))
    return nb


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """One cache of the default task's assets for every notebook of this module."""
    return tmp_path_factory.mktemp("cache")


def test_the_examples_are_there_and_stored_without_outputs():
    found = sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb"))
    assert set(REQUIRED) <= set(found), found
    for path in NOTEBOOKS.glob("*.ipynb"):
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        assert nb.cells[0].cell_type == "markdown", f"{path.name} starts by saying what it does"
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, f"{path.name} has outputs"


def test_the_quickstart_trains_long_enough_to_watch_unless_told_otherwise():
    """Left as it is, the quickstart's run trains hundreds of steps before its Stop cell (a
    minute to watch its plots grow); its parameters cell says so, and the tests shorten it."""
    nb = nbformat.read(NOTEBOOKS / "quickstart.ipynb", as_version=4)
    at = parameters_cell(nb)
    assert at is not None
    namespace: dict = {}
    exec(nb.cells[at].source, namespace)  # the cell only sets values
    assert namespace["WATCH_STEPS"] >= 300
    assert any("run.wait(step=WATCH_STEPS)" in c.source for c in nb.cells[at + 1:])


@pytest.mark.parametrize("name", REQUIRED)
def test_the_notebook_runs_top_to_bottom(name, tmp_path, monkeypatch, cache):
    monkeypatch.setenv("LIVETUNE_OUTPUT_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("LIVETUNE_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    nb = with_parameters(nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4), PARAMETERS.get(name))
    run_notebook(nb, cwd=tmp_path, tmp=tmp_path, timeout=600)
    assert errors_in(nb) == []
    assert list((tmp_path / "runs").iterdir()), "the notebook made a run folder"
