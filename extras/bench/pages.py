"""The figures of README.md and docs/*.md, written from the JSON files in docs/ by cogapp.

A figure from a run is never typed: it sits in a block that a one-line call writes,
inside HTML comments so that the rendered page shows only the text:

    <!-- [[[cog pages.results_table("cpu_preset_muon_epyc_avx2_2026_12_05") ]]] -->
    | decoder (default run) | accuracy | tokens/forward |
    ...
    <!-- [[[end]]] -->

After a JSON in docs/ changes, rewrite every page with

    python -m extras.bench.pages    # = cog -r -P -I extras/bench -p "import pages" README.md docs/*.md

and `python -m extras.bench.pages --check` fails when a page differs from its files (tests/test_pages.py
runs it). Each generator prints its lines (cog's -P). A figure inside a sentence is written by
say(), from a template whose {fields} name a JSON file and a path inside it.
"""
import argparse
import functools
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in DOCS.glob("*.md"))]
COG = ["-P", "-I", str(ROOT / "extras" / "bench"), "-p", "import pages"]


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
    splits = data.load_splits(None, cfg["data_seed"], cfg["n_train"], cfg["tasks"], mix=cfg["mix"])
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
        prefix = named[head]
        source = prefix + ("." if rest and not prefix.endswith(":") else "") + rest
    name, _, path = source.partition(":")
    value = get(preset(path.split(".")[0]), path.partition(".")[2]) if name == "preset" \
        else get(load(name), path)
    if value is None:
        return "not yet measured"
    return FORMATS[fmt](value) if fmt in FORMATS else format(value, fmt)


def say(template, **named):
    """Print template with each {field} replaced by its figure (see figure); named: short names
    for long prefixes, e.g. say("{run.seconds|min}", run="train_cpu:KEY")."""
    print(re.sub(r"\{([\w.:= -]+(?:\|[^}]+)?)\}", lambda m: figure(m.group(1), named), template))


# the README and docs/results.md


def table(header, rows):
    """A markdown table."""
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")


def model_name(name):
    return name.replace("tau=", "tau = ")


def results_table(run, file="train_cpu"):
    """The closing summary of a `python train.py` run: the README's Results. run: the run's key in
    docs/FILE.json; its summary (summary.json: each accuracy's 95% interval, and MARS at tau = 1.0
    against stage 1 on the same prompts), or an older run's summary_test rows (no intervals)."""
    entry = get(load(file), run)
    if "summary" not in entry:
        table(["decoder (default run)", "accuracy", "tokens/forward"],
              [(model_name(r["model"]), pct(r["accuracy"]), f"{r['tokens_per_forward']:.2f}")
               for r in entry["summary_test"]])
        return
    rows, pair = entry["summary"]["table"], entry["summary"]["mars_tau1_minus_ar"]
    interval = lambda lo_hi: f"[{100 * lo_hi[0]:.1f}, {100 * lo_hi[1]:.1f}]"
    table(["decoder", "accuracy", "95% interval", "tokens/forward"],
          [(model_name(r["model"]), pct(r["accuracy"]), interval(r["ci95"]), f"{r['tokens_per_forward']:.2f}")
           for r in rows])
    lo, hi = pair["ci"]
    print(f"\nMARS at tau = 1.0 minus stage 1, prompt by prompt on the same {pair['n']} prompts: "
          f"{100 * pair['diff']:+.1f} points, 95% interval [{100 * lo:+.1f}, {100 * hi:+.1f}] (right only "
          f"with MARS: {pair['a_only']}; only with stage 1: {pair['b_only']}; McNemar p = {pair['p_value']:.2g}).")


READING = {  # the README's reading order: file -> what it holds ({generate}: its lines)
    "mars.py": "the paper only: the mask, the noisy copy, the loss; the small rules of decoding",
    "sample.py": "`generate` (lines {generate}), the paper's loop above; `predictions`, one forward",
    "train.py": "the presets, data, model, optimizer, the loop of every stage, evaluation, checkpoints",
    "model.py": "the transformer of Qwen2 and Llama, any attention mask, a plain KV cache",
    "common.py": "what every command line shares; checkpoints saved and loaded",
}


def reading_order():
    """The README's reading order, each file with its length in lines (counted, not typed)."""
    import ast
    tree = ast.parse((ROOT / "sample.py").read_text())
    gen = next(f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "generate")
    lines = lambda name: len((ROOT / name).read_text().splitlines())
    table(["file", "lines", "what it holds"],
          [(f"`{name}`", lines(name), what.format(generate=f"{gen.lineno}-{gen.end_lineno}"))
           for name, what in READING.items()])


def recipe(name):
    """A train.py preset in a sentence, with its model's size."""
    p, e, pct0 = preset(name), FORMATS["e"], FORMATS["pct0"]
    muon = " (on the hidden matrices, AdamW on the rest)" if p["optimizer"] == "muon" else ""
    decay = f" (flat, then to zero over the last {pct0(p['decay'])})" if p["schedule"] == "wsd" else " (to zero)"
    mix = p.get("mix") and " (shares over `data.MIX`'s: " + ", ".join(f"{k} {v:g}" for k, v in p["mix"].items()) + ")"
    print(f"- **The recipe** (`train.PRESETS['{name}']`): {p['n_layer']} layers of width {p['n_embd']}, "
          f"{FORMATS['M'](p['parameters'])} parameters, a {p['vocab']:,}-token vocabulary, "
          f"{p['n_train']:,} training examples{mix or ''} at batch {p['batch_size']}. Stage 1 (AR SFT) takes "
          f"{p['ar_iters']:,} steps at a peak rate of {e(p['lr'])}, stage 2 (MARS, B = {p['B']}, "
          f"ar_weight {p['ar_weight']}) {p['mars_iters']:,} at {e(p['mars_lr'])}; optimizer {p['optimizer']}{muon}, "
          f"warmup {pct0(p['warmup'])}, schedule {p['schedule']}{decay}, {p['buckets']} length buckets; "
          "bf16 autocast where the hardware has native bf16, float32 elsewhere.")


def default_run(run, file="train_cpu"):
    """A timed `python train.py` run in a sentence: time, stages, machine, precision, validation."""
    r = get(load(file), run)
    m = r["machine"]
    print(f"- **{r.get('label', 'The default run, timed')}** (`{r['command']}`, {r['date']}, on the {m['cores']} cores of an "
          f"{m['lscpu']}, CPU capability {m['cpu_capability']}, torch {m['torch']}, {m['threads']} threads; "
          f"{r['conditions']}): **{FORMATS['min'](r['seconds'])}**, stage 1 {r['stage_seconds']['ar']:.0f} s, "
          f"stage 2 {r['stage_seconds']['mars']:.0f} s, peak memory {r['peak_rss_mib']} MiB, in "
          f"{r['precision']['dtype']} ({r['precision']['reason']}). Validation accuracy (greedy): "
          f"{pct(r['val']['ar']['accuracy'])} after stage 1, {pct(r['val']['mars']['accuracy'])} "
          "after stage 2 at tau = 1.0.")


def preset_search(file="preset_search_cpu"):
    """The preset search's candidates (wall time, validation accuracy, the chosen ones marked),
    then why the cpu preset was chosen."""
    d = load(file)
    chosen = set(d["chosen"].values())
    rows = []
    for c in d["candidates"]:
        mars = f"{pct(c['mars_tau0.95']['accuracy'])} at {c['mars_tau0.95']['tokens_per_forward']:.2f}" \
            if "mars_tau0.95" in c else "-"
        rows.append((f"`{c['name']}`" + (" (chosen)" if c["name"] in chosen else ""),
                     f"{c['wall_s'] / 60:.1f}", pct(c["ar_val"]["accuracy"]), mars))
    table(["candidate", "minutes", "stage 1 validation accuracy", "MARS tau = 0.95: accuracy at tokens/forward"],
          rows)
    print(f"\nWhy this one (the file's `chosen_why`): {d['chosen_why']['cpu']}.")


def family_search(file="family_search_cpu"):
    """The search for the cpu preset's families: each candidate's change, minutes, and validation
    accuracy overall and of its worst family, stage 1 and MARS; then the choice and why."""
    d = load(file)
    worst = lambda r: "{} {}".format(*min(((round(100 * v), k) for k, v in r["per_task"].items()))[::-1])
    rows = []
    for c in d["candidates"]:
        s1 = c.get("ar_val")
        m = c["mars_tau0.95"]
        rows.append((f"`{c['name']}`" + (" (chosen)" if c["name"] == d.get("chosen") else ""),
                     re.sub(r" --init_from \S+", "", " ".join(c["changed"])) or "the cpu preset as it was",
                     "not timed" if c.get("untimed") else f"{c['wall_s'] / 60:.1f}",
                     f"{pct(s1['accuracy'])} ({worst(s1)})" if s1 else "-",
                     f"{pct(c['mars_tau1.0']['accuracy'])} ({worst(c['mars_tau1.0'])})",
                     f"{pct(m['accuracy'])} at {m['tokens_per_forward']:.2f} ({worst(m)})"))
    table(["candidate", "changed", "minutes (--stage mars: that stage, from cpu_mix's stage 1)", "stage 1 (worst family)", "MARS tau = 1.0 (worst)",
           "tau = 0.95: accuracy at tokens/forward (worst)"], rows)
    m = d["machine"]
    print(f"\nTimed one at a time on the {m['cores']} cores of an {m['cpu']} (torch CPU capability "
          f"{m['cpu_capability']}), in float32; validation prompts only, the same for every candidate.")
    if d.get("chosen_why"):
        print(f"\nWhy (the file's `chosen_why`): {d['chosen_why']}")


def before_now(before="eval_cpu_preset_before", now="eval_cpu_preset_now", tau=0.95):
    """extras.bench.eval on the 2,000 test prompts, the cpu preset before its shares and stage 2's
    lr changed and now: stage 1 and MARS at tau, overall and per family."""
    runs = [load(f) for f in (before, now)]
    rows = [{(r["decoder"], r["threshold"]): r for r in d["quality"]} for d in runs]
    keys = [("ar", None), ("mars", tau)]
    cell = lambda r, family=None: pct(r["per_task"][family]["accuracy"] if family else r["accuracy"])
    header = [f"{'stage 1' if k[0] == 'ar' else f'tau = {tau}'}, {when}" for when in ("before", "now") for k in keys]
    table(["family", *header],
          [("all", *(cell(r[k]) for r in rows for k in keys))] +
          [(f, *(cell(r[k], f) for r in rows for k in keys)) for f in runs[0]["quality"][0]["per_task"]])
    print(f"\nTokens per forward at tau = {tau}: {rows[0][keys[1]]['tokens_per_forward']:.2f} before, "
          f"{rows[1][keys[1]]['tokens_per_forward']:.2f} now. Both on {runs[1]['machine']}, "
          f"float32 checkpoints.")


def failures(families=("add", "count"), file="failures_cpu"):
    """The weak families before the cpu preset's shares and stage 2's lr changed and now, on the
    same test prompts: each group's accuracy (extras.bench.failures' groups), stage 2 against
    stage 1 prompt by prompt, and a wrong answer from before."""
    d = load(file)
    before, now = d["before"], d["now"]
    tau = list(before["decoders"])[-1]
    for family in families:
        b, n = before["families"][family], now["families"][family]
        rows = [("all", b["n"], b["accuracy"], n["accuracy"])]
        rows += [(f"{feature}: {g}", s["n"], s["accuracy"], n["groups"][feature][g]["accuracy"])
                 for feature, groups in b["groups"].items() for g, s in groups.items()]
        print(f"\n**{family}**\n")
        table(["group", "prompts", "stage 1, before", f"{model_name(tau)}, before", "stage 1, now",
               f"{model_name(tau)}, now"],
              [(label, k, pct(x["stage 1"]), pct(x[tau]), pct(y["stage 1"]), pct(y[tau])) for label, k, x, y in rows])
        stage2 = lambda r: r["vs_stage_1"]["MARS tau=1.0"]
        print(f"\nStage 2 against stage 1 at tau = 1.0, right only with MARS / only with stage 1: "
              f"{stage2(b)['a_only']} / {stage2(b)['b_only']} before, {stage2(n)['a_only']} / "
              f"{stage2(n)['b_only']} now.", end="")
        where = lambda r: ", ".join(f"{k} {v}" for k, v in r["first_wrong_token"].items()) or "none wrong"
        print(f" Where {model_name(tau)} first left the reference: {where(b)} before; {where(n)} now.", end="")
        for w in b["wrong"][tau][:1]:
            print(f" Before, {model_name(tau)} answered \"{w['prompt']}\" with `{w['got']}` (`|` between "
                  f"forwards; expected `{w['expected']}`).", end="")
        print()


def profile(file="profile_muon_cpu"):
    """Where a training step's time goes, per stage (profile_train's summary), and what bounds it."""
    d = load(file)
    a, m = d["summary"]["ar"], d["summary"]["mars"]
    print(f"[`{file}.json`]({file}.json), `{d['command']}`: the cpu preset's step (batch {d['batch_size']}, "
          f"float32), {d['steps']} steps a stage, {d['machine']}. FLOPs: 2 M K N a matmul, x3 with the backward.\n")
    table(["per step", "stage 1 (AR)", "stage 2 (MARS)"], [
        (what, fmt.format(**a), fmt.format(**m)) for what, fmt in (
            ("time, model FLOPs", "{step_ms} ms, {model_gflop} GFLOP"),
            ("achieved", "{gflop_s} GFLOP/s, {percent_of_float32_peak}% of the float32 peak"),
            ("forward + backward; at the matmuls' own speed", "{forward_backward_ms} ms; "
                                                              "{forward_backward_at_matmuls_alone_ms} ms"),
            ("Muon's step", "{muon_ms} ms, {muon_percent_of_step}%"),
            ("host: a batch of 1", "{host_ms} ms, {host_percent_of_step}%"))])
    print(f"\nPeaks at {a['threads']} threads: a float32 matmul {a['float32_peak_gflop_s']} GFLOP/s, bf16 "
          f"{a['bfloat16_peak_gflop_s']}. Newton-Schulz is {a['newton_schulz_gflop']} GFLOP a step "
          f"({a['newton_schulz_percent_of_flops']}% of stage 1's FLOPs), {a['newton_schulz_alone_ms']} ms alone. "
          f"The targets: forward and backward outside the matmuls ({a['forward_backward_ms']} ms against "
          f"{a['forward_backward_at_matmuls_alone_ms']} at the matmuls' own speed: norms, rotary, activations, "
          f"attention's small products, the loss), then Muon's step; the host ({a['host_percent_of_step']}%) "
          f"does not bound it. {d['note']}.")


# the evaluation (extras.bench.eval's JSON)

TAUS = (1.0, 0.95, 0.9, 0.7, 0.5)  # the thresholds a page shows; the JSON holds more


def decoder(r):
    names = {"ar": "AR SFT (stage 1)", "control": "control (stage 1 + AR steps)", "lossless": "MARS lossless"}
    return names.get(r["decoder"], f"MARS tau = {r['threshold']}")


def quality(file="eval_cpu"):
    """Accuracy with its interval, tokens per forward, and the family each decoder does worst on."""
    q = [r for r in load(file)["quality"] if r["threshold"] in (None, *TAUS)]
    worst = lambda r: min(r["per_task"].items(), key=lambda kv: kv[1]["accuracy"])
    table(["decoder", "accuracy", "95% CI", "tokens/forward", "its weakest family"],
          [(decoder(r), pct(r["accuracy"]), ci(r["ci"]), f"{r['tokens_per_forward']:.2f}",
            f"{worst(r)[0]} {pct(worst(r)[1]['accuracy'])}") for r in q])


def paired(file="eval_cpu"):
    """The paired comparisons: difference in points, Newcombe's interval, McNemar's p; then
    the decoders that must equal AR, token for token."""
    d = load(file)
    table(["comparison", "difference", "95% CI", "p", "right only in the first / the second"],
          [(f"{p['a']} vs {p['b']}", FORMATS["pts"](p["diff"]), ci(p["ci"]), f"{p['p_value']:.2g}",
            f"{p['a_only']} / {p['b_only']}") for p in d["paired"]
           if "tau=" not in p["a"] or float(p["a"].split("tau=")[1]) in TAUS])
    same = d["identical_to_ar"]
    print(f"\nToken for token against the same checkpoint decoded as AR (`--ar`): lossless differs on "
          f"{same['lossless_differ']} of {same['n']:,} prompts, tau = 1.0 on {same['tau1_differ']}.")


def sweeps(key, file="eval_cpu"):
    """A tau sweep per checkpoint (key "ablations") or per confidence metric ("metrics"):
    accuracy % (tokens per forward)."""
    d = load(file)[key]
    rows = [(a["label"], a["sweep"]) for a in d] if key == "ablations" else list(d.items())
    rows = [(name, [r for r in sweep if r["threshold"] in TAUS]) for name, sweep in rows]
    table(["checkpoint" if key == "ablations" else "metric", *(f"tau = {r['threshold']}" for r in rows[0][1])],
          [(name, *(f"{100 * r['accuracy']:.1f} ({r['tokens_per_forward']:.2f})" for r in sweep))
           for name, sweep in rows])


def masks(file="masks_cpu", tau=0.95):
    """--masks auto against fixed and AR, per batch size and cache (masks_bench's rows)."""
    d = load(file)
    rows = [r for r in d["rows"] if r["tau"] in (None, tau)]
    ar = {r["batch_size"]: r for r in rows if r["decoder"] == "ar"}
    by = {}
    for r in rows:
        if r["decoder"] != "ar":
            by.setdefault((r["cache"], r["B_cache"], r["batch_size"]), {})[r["decoder"]] = r
    print(f"`python -m extras.bench.masks_bench` ([`{file}.json`]({file}.json)): AR, fixed and auto interleaved "
          f"over {d['rounds']} rounds, speed on {d['timing_prompts']} held-out prompts (the median of the per-round "
          f"ratios to AR), accuracy on {d['accuracy_prompts']:,}; {d['machine']}; tau = {tau} (every row, tau = "
          "0.9 too: the file's `rows`).\n")
    table(["batch", "cache", "AR tok/s", "fixed vs AR", "auto vs AR", "accuracy fixed / auto"],
          [(b, cache + (f" (B_cache {bc})" if bc else ""), f"{ar[b]['tokens_per_second']:.0f}",
            *(f"{r[k]['speedup']:.2f}x" for k in ("fixed", "auto")),
            " / ".join(pct(r[k]["accuracy"]) for k in ("fixed", "auto")))
           for (cache, bc, b), r in sorted(by.items(), key=lambda kv: (kv[0][0] != "sliding", kv[0][2]))])


def mutation(file="mutation"):
    """mutmut's score per file of the method (docs/mutation.json): the mutants of the listed
    functions that the fast tier kills, and what was left."""
    d = load(file)
    rows = []
    for path, r in d["files"].items():
        killed = r.get("killed", 0) + r.get("timeout", 0)
        rate = "-" if r["kill_rate"] is None else pct(r["kill_rate"])
        rows.append((f"`{path}`", ", ".join(f"`{f}`" for f in r["functions"]), r["mutants"], killed,
                     r.get("survived", 0), r.get("equivalent", 0), r.get("not checked", 0), rate))
    table(["file", "functions (mutmut's names)", "mutants", "killed", "survived", "equivalent", "not run",
           "kill rate"], rows)
    print(f"\n`{d['command']}` ({d['settings']}), commit {d['commit']}, {d['machine']['cpu']}; every survivor "
          f"with its line and the mutant's: the JSON's `survivors` ({len(d['survivors'])}); equivalent ones "
          f"with the reason: `equivalent` ({len(d['equivalent'])}); not mutated (decorated): `untested`.")


def test_times():
    """The README's two tiers of tests, each with its measured time (docs/test_times.json, written by
    python -m extras.bench.tier_times)."""
    d = load("test_times")
    for tier in d["tiers"].values():
        if tier["seconds"] is None:
            print(f"- `{tier['command']}`: not yet measured")
            continue
        failed = f", {tier['failed']} failed" if tier["failed"] else ""
        print(f"- `{tier['command']}`: {tier['passed']} passed{failed} in {tier['seconds'] / 60:.1f} min "
              f"(commit {tier['commit']})")
    m = d["machine"]
    if m:
        print(f"\nFresh clones, {m['cpu']} ({m['cores']} cores, {m['cpu_capability']}): "
              f"[`docs/test_times.json`](docs/test_times.json).")


# real models, gpu, serving


def records(sources, columns, where=None):
    """A table of records: each of sources, FILE:PATH, leads to one record (a dict) or a list of
    them in docs/FILE.json (PATH empty: the whole file). columns maps each header to a template
    whose {PATH|FORMAT?DEFAULT} fields are read from the record (DEFAULT where it has none, else
    "-", and "-" for the whole cell when it has none of them; a column that no record has is left
    out); where maps a path to the values a record must hold there."""
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

    def cell(record, template):
        fields = list(RECORD_FIELD.finditer(template))
        if fields and all(value(record, m[1]) is None and m[3] is None for m in fields):
            return "-"
        return RECORD_FIELD.sub(lambda m: field(record, m), template)

    rows = []
    for source in sources:
        name, _, path = source.partition(":")
        found = get(load(name), path)
        rows += found if isinstance(found, list) else [found]
    rows = [r for r in rows if all(value(r, k) in v for k, v in (where or {}).items())]
    cells = [[cell(r, t) for t in columns.values()] for r in rows]
    keep = [i for i in range(len(columns)) if any(row[i] != "-" for row in cells)]  # a column no record has goes
    table([list(columns)[i] for i in keep], [[row[i] for i in keep] for row in cells])


RECORD_FIELD = re.compile(r"\{([^{}|?]+)(?:\|([^{}?]*))?(?:\?([^{}]*))?\}")
# the columns of extras.serving.serve's runs (serve.json), per phase and over the whole trace
SERVE = {"policy": "{policy}", "phase": "{phase?whole trace}", "latency p50 / p99 (s)": "{p50_latency|.3f} / {p99_latency|.3f}",
         "goodput (req/s)": "{goodput|.1f}", "tokens/forward": "{tokens_per_forward|.2f}", "mean tau": "{mean_tau|.3f}",
         "accuracy": "{accuracy|pct}"}
# the columns of extras.real.eval's decoders (quality only on checkable instructions), and of a
# wall-clock pass against AR (predicted only in extras.real.decode_speed's)
EVAL = {"model, decoder": "{decoder}", "checks passed (95% CI)": "{quality.pass|pct} {quality.ci|ci}",
        "tokens/forward": "{tokens_per_forward|.3f}", "teacher-forced agreement": "{ar_agreement|pct}",
        "identical to MARS AR": "{identical_to_mars_ar|pct}", "cut off": "{cut_off}"}
WALL = {"decoder": "{decoder}", "batch": "{batch_size}", "prompts": "{prompts}", "tokens/s": "{tokens_per_second|.1f}",
        "tokens/forward": "{tokens_per_forward|.3f}", "speedup over AR": "{speedup|x}",
        "predicted": "{predicted_speedup|x}"}


# the command


def cog(paths, check=False):
    """cog over paths: rewrite them, or (check) fail when one differs from its files. 0 if fine."""
    from cogapp import Cog
    mode = ["--check", "--check-fail-msg", "rewrite with: python -m extras.bench.pages"] if check else ["-r"]
    return Cog().main(["cog", *mode, "--verbosity", "1", *COG, *map(str, paths)])


def main(argv=None):
    """python -m extras.bench.pages [--check]: rewrite every page (or check it)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="rewrite nothing: fail when a page differs from its files")
    return cog([ROOT / page for page in PAGES], check=p.parse_args(argv).check)


if __name__ == "__main__":
    sys.exit(main())
