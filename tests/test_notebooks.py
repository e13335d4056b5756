"""Execute the step-through notebooks top to bottom, as a reader would.

Each runs in notebooks/ (cwd), must raise nowhere and render at least one
picture. The executed copy stays in memory: the committed .ipynb files (with
outputs cleared) are never rewritten. Notebook 03 reuses the checkpoint that
notebook 02 trains (out/nb_tiny), so running them in order is the fast path.
"""
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = ["01_attention_mask.ipynb", "02_training.ipynb", "03_sampling.ipynb", "04_serving_under_load.ipynb"]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(name, monkeypatch):
    path = NOTEBOOKS_DIR / name
    committed = path.read_bytes()
    nb = nbformat.read(path, as_version=4)
    # the kernel inherits this environment: inline figures even if the caller set MPLBACKEND=Agg
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    client = nbclient.NotebookClient(nb, timeout=180, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOKS_DIR)}})
    client.execute()  # raises CellExecutionError, with the cell and its traceback, if any cell fails

    images = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.get("outputs", [])
              if "image/png" in out.get("data", {})]
    assert images, f"{name} rendered no picture"
    assert path.read_bytes() == committed, f"{name} was modified on disk"
