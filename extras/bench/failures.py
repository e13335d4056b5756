"""Where the weak families fail: held-out prompts grouped by what plausibly makes them hard
(add's carries, count's absent letters and long words, multiples' n and k, words' digits),
with each group's accuracy for stage 1 and MARS, the prompts stage 2 wins and loses, where
MARS's first wrong token was committed, and a few wrong answers.

    python -m extras.bench.failures --ar_ckpt out/ar.pt --ckpt out/mars.pt --out docs/failures_cpu.json

The groups come from the prompts and answers alone, never from the model.
"""
import json
import re
import subprocess
import sys

import data
import sample
import stats
import train
from common import Parser, UserError, load_checkpoint, model_from_checkpoint, run_cli, threshold
from extras.bench.course_search import machine

N_EXAMPLES = 3  # wrong answers kept per family and decoder


def word_length(e):  # "... letter l appear in lemon?" / "... letter l in the word lemon."
    n = len(re.search(r"letter \w (?:appear in|in the word) (\w+)", e["prompt"]).group(1))
    return "3-4" if n <= 4 else str(n)


def multiples(e):
    return [int(x) for x in e["answer"].split(", ")]


FEATURES = {  # family: {feature: example -> its group}
    "add": {"ones carry": lambda e: str(int(sum(int(a[-1]) for a in re.findall(r"\d+", e["prompt"])) >= 10)),
            "sum >= 100": lambda e: "yes" if int(e["answer"]) >= 100 else "no"},
    "count": {"letter": lambda e: "absent" if e["answer"] == "0" else "present",
              "count": lambda e: e["answer"] if int(e["answer"]) < 3 else "3+",
              "word length": word_length},
    "multiples": {"n": lambda e: str(len(multiples(e))),
                  "k": lambda e: "< 10" if multiples(e)[0] < 10 else ">= 10"},
    "words": {"digits": lambda e: str(len(re.search(r"\d+", e["prompt"]).group()))},
}


def decode(model, tok, B, tau, examples):
    """Each prompt's ids and what each forward committed, its text ("|" between forwards at
    tau < 1) and whether it is right, decoded in train.evaluate's batches."""
    done = []
    for i in range(0, len(examples), train.EVAL_BATCH):
        prompts = [tok.prompt_ids(e["prompt"]) for e in examples[i:i + train.EVAL_BATCH]]
        done += sample.generate(model, prompts, tok.eot, tok.mask, B, tau, n_vocab=tok.n_vocab)
    right = [int(data.check(e, tok.answer(out))) for e, (out, _) in zip(examples, done)]
    return {"done": done, "right": right,
            "text": [("|" if tau < 1 else "").join(filter(None, map(tok.answer, c))) for _, c in done]}


def first_wrong(tok, e, out, chunks):
    """Where the output leaves the reference response: in a forward that committed one token,
    as the AR token of several, as a mask's token, or never (the budget cut it off)."""
    ids, n_prompt = tok.example_ids(e["prompt"], e["response"])
    ref = ids[n_prompt:]
    at = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), len(out))
    for c in chunks:
        if at < len(c):
            return "single" if len(c) == 1 else "multi (AR token)" if at == 0 else "multi (mask token)"
        at -= len(c)
    return "cut off"


def accuracy(right):
    return round(sum(right) / len(right), 4)


def family_report(tok, examples, runs, tau_name):
    """One family's groups, pairs, first wrong tokens and wrong answers."""
    right = {name: r["right"] for name, r in runs.items()}
    groups = {}
    for feature, of in FEATURES[examples[0]["task"]].items():
        labels = [of(e) for e in examples]
        groups[feature] = {g: {"n": labels.count(g), "accuracy": {
            name: accuracy([r for r, lab in zip(rs, labels) if lab == g]) for name, rs in right.items()}}
            for g in sorted(set(labels))}
    ar = next(iter(runs))

    def answers(name, keep):  # up to N_EXAMPLES prompts where keep(right with stage 1, with name)
        return [{"prompt": e["prompt"], "stage 1": runs[ar]["text"][i], name: runs[name]["text"][i]}
                for i, e in enumerate(examples) if keep(right[ar][i], right[name][i])][:N_EXAMPLES]
    vs = {name: {**stats.paired(right[name], right[ar]), "lost": answers(name, lambda a, m: a > m),
                 "won": answers(name, lambda a, m: m > a)} for name in list(runs)[1:]}
    wrong = {name: [i for i, ok in enumerate(rs) if not ok] for name, rs in right.items()}
    firsts = [first_wrong(tok, examples[i], *runs[tau_name]["done"][i]) for i in wrong[tau_name]]
    return {"n": len(examples), "accuracy": {name: accuracy(rs) for name, rs in right.items()},
            "groups": groups, "vs_stage_1": vs,
            "first_wrong_token": {k: firsts.count(k) for k in sorted(set(firsts))},
            "wrong": {name: [{"prompt": examples[i]["prompt"], "expected": examples[i]["response"],
                              "got": runs[name]["text"][i]} for i in idx[:N_EXAMPLES]]
                      for name, idx in wrong.items()}}


def failures(ar_ckpt, mars_ckpt, families, tau, split, limit):
    """The decoders and each family's report, on the same held-out prompts."""
    held_out = data.splits_of(mars_ckpt["train_config"])[split]
    if [e["prompt"] for e in data.splits_of(ar_ckpt["train_config"])[split]] != \
            [e["prompt"] for e in held_out]:
        raise UserError("the two checkpoints hold out different prompts")
    B, tau_name = mars_ckpt["mars"]["B"], f"MARS tau={tau}"
    decoders = {"stage 1": (ar_ckpt, 1, 1.0), "MARS tau=1.0": (mars_ckpt, B, 1.0),
                tau_name: (mars_ckpt, B, tau)}
    models = {name: (*model_from_checkpoint(ckpt), b, t) for name, (ckpt, b, t) in decoders.items()}
    for model, *_ in models.values():
        model.eval()
    tok, report = models[tau_name][1], {}
    for f in families:
        examples = [e for e in held_out if e["task"] == f][:limit]
        if examples:  # a run may lack the family
            runs = {name: decode(*m, examples) for name, m in models.items()}
            report[f] = family_report(tok, examples, runs, tau_name)
    return {name: {"B": b, "tau": t} for name, (_, b, t) in decoders.items()}, report


def markdown(report):
    """Each family's groups as a table, its pairs and first wrong tokens in a line each."""
    def row(label, n, accuracy):
        return f"| {label} | {n} | " + " | ".join(f"{100 * a:.1f}" for a in accuracy.values()) + " |"
    lines = []
    for family, r in report.items():
        names = list(r["accuracy"])
        lines += [f"\n### {family}\n", f"| group | n | {' | '.join(names)} |", "|---" * (2 + len(names)) + "|",
                  row("all", r["n"], r["accuracy"])]
        lines += [row(f"{feature}: {g}", s["n"], s["accuracy"])
                  for feature, groups in r["groups"].items() for g, s in groups.items()]
        lines += [f"- {name} vs stage 1: right only with {name} {p['a_only']}, only with stage 1 "
                  f"{p['b_only']} (McNemar p = {p['p_value']:.2f})" for name, p in r["vs_stage_1"].items()]
        where = ", ".join(f"{k} {v}" for k, v in r["first_wrong_token"].items())
        lines.append(f"- {names[-1]}, first wrong token: {where or 'none wrong'}")
    return "\n".join(lines)


def main(argv=None):
    p = Parser(__doc__)
    p.add_argument("--ar_ckpt", default="out/ar.pt", help="stage 1's checkpoint (default out/ar.pt)")
    p.add_argument("--ckpt", default="out/mars.pt", help="stage 2's checkpoint (default out/mars.pt)")
    p.add_argument("--out", help="write the report here (JSON)")
    p.add_argument("--families", default="add,count,multiples,words",
                   help=f"comma-separated, of {','.join(FEATURES)} (default all four)")
    p.add_argument("--tau", type=threshold, default=0.95, help="MARS's second threshold (default 0.95)")
    p.add_argument("--split", choices=["test", "val"], default="test", help="held-out prompts (default test)")
    p.add_argument("--limit", type=int, help="the first LIMIT prompts of each family (default all)")
    args = p.parse_args(argv)
    families = args.families.split(",")
    if set(families) - set(FEATURES):
        p.error(f"--families: choose from {','.join(FEATURES)}")
    ckpts = {"ar": load_checkpoint(args.ar_ckpt), "mars": load_checkpoint(args.ckpt)}
    if "mars" not in ckpts["mars"]:
        raise UserError(f"{args.ckpt} is not a MARS checkpoint")
    decoders, report = failures(ckpts["ar"], ckpts["mars"], families, args.tau, args.split, args.limit)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    result = {"command": " ".join(["python -m extras.bench.failures", *(sys.argv[1:] if argv is None else argv)]),
              "machine": machine(), "commit": commit.stdout.strip(), "split": args.split,
              "limit": args.limit, "decoders": decoders,
              "checkpoints": {k: {"path": path, "preset": c["train_config"]["preset"],
                                  "mix": c["train_config"].get("mix")}
                              for (k, c), path in zip(ckpts.items(), (args.ar_ckpt, args.ckpt))},
              "families": report}
    print(markdown(report))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    run_cli(main)
