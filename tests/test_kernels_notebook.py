"""notebooks/kernels.ipynb runs top to bottom on CPU and shows the invariance it claims."""

import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK = pathlib.Path(__file__).resolve().parents[1] / "notebooks" / "kernels.ipynb"


@pytest.mark.slow
def test_kernels_notebook_executes():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(
        nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parent)}}
    ).execute()
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "row-block w4a16    : 0 of 8 rows differ" in text
    assert "bitwise equal: True" in text
    assert "| 512x512x1536" in text
