"""Every example notebook, executed top to bottom by a real Jupyter kernel (nbclient). Their own
cells assert on what they produced: the loss went down, the chat answered, the exported adapter
loads with PeftModel.from_pretrained, the Trainer's custom parts were called."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from nb_utils import REPO, errors_in, run_notebook

NOTEBOOKS = REPO / "notebooks"
REQUIRED = ("quickstart", "lora_local_model", "lomo", "trainer_api")


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


@pytest.mark.parametrize("name", REQUIRED)
def test_the_notebook_runs_top_to_bottom(name, tmp_path, monkeypatch, cache):
    monkeypatch.setenv("LIVETUNE_OUTPUT_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("LIVETUNE_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    run_notebook(nb, cwd=tmp_path, tmp=tmp_path, timeout=600)
    assert errors_in(nb) == []
    assert list((tmp_path / "runs").iterdir()), "the notebook made a run folder"
