"""The committed notebooks, read without running them (seconds): no placeholder where a reading
should be, no figure in the prose that the notebook's own outputs (or the docs/ JSON it cites) do
not hold, no import that its install does not provide, and no answer shown before the student
predicts. Each rule is first tried on a planted example that it must catch.

The installs: requirements-course.txt for every notebook, and on top the command a notebook names
in its first cell (05's), as notebooks/setup_check.py reads them; a package provides what it
depends on, as installed here."""
import importlib.metadata
import json
import re
import sys

import pytest
from packaging.requirements import Requirement

from conftest import ROOT

sys.path.insert(0, str(ROOT / "notebooks"))
import setup_check  # noqa: E402

NOTEBOOKS = sorted((ROOT / "notebooks").glob("0*.ipynb"))
SOLUTIONS = sorted((ROOT / "notebooks" / "solutions").glob("0*.ipynb"))
EVERY = NOTEBOOKS + SOLUTIONS

# the placeholders a reading must not be: an empty cell, a lone identifier (S4_READ), a marker word
PLACEHOLDER = re.compile(r"\s*|\s*[A-Za-z_]\w*\s*|.*\b(TODO|XXX|FIXME|TBD)\b.*", re.S)

# a figure: a number with a decimal point or a %, or of 3 digits or more (not inside a word, a
# version, a name such as SmolLM2-135M, a code span or a link's address)
FIGURE = re.compile(r"(?<![\w.\-/])(\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+\.\d+|\d{3,}|\d+)(%?)(?![\w\-]|\.\d)")
# tau's values are the knob a cell sets, never a measurement: "tau = 1.0, 0.9 and 0.6"
TAUS = re.compile(r"tau\s*=?\s*\d+(?:\.\d+)?(?:(?:,\s*|,?\s+(?:and|or)\s+)\d+(?:\.\d+)?)*")
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")
# figures no run of this project measures: the paper's own, and the intervals' confidence
ALLOWED = {"2604.07023": "the paper's arXiv number",
           "1.46": "the paper: tokens per forward at tau = 0.95 (lowest)",
           "1.87": "the paper: tokens per forward at tau = 0.95 (highest)",
           "1.6": "the paper: the accuracy it costs, in points (highest)",
           "95%": "the confidence of every interval"}


def cells(nb, kind):
    return [c for c in nb["cells"] if c["cell_type"] == kind]


def text(cell):
    return "".join(cell["source"])


def load(path):
    with open(path) as f:
        return json.load(f)


def exercise_of(path):
    """A solutions notebook's exercise notebook (the one it repeats); a notebook's own path otherwise."""
    return ROOT / "notebooks" / path.name.replace("_solutions", "") if path in SOLUTIONS else path


# (a) placeholders


def placeholders(nb):
    """The markdown cells (index, text) that are empty or a placeholder."""
    return [(i, text(c)[:40]) for i, c in enumerate(nb["cells"])
            if c["cell_type"] == "markdown" and PLACEHOLDER.fullmatch(text(c))]


def notebook(*cells_):
    """A notebook of (kind, source, outputs text) cells, for the planted examples."""
    return {"cells": [{"cell_type": kind, "source": src, "metadata": {}, "outputs": [
        {"output_type": "stream", "name": "stdout", "text": out}] if out else []} for kind, src, out in cells_]}


def test_a_placeholder_is_caught():
    planted = notebook(("markdown", "## 1. A reading\n\nThe first window commits four tokens.", None),
                       ("markdown", "WINDOW_READ", None), ("markdown", "", None), ("markdown", " \n", None),
                       ("markdown", "The tau sweep. TODO: read it", None), ("markdown", "XXX", None))
    assert [i for i, _ in placeholders(planted)] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("path", EVERY, ids=lambda p: p.name)
def test_no_placeholder(path):
    assert not placeholders(load(path)), f"{path.name}: markdown cells that are empty or a placeholder"


# (b) figures


def prose_figures(markdown):
    """The figures of a markdown cell, as written (49,152; 93.7%; 0.9), its code spans, addresses and
    tau's values left out."""
    for pattern in (r"```.*?```", r"`[^`]*`", r"\]\([^)]*\)", r"https?://\S+", TAUS.pattern):
        markdown = re.sub(pattern, " ", markdown, flags=re.S)
    return [m.group(0) for m in FIGURE.finditer(markdown)
            if "." in m.group(1) or m.group(2) or len(m.group(1).replace(",", "")) >= 3]


def numbers(value, found):
    """Every number in a JSON value or a text, into the set found."""
    if isinstance(value, dict):
        for k, v in value.items():
            numbers(k, found), numbers(v, found)
    elif isinstance(value, list):
        for v in value:
            numbers(v, found)
    elif isinstance(value, str):
        found.update(float(x) for x in NUMBER.findall(value.replace(",", "")))
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        found.add(float(value))
    return found


def sources(nbs, docs):
    """The numbers a notebook's prose may quote: its code (the settings), its outputs, and the
    docs/ JSON files any of its cells names. nbs: the notebook (a solutions notebook: and its
    exercise notebook, whose outputs it refers to)."""
    found, cited = set(), set()
    for nb in nbs:
        for c in nb["cells"]:
            cited.update(re.findall(r"docs/([\w.-]+\.json)", text(c)))
        for c in cells(nb, "code"):
            numbers(text(c), found)
            for out in c.get("outputs", []):
                numbers("".join(out.get("text", "")), found)
                numbers(["".join(v) for k, v in out.get("data", {}).items() if k.startswith("text/")], found)
    for name in cited:
        numbers(load(docs / name), found)
    return found


def unsourced(nbs, docs=ROOT / "docs"):
    """The figures (cell, figure) of nbs[0]'s prose that no source holds, to the figure's precision
    (93.7% holds for 0.9371 or 93.7)."""
    found, missing = sources(nbs, docs), []
    for i, c in enumerate(nbs[0]["cells"]):
        for figure in prose_figures(text(c)) if c["cell_type"] == "markdown" else []:
            value = figure.rstrip("%").replace(",", "")
            x, half = float(value), 0.5 * 10 ** -len(value.partition(".")[2])
            if figure not in ALLOWED and not any(abs(v - x) < half or (figure.endswith("%") and abs(100 * v - x) < half)
                                                 for v in found):
                missing.append((i, figure))
    return missing


def test_a_figure_the_notebook_does_not_show_is_caught(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps({"accuracy": 0.9627, "prompts": 1981}))
    planted = notebook(
        ("markdown", "The run scores 96.3% (docs/run.json) on 1,981 prompts at tau = 0.9, 0.8 and 0.5, "
                     "3.02 tokens per forward, B = 4, lr `3e-3` (arXiv 2604.07023).", None),
        ("code", "print(tokens_per_forward)", "3.0213 tokens per forward\n"),
        ("markdown", "Stage 2 keeps 93.7% of it, 2.95 tokens per forward, in 1,400 steps: 12.5 min.", None))
    assert unsourced([planted], tmp_path) == [(2, "93.7%"), (2, "2.95"), (2, "1,400"), (2, "12.5")]


@pytest.mark.parametrize("path", EVERY, ids=lambda p: p.name)
def test_every_figure_in_the_prose_is_in_the_outputs_or_a_cited_file(path):
    nbs = [load(path)] + ([load(exercise_of(path))] if path in SOLUTIONS else [])
    assert not unsourced(nbs), (f"{path.name}: figures (cell, figure) that neither its outputs nor the docs/ JSON it "
                                "cites hold: a stale figure, or one to generate")


# (c) the installs


def canonical(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def provided(names):
    """The packages an install of names brings: each, and what it depends on, as installed here
    (markers evaluated, extras left out); a package not installed here brings only itself."""
    todo, found = [canonical(n) for n in names], set()
    while todo:
        name = todo.pop()
        if name in found:
            continue
        found.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        todo += [canonical(r.name) for r in map(Requirement, requires) if not r.marker or r.marker.evaluate({"extra": ""})]
    return found


def unprovided(path, install):
    """The packages (import names) a notebook imports that an install (package names) does not bring."""
    brought, packages = provided(install), importlib.metadata.packages_distributions()
    return sorted(m for m in setup_check.needs(path)
                  if not brought & {canonical(p) for p in packages.get(m, [setup_check.PIP_NAMES.get(m, m)])})


def test_an_import_the_install_lacks_is_caught(tmp_path):
    course = setup_check.install(NOTEBOOKS[0])
    planted = tmp_path / "planted.ipynb"
    cases = {"import gguf": ["gguf"],  # a package, in a cell
             "from extras.checkpoints import gguf_file": ["gguf", "safetensors"],  # a project module's, and its import's
             "def f():\n    from extras.serving import server": ["pydantic", "starlette", "uvicorn"],  # a cell's function runs
             "from extras.checkpoints import foreign": []}  # its readers load inside a function, for a real model only
    for code, missing in cases.items():
        planted.write_text(json.dumps(notebook(("code", "%matplotlib inline\n" + code, None))))
        assert unprovided(planted, course) == missing, code
    assert "tiktoken" in unprovided(NOTEBOOKS[0], [n for n in course if n != "tiktoken"])  # through common.py


@pytest.mark.parametrize("path", EVERY, ids=lambda p: p.name)
def test_the_install_provides_every_import(path):
    install = setup_check.install(exercise_of(path))
    assert not unprovided(path, install), f"{path.name} imports what its install ({', '.join(install)}) does not bring"


def test_only_05_needs_a_command_of_its_own_and_course_md_names_both():
    extra = {p.name: setup_check.extra_command(p) for p in NOTEBOOKS}
    assert [name for name, command in extra.items() if command] == ["05_real_model.ipynb"]
    page = (ROOT / "docs" / "course.md").read_text()
    for command in ("pip install -r requirements-course.txt", extra["05_real_model.ipynb"]):
        assert command in page, f"docs/course.md does not name the install {command!r}"


# (d) predictions first


def shown_before_predicting(nb):
    """The predict-then-run cells (index) that are untagged or show their answer: every cell that
    compares a prediction (checks.compare) is tagged predict and committed without outputs."""
    return [i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code" and "checks.compare(" in text(c)
            and ("predict" not in c["metadata"].get("tags", []) or c["outputs"])]


def test_an_answer_shown_before_the_prediction_is_caught():
    planted = notebook(("code", "prediction = {'width': None}", None),
                       ("code", "verdict = checks.compare(prediction, {'width': 13})", "width: the run: 13\n"),
                       ("code", "verdict = checks.compare(prediction, {'width': 15})", None),
                       ("code", "verdict = checks.compare(prediction, {'width': 17})", None))
    for i in (1, 3):
        planted["cells"][i]["metadata"]["tags"] = ["predict"]
    assert shown_before_predicting(planted) == [1, 2]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_answer_before_the_prediction(path):
    assert not shown_before_predicting(load(path)), \
        f"{path.name}: predict-then-run cells (index) untagged or committed with their answer"
