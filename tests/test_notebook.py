"""notebooks/quickstart.ipynb runs top to bottom (a Jupyter kernel, as Colab runs it), so it never rots."""

import os

import nbclient
import nbformat

from tests.helpers import ROOT


def test_quickstart_notebook_runs_top_to_bottom(monkeypatch):
    # The kernel imports this checkout's cbjax, not whichever one is installed (another worktree's, say).
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    path = os.path.join(ROOT, "notebooks", "quickstart.ipynb")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": os.path.dirname(path)}}
    )
    client.execute()  # raises CellExecutionError, with the cell and its traceback, if any cell fails
    text = "".join(
        out.get("text", "") for cell in nb.cells if cell.cell_type == "code" for out in cell.get("outputs", [])
    )
    assert "def fibonacci(n):" in text and "continuous (fcfs) / static output throughput" in text
    assert "outputs: every entry generated exactly static's tokens" in text
    images = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.get("outputs", []) if "data" in out]
    assert sum("image/png" in out["data"] for out in images) == 3
