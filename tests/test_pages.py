"""The pages say what their files say: every run figure is written from its JSON in docs/ by
extras/bench/pages.py (cog), no figure is typed by hand, every file in docs/ has its row in
docs/README.md, and every quoted command names a module that exists with flags its parser knows.
Each check also runs on a planted page, so that a check that passes everything fails here."""
import argparse
import contextlib
import functools
import importlib.util
import io
import json
import re
import runpy
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from extras.bench import pages

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / p for p in pages.PAGES]
NOTEBOOKS = sorted((ROOT / "notebooks").rglob("*.ipynb"))


# cog: the pages are what their files make them


def test_pages_are_their_files():
    assert pages.main(["--check"]) == 0, "a page differs from its JSON: python -m extras.bench.pages"


def test_cog_check_fails_on_a_stale_page(tmp_path):
    page = tmp_path / "page.md"
    page.write_text('<!-- [[[cog pages.results_table("cpu_preset_muon_epyc_avx2_2026_12_05") ]]] -->\n'
                    "| typed | by | hand |\n<!-- [[[end]]] -->\n")
    assert pages.cog([page], check=True) != 0
    assert pages.cog([page]) == 0 and pages.cog([page], check=True) == 0  # rewritten, then true


# no figure typed by hand


GENERATED = re.compile(r"<!-- \[\[\[cog .*?<!-- \[\[\[end\]\]\] -->", re.S)
CODE = re.compile(r"^```.*?^```|`[^`]*`|^(?: {4}|\t)[^\n]*$", re.S | re.M)  # fenced, inline, indented
LINKS = re.compile(r"\]\([^)]*\)|<!--.*?-->|https?://\S+", re.S)  # link targets, comments, URLs
ALLOWED = [  # what reads as a number but is no run's figure: names, dates, settings named by their value
    r"\b20\d\d-\d\d-\d\d\b", r"\b20\d\d\b", r"\b[0-9a-f]{7,40}\b",
    r"\btau\s*(?:=|<=|>=)\s*[\d.]+", r"\bB\s*[=-]\s*\d+", r"\bB\s*\+\s*1", r"\bB_cache\s*=?\s*\d+",
    r"(?i)\bstages?[-\s][12]\b", r"\b0[1-5]\b", r"(?i)\bnotebooks? \d+", r"\bTables? \d+(?: and \d+)?",
    r"\bFigures? \d+", r"(?i)\bissues? \d+", r"\b95% (?:CI|interval|confidence|Wilson)", r"\bbatch\s*>\s*1\b",
    r"\b(?:Qwen2(?:\.5)?|SmolLM2|Llama|GPT-2|H[12]00|A100|L4|T4|bf16|float32|float16|fp8|int8|AVX(?:2|512)\w*|"
    r"x86_64|p50|p99|v1|Python ?3(?:\.\d+)?|torch ?2\.\d+|arXiv ?[\d.]+|UTF-8|2T|top-\d|Q8_0|1/t)\S*",
    r"-\d+(?:\.\d+)?[BM]\b", r"\b\d+(?:\.\d+)?B\b", r"0\.\.T-1", r"\b1 - H", r"\(1 - c\)", r"\b\d+(?:st|nd|rd|th)\b",
    r"\b(?:batch|width|step|layer|row|prompt|position)s? \d+\b",
]
PAPER = [  # the paper's own figures, cited (its Tables 2, 4 and 5, its recipe)
    "5 epochs", "lr 5e-6", "warmup 3%", "batch 384", "batch 4, 8 and 16", "+1.5 to +1.7", "1.5 to 1.9",
    "1.0 to 1.6",
]
NUMBER = re.compile(r"(?<![\w.])[-+]?\d[\d,]*(?:\.\d+)?(?:e-?\d+)?%?")


def typed_figures(text):
    """The numbers of a page outside its generated blocks, code, links and allowlist."""
    text = LINKS.sub(" ", CODE.sub(" ", GENERATED.sub(" ", text)))
    for allowed in PAPER:
        text = text.replace(allowed, " ")
    for allowed in ALLOWED:
        text = re.sub(allowed, " ", text)
    return NUMBER.findall(text)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name if p.parent == DOCS else "README")
def test_no_typed_figures(page):
    assert typed_figures(page.read_text()) == [], f"{page.name}: figures typed by hand: write them with extras/bench/pages.py"


def test_typed_figures_are_flagged():
    page = ("The run took 14.1 min and scored 95.0% at 3.21 tokens per forward.\n"
            "<!-- [[[cog pages.say('x') ]]] -->\ntook 845.9 s\n<!-- [[[end]]] -->\n"
            "Run `python sample.py --threshold 0.9`; tau = 0.9 and B = 4 are settings; the paper: 5 epochs.\n")
    assert typed_figures(page) == ["14.1", "95.0%", "3.21"]


# every file in docs/ has its row in docs/README.md


def missing_rows(index, names):
    """The names of docs/ that index (docs/README.md's text) does not list: a file in a table
    row, a page by its link."""
    rows = "\n".join(line for line in index.splitlines() if line.startswith("|"))
    return [n for n in names if (f"({n})" not in index if n.endswith(".md") else f"`{n}" not in rows)]


def test_every_docs_file_has_its_row():
    names = [p.name + ("/" if p.is_dir() else "") for p in sorted(DOCS.iterdir()) if p.name != "README.md"]
    assert missing_rows((DOCS / "README.md").read_text(), names) == []


def test_a_missing_row_is_flagged():
    index = "- [tour.md](tour.md)\n\n| file | written by |\n|---|---|\n| `eval_cpu.json`, `pareto.png` | x |\n"
    assert missing_rows(index, ["tour.md", "results.md", "eval_cpu.json", "pareto.png", "new.json"]) == \
        ["results.md", "new.json"]


# every quoted command exists and uses only its parser's flags


EXTERNAL = {"pytest", "pip", "cogapp", "jupyter", "ipykernel", "venv", "http.server", "torch.utils.collect_env"}
COMMAND = re.compile(r"(?:^|[\s;(&|])(python3?|torchrun)\s+(.*)")


def markdown_of(path):
    if path.suffix == ".ipynb":
        cells = json.loads(path.read_text())["cells"]
        return "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    return path.read_text()


def commands(text):
    """(module or script, its flags) of every `python X.py ...`, `python -m mod ...` and
    `torchrun ... X.py ...` quoted in text's code (inline, fenced or indented)."""
    found = []
    for code in re.findall(r"^```.*?^```|`[^`]+`|^(?: {4}|\t)[^\n]*$", text, re.S | re.M):
        for line in code.strip("`").splitlines() if code.startswith("```") else [" ".join(code.strip("`").split())]:
            for m in COMMAND.finditer(line):
                words = re.split(r"\s*(?:&&|;|\||#|\))\s*", m.group(2))[0].split()
                if m.group(1) == "torchrun":
                    words = words[next((i for i, w in enumerate(words) if w.endswith(".py") or w == "-m"), len(words)):]
                if words[:1] == ["-m"] and len(words) > 1:
                    target, rest = words[1], words[2:]
                elif words and words[0].endswith(".py"):
                    target, rest = words[0].replace("\\", "/"), words[1:]  # a Windows path too
                else:
                    continue
                found.append((target, sorted({w.split("=")[0] for w in rest if re.match(r"--?[A-Za-z]", w)})))
    return found


class Captured(BaseException):  # past any `except Exception` around a parse
    pass


ANY = None.__class__  # the flags of a module without an argparse parser: not checked


@functools.cache
def known_flags(target):
    """The option strings of target's parser, read by running its main until it parses (the
    parse itself is replaced, so nothing else runs); None if target does not exist."""
    if target.endswith(".py"):
        path = ROOT / target
        if not path.is_file():
            return None
    else:
        try:
            spec = importlib.util.find_spec(target)
        except ModuleNotFoundError:
            return None
        if spec is None or spec.origin is None:
            return None
        path = Path(spec.submodule_search_locations[0]) / "__main__.py" if spec.submodule_search_locations \
            else Path(spec.origin)
    if not re.search(r"argparse|Parser\(|get_config|parse_args", path.read_text()):
        return ANY  # reads sys.argv itself (or nothing): its flags are not checked, it is not run
    parsers = []

    def capture(self, *args, **kwargs):
        parsers.append(self)
        raise Captured

    saved = sys.argv, argparse.ArgumentParser.parse_known_args
    sys.argv, argparse.ArgumentParser.parse_known_args = [target], capture  # parse_args calls it too
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
                warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # runpy: the module was imported before
            if target.endswith(".py"):
                runpy.run_path(str(path), run_name="__main__")
            else:
                runpy.run_module(target, run_name="__main__", alter_sys=False)
    except Captured:
        pass
    finally:
        sys.argv, argparse.ArgumentParser.parse_known_args = saved
    assert parsers, f"{target} parses no command line"
    actions = [a for p in parsers for a in p._actions]
    actions += [a for p in parsers for s in p._actions if isinstance(s, argparse._SubParsersAction)
                for sub in s.choices.values() for a in sub._actions]
    return {o for a in actions for o in a.option_strings}


def bad_commands(text):
    """Every quoted command whose module is missing or which passes a flag its parser lacks."""
    bad = []
    for target, flags in commands(text):
        if target.split(".")[0] in EXTERNAL or target in EXTERNAL or re.search(r"[<{]", target):
            continue  # not ours, or a placeholder (extras.<room>.<tool>)
        known = known_flags(target)
        if known is None:
            bad.append(f"{target}: no such module")
        elif known is not ANY:
            bad += [f"{target} {f}: no such flag" for f in flags if f not in known]
    return bad


@pytest.mark.parametrize("path", PAGES + NOTEBOOKS, ids=lambda p: str(p.relative_to(ROOT)))
def test_quoted_commands_parse(path):
    assert bad_commands(markdown_of(path)) == []


def test_bad_commands_are_flagged():
    page = ("Run `python sample.py --threshold 0.9 --no_such_flag`, then\n\n    python -m extras.nowhere --x 1\n"
            "    torchrun --standalone --nproc_per_node=2 train.py --preset tiny --wrong=3\n"
            "and `python -m pytest -m slow`.\n")
    assert bad_commands(page) == ["sample.py --no_such_flag: no such flag", "extras.nowhere: no such module",
                                  "train.py --wrong: no such flag"]


@pytest.mark.slow
def test_every_quoted_command_answers_help():
    """Each module or script the pages and notebooks quote runs for real, as its own process: its --help exits 0
    (the fast tier above reads its parser without running it)."""
    targets = sorted({t for p in PAGES + NOTEBOOKS for t, _ in commands(markdown_of(p))
                      if not (t.split(".")[0] in EXTERNAL or t in EXTERNAL or re.search(r"[<{]", t))
                      and known_flags(t) not in (None, ANY)})
    assert "train.py" in targets and "extras.engine" in targets
    for target in targets:
        argv = [target] if target.endswith(".py") else ["-m", target]
        proc = subprocess.run([sys.executable, *argv, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and "usage:" in proc.stdout, f"{target} --help: {proc.stderr[-500:]}"
