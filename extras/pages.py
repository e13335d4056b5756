"""The figures of README.md and docs/*.md, written from the JSON files in docs/ by cogapp.

A figure from a run is never typed: it sits in a block that a one-line call writes,
inside HTML comments so that the rendered page shows only the text:

    <!-- [[[cog pages.results_table("cpu_preset_muon_epyc_avx2_2026_12_05") ]]] -->
    | decoder (default run) | accuracy | tokens/forward |
    ...
    <!-- [[[end]]] -->

After a JSON in docs/ changes, rewrite every page with

    python -m extras.pages            # = cog -r -P -I extras -p "import pages" README.md docs/*.md

and `python -m extras.pages --check` fails when a page differs from its files (tests/test_pages.py
runs it). Each generator prints its lines (cog's -P). A figure inside a sentence is written by
say(), from a template whose {fields} name a JSON file and a path inside it.
"""
import functools
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in DOCS.glob("*.md"))]
COG = ["-P", "-I", str(ROOT / "extras"), "-p", "import pages"]


# reading the files


def load(name):
    """docs/NAME (.json added when missing), parsed."""
    return json.loads((DOCS / (name if name.endswith(".json") else name + ".json")).read_text())


def get(data, path):
    """data's value at a dotted path; a number in the path indexes a list. The rest of the path
    is tried whole first, so that a last key may hold dots (capacity.tau=0.9)."""
    while path:
        if isinstance(data, dict) and path in data:
            return data[path]
        key, _, path = path.partition(".")
        data = data[int(key)] if isinstance(data, list) else data[key]
    return data


@functools.cache
def parameters(preset):
    """The parameter count of a train.py preset's model: its tokenizer trained as train.py does
    (about 2 s: the BPE stops short of vocab_size on the toy's text), the model on the meta device."""
    import torch
    sys.path.insert(0, str(ROOT))
    import data, tokenizer, train
    from model import GPT, GPTConfig
    cfg = train.PRESETS[preset]
    splits = data.load_splits(None, cfg["seed"], cfg["n_train"], cfg["tasks"])
    tok = tokenizer.Tokenizer.train(map(data.plain_text, splits["train"]), cfg["vocab_size"])
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=tok.n_vocab, **{k: cfg[k] for k in train.MODEL_KEYS}))
    return sum(p.numel() for p in model.parameters())


FORMATS = {
    "pct": lambda v: f"{100 * v:.1f}%",  # a fraction as a percentage
    "pct0": lambda v: f"{100 * v:.0f}%",
    "min": lambda v: f"{v / 60:.1f} min",  # seconds as minutes
    "M": lambda v: f"{v / 1e6:.2f}M",  # a count in millions
    "int": lambda v: f"{v:,}",
    "x": lambda v: f"{v:.2f}x",  # a ratio, e.g. a speedup
    "ci": lambda v: f"[{100 * v[0]:.1f}, {100 * v[1]:.1f}]",  # an interval of fractions, in points
    "dur": lambda v: f"{v:.1f} s" if v < 10 else f"{v:.0f} s" if v < 60 else f"{v / 60:.1f} min",
}


def figure(field):
    """One {field} of say(): FILE:PATH|FORMAT, e.g. train_cpu:KEY.seconds|min. FILE is a JSON in
    docs/, or `parameters` with a preset's name as the path. FORMAT is one of FORMATS or a Python
    format spec (.2f); without it the value as it is."""
    source, _, fmt = field.partition("|")
    name, _, path = source.partition(":")
    return formatted(parameters(path) if name == "parameters" else get(load(name), path), fmt)


def formatted(value, fmt):
    """value as FORMAT (one of FORMATS, a Python format spec, or "" for the value as it is)."""
    if value is None:
        return "not yet measured"
    return FORMATS[fmt](value) if fmt in FORMATS else format(value, fmt)


def say(template):
    """Print template with each {FILE:PATH|FORMAT} replaced by its figure."""
    print(re.sub(r"\{([\w.-]+:[^}|]+(?:\|[^}]+)?)\}", lambda m: figure(m.group(1)), template))


# the README and docs/results.md


def table(header, rows):
    """A markdown table."""
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")


def results_table(run, file="train_cpu"):
    """The closing summary of a `python train.py` run (its summary_test rows): the README's
    Results. run: the run's key in docs/FILE.json."""
    rows = get(load(file), run)["summary_test"]
    table(["decoder (default run)", "accuracy", "tokens/forward"],
          [(r["model"].replace("tau=", "tau = "), FORMATS["pct"](r["accuracy"]),
            f"{r['tokens_per_forward']:.2f}") for r in rows])


def test_times():
    """The README's two tiers of tests, each with its measured time (docs/test_times.json)."""
    d = load("test_times")
    for tier in d["tiers"].values():
        s, n = tier["seconds"], tier["passed"]
        took = "not yet measured" if s is None or n is None else f"{n} passed in {s / 60:.1f} min"
        print(f"- `{tier['command']}`: {took}")
    if d["commit"]:
        machine = ", ".join(f"{k} {v}" for k, v in d["machine"].items() if v is not None)
        print(f"\nOn {machine}; commit {d['commit']} ([`docs/test_times.json`](docs/test_times.json)).")


# real models, gpu, serving


def records(file, paths, columns, where=None):
    """A table of the records of docs/FILE.json: each of paths leads to one record (a dict) or a
    list of them. columns maps each header to a template whose {PATH|FORMAT} fields are read from
    the record ("-" where it has none); where maps a path to the values a record must hold there."""
    def cell(record, template):
        def field(m):
            try:
                return formatted(get(record, m.group(1)), m.group(2) or "")
            except (KeyError, IndexError, TypeError):
                return "-"
        return re.sub(r"\{([^{}|]+)(?:\|([^{}]*))?\}", field, template)

    data, rows = load(file), []
    for path in paths:
        found = get(data, path)
        rows += found if isinstance(found, list) else [found]
    rows = [r for r in rows if all(get(r, k) in v for k, v in (where or {}).items())]
    table(list(columns), [[cell(r, t) for t in columns.values()] for r in rows])


# the command


def main(argv=None):
    """python -m extras.pages [--check]: rewrite every page (or check it) with cog."""
    from cogapp import Cog
    check = ["--check"] if "--check" in (argv or sys.argv[1:]) else ["-r"]
    return Cog().main(["cog", *check, *COG, *(str(ROOT / p) for p in PAGES)])


if __name__ == "__main__":
    sys.exit(main())
