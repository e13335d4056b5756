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
def model_size(preset):
    """(parameters, vocabulary) of a train.py preset's model: its tokenizer trained as train.py
    trains it (about 2 s: the BPE stops short of vocab_size on the toy's text), the model built
    on the meta device. Figures from the code, so they follow the preset."""
    import torch
    sys.path.insert(0, str(ROOT))
    import data, tokenizer, train
    from model import GPT, GPTConfig
    cfg = train.PRESETS[preset]
    splits = data.load_splits(None, cfg["seed"], cfg["n_train"], cfg["tasks"])
    tok = tokenizer.Tokenizer.train(map(data.plain_text, splits["train"]), cfg["vocab_size"])
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=tok.n_vocab, **{k: cfg[k] for k in train.MODEL_KEYS}))
    return sum(p.numel() for p in model.parameters()), tok.n_vocab


def preset(name):
    """A train.py preset's settings, with its model's size (parameters, vocab)."""
    sys.path.insert(0, str(ROOT))
    import train
    n, vocab = model_size(name)
    return {**train.PRESETS[name], "parameters": n, "vocab": vocab}


FORMATS = {
    "pct": lambda v: f"{100 * v:.1f}%",  # a fraction as a percentage
    "pct0": lambda v: f"{100 * v:.0f}%",
    "min": lambda v: f"{v / 60:.1f} min",  # seconds as minutes
    "M": lambda v: f"{v / 1e6:.2f}M",  # a count in millions
    "int": lambda v: f"{v:,}",
    "x": lambda v: f"{v:.2f}x",  # a ratio, e.g. a speedup
    "ci": lambda v: f"[{100 * v[0]:.1f}, {100 * v[1]:.1f}]",  # an interval of fractions, in points
    "dur": lambda v: f"{v:.1f} s" if v < 10 else f"{v:.0f} s" if v < 60 else f"{v / 60:.1f} min",
    "e": lambda v: f"{v:.0e}".replace("e-0", "e-"),  # a rate: 6e-3
    "pts": lambda v: f"{100 * v:+.1f}",  # a difference of fractions, in points
}
pct, ci = FORMATS["pct"], FORMATS["ci"]


def figure(field, named):
    """One {field} of say(): SOURCE:PATH|FORMAT. SOURCE is a JSON file in docs/ (train_cpu) or
    `preset` (train.py's presets: preset:cpu.lr, preset:cpu.parameters); a field without a colon
    starts with one of say()'s names, which stands for a SOURCE:PATH prefix. FORMAT is one of
    FORMATS or a Python format spec (.2f); without it the value as it is."""
    source, _, fmt = field.partition("|")
    if ":" not in source:
        head, _, rest = source.partition(".")
        source = named[head] + (f".{rest}" if rest else "")
    name, _, path = source.partition(":")
    value = get(preset(path.split(".")[0]), path.partition(".")[2]) if name == "preset" \
        else get(load(name), path)
    if value is None:
        return "not yet measured"
    return FORMATS[fmt](value) if fmt in FORMATS else format(value, fmt)


def say(template, **named):
    """Print template with each {field} replaced by its figure (see figure); named: short names
    for long prefixes, e.g. say("{run.seconds|min}", run="train_cpu:KEY")."""
    print(re.sub(r"\{([\w.:=-]+(?:\|[^}]+)?)\}", lambda m: figure(m.group(1), named), template))


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
          [(r["model"].replace("tau=", "tau = "), pct(r["accuracy"]), f"{r['tokens_per_forward']:.2f}")
           for r in rows])


def side_by_side(run, old, file="train_cpu"):
    """Two runs' closing summaries side by side (the current preset's and an earlier one's)."""
    d = load(file)
    new_rows, old_rows = d[run]["summary_test"], d[old]["summary_test_2000"]
    table(["decoder", f"`{run}` ({new_rows[0]['n']} test prompts)", f"`{old}` (2,000 test prompts)"],
          [(a["model"].replace("tau=", "tau = "),
            *(f"{pct(r['accuracy'])}, {r['tokens_per_forward']:.2f} tok/fwd" for r in (a, b)))
           for a, b in zip(new_rows, old_rows)])


def preset_search(file="preset_search_cpu"):
    """The preset search's candidates: wall time and validation accuracy, the chosen one marked."""
    d = load(file)
    chosen = set(d["chosen"].values())
    rows = []
    for c in d["candidates"]:
        mars = [f"{pct(c[k]['accuracy'])} at {c[k]['tokens_per_forward']:.2f}" for k in ("mars_tau0.95",) if k in c]
        rows.append((f"`{c['name']}`" + (" (chosen)" if c["name"] in chosen else ""),
                     f"{c['wall_s'] / 60:.1f}", pct(c["ar_val"]["accuracy"]), *(mars or ["-"])))
    table(["candidate", "minutes", "stage 1 validation accuracy", "MARS tau = 0.95: accuracy at tokens/forward"],
          rows)


def profile(file="profile_muon_cpu"):
    """Where a training step's time goes, per stage (profile_train's summary)."""
    d = load(file)["summary"]
    a, m = d["ar"], d["mars"]
    cell = lambda x, fmt: fmt.format(**x)
    table(["per step", "stage 1 (AR)", "stage 2 (MARS)"], [
        (what, cell(a, fmt), cell(m, fmt)) for what, fmt in (
            ("time, model FLOPs", "{step_ms} ms, {model_gflop} GFLOP"),
            ("achieved", "{gflop_s} GFLOP/s, {percent_of_float32_peak}% of the float32 peak"),
            ("forward + backward; at the matmuls' own speed", "{forward_backward_ms} ms; {forward_backward_at_matmuls_alone_ms} ms"),
            ("Muon's step", "{muon_ms} ms, {muon_percent_of_step}%"),
            ("host: a batch of 1", "{host_ms} ms, {host_percent_of_step}%"))])


# the evaluation (extras.bench.eval's JSON)


def decoder(r):
    names = {"ar": "AR SFT (stage 1)", "control": "control (stage 1 + AR steps)", "lossless": "MARS lossless"}
    return names.get(r["decoder"], f"MARS tau = {r['threshold']}")


def quality(file="eval_cpu"):
    """Accuracy with its interval, tokens per forward and accuracy per family, per decoder."""
    q = load(file)["quality"]
    tasks = list(q[0]["per_task"])
    table(["decoder", "all", "95% CI", "tokens/forward", *tasks],
          [(decoder(r), f"{100 * r['accuracy']:.1f}", ci(r["ci"]), f"{r['tokens_per_forward']:.2f}",
            *(f"{100 * r['per_task'][t]['accuracy']:g}" for t in tasks)) for r in q])


def paired(file="eval_cpu"):
    """The paired comparisons: difference in points, Newcombe's interval, McNemar's p."""
    table(["comparison", "difference", "95% CI", "p", "right only in the first / the second"],
          [(f"{p['a']} vs {p['b']}", FORMATS["pts"](p["diff"]), ci(p["ci"]), f"{p['p_value']:.2g}",
            f"{p['a_only']} / {p['b_only']}") for p in load(file)["paired"]])


def per_length(file="eval_cpu"):
    """Accuracy % (tokens per forward) per answer length."""
    q = load(file)["quality"]
    groups = list(q[0]["per_length"])
    table(["decoder", *(f"{g} (n={q[0]['per_length'][g]['n']})" for g in groups)],
          [(decoder(r), *(f"{100 * r['per_length'][g]['accuracy']:.1f} ({r['per_length'][g]['tokens_per_forward']:.2f})"
                          for g in groups)) for r in q])


def sweeps(key, file="eval_cpu"):
    """A tau sweep per checkpoint (key "ablations") or per confidence metric ("metrics"):
    accuracy % (tokens per forward)."""
    d = load(file)[key]
    rows = [(a["label"], a["sweep"]) for a in d] if key == "ablations" else list(d.items())
    table(["checkpoint" if key == "ablations" else "metric", *(f"tau = {r['threshold']}" for r in rows[0][1])],
          [(name, *(f"{100 * r['accuracy']:.1f} ({r['tokens_per_forward']:.2f})" for r in sweep))
           for name, sweep in rows])


def speed(file="eval_cpu"):
    """The wall clock against AR: per decoder, the speedup at each batch size [min, max over
    repeats], tokens per forward."""
    rows = load(file)["speed"]
    batches = sorted({s["batch_size"] for s in rows})
    by = {}
    for s in rows:
        by.setdefault((s["decoder"], s["threshold"], s["cache_block"]), {})[s["batch_size"]] = s
    out = []
    for (dec, tau, block), cells in by.items():
        name = dec + (f", B_cache {block}" if block else "")
        out.append((name, tau or "-", *(
            "" if b not in cells else f"{cells[b]['tokens_per_second']:.0f} tok/s" if dec == "ar" else
            f"{cells[b]['speedup']:.2f}x [{cells[b]['speedup_spread'][0]:.2f}, {cells[b]['speedup_spread'][1]:.2f}], "
            f"{cells[b]['tokens_per_forward']:.2f}" for b in batches)))
    table(["decoder", "tau", *(f"batch {b}" for b in batches)], out)


def masks(file="masks_cpu", tau=0.95):
    """--masks auto against fixed and AR, per batch size and cache (masks_bench's rows)."""
    rows = [r for r in load(file)["rows"] if r["tau"] in (None, tau)]
    ar = {r["batch_size"]: r for r in rows if r["decoder"] == "ar"}
    by = {}
    for r in rows:
        if r["decoder"] != "ar":
            by.setdefault((r["cache"], r["B_cache"], r["batch_size"]), {})[r["decoder"]] = r
    table(["batch", "cache", "AR tok/s", "fixed vs AR", "auto vs AR", "accuracy fixed / auto"],
          [(b, cache + (f" (B_cache {bc})" if bc else ""), f"{ar[b]['tokens_per_second']:.0f}",
            *(f"{r[k]['speedup']:.2f}x" for k in ("fixed", "auto")),
            " / ".join(pct(r[k]["accuracy"]) for k in ("fixed", "auto")))
           for (cache, bc, b), r in by.items()])


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


def records(sources, columns, where=None):
    """A table of records: each of sources, FILE:PATH, leads to one record (a dict) or a list of
    them in docs/FILE.json (PATH empty: the whole file). columns maps each header to a template
    whose {PATH|FORMAT?DEFAULT} fields are read from the record (DEFAULT, else "-", where it has
    none); where maps a path to the values a record must hold there."""
    def value(record, path):
        try:
            return get(record, path)
        except (KeyError, IndexError, TypeError):
            return None

    def field(record, m):
        path, fmt, default = m.groups()
        v = value(record, path)
        if v is None:
            return "-" if default is None else default
        return FORMATS[fmt](v) if fmt in FORMATS else format(v, fmt or "")

    rows = []
    for source in sources:
        name, _, path = source.partition(":")
        found = get(load(name), path)
        rows += found if isinstance(found, list) else [found]
    rows = [r for r in rows if all(value(r, k) in v for k, v in (where or {}).items())]
    table(list(columns), [[re.sub(r"\{([^{}|?]+)(?:\|([^{}?]*))?(?:\?([^{}]*))?\}", lambda m: field(r, m), t)
                           for t in columns.values()] for r in rows])


# the columns of extras.serving.serve's runs (serve.json), per phase and over the whole trace
SERVE = {"policy": "{policy}", "phase": "{phase?whole trace}", "latency p50 / p99 (s)": "{p50_latency|.3f} / {p99_latency|.3f}",
         "goodput (req/s)": "{goodput|.1f}", "tokens/forward": "{tokens_per_forward|.2f}", "mean tau": "{mean_tau|.3f}",
         "accuracy": "{accuracy|pct}"}


# the command


def main(argv=None):
    """python -m extras.pages [--check]: rewrite every page (or check it) with cog."""
    from cogapp import Cog
    check = ["--check"] if "--check" in (argv or sys.argv[1:]) else ["-r"]
    return Cog().main(["cog", *check, *COG, *(str(ROOT / p) for p in PAGES)])


if __name__ == "__main__":
    sys.exit(main())
