"""The searches behind the presets: candidates for `python train.py` (the cpu preset: all ten
families) and for `--preset course` (a class's run), each trained alone and timed, then chosen on
validation prompts only (the test split is what a run's own summary and extras.bench.eval report).

    python -m extras.bench.course_search --out docs/preset_search_cpu.json   # runs what is missing
    python -m extras.bench.course_search --plot docs/preset_search_cpu.json

A candidate is `python train.py FLAGS` over a preset, timed as a whole command (data, tokenizer,
the stages, their validation and the summary). A stage-1 screen (`--stage ar`) is scored by its
validation accuracy; a full run also by its mars.pt on the validation prompts at tau 1.0, 0.95 and
0.9 (untimed). --out appends to an existing file, so a search can be stopped and resumed; every
row records the machine it was timed on.
"""
import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time

import torch

import data
import train
from common import load_checkpoint, model_from_checkpoint

SIX = "spell,reverse,copy,words,convert,facts"
QUIET = "--eval_every 100000 --save_every 100000"  # one validation loss, one checkpoint a stage
VAL = 500  # validation prompts a candidate is scored on
M = "--n_embd 128 --optimizer muon"
MORE_WEAK = "add:2.4,count:5,multiples:1,words:1.5"  # the cpu preset's weakest families, more
CANDIDATES = {  # name: train.py flags (float32: the rule's choice on the search's AVX2-only CPU)
    # stage 1 alone, all ten families
    "s1_adamw_W128_1500": "--preset cpu --stage ar --n_embd 128 --ar_iters 1500 --lr 3e-3",
    "s1_muon_W128_1500": f"--preset cpu --stage ar {M} --ar_iters 1500 --lr 3e-3",
    "s1_muon_W128_1500_lr6e-3": f"--preset cpu --stage ar {M} --ar_iters 1500 --lr 6e-3",
    "s1_muon_W128_b64_750_lr6e-3": f"--preset cpu --stage ar {M} --batch_size 64 --ar_iters 750 "
                                   "--lr 6e-3",
    "s1_muon_W128_b64_1000_lr6e-3_wsd": f"--preset cpu --stage ar {M} --batch_size 64 "
                                        "--ar_iters 1000 --lr 6e-3 --schedule wsd",
    "s1_muon_W192_1000": "--preset cpu --stage ar --n_embd 192 --optimizer muon --ar_iters 1000 "
                         "--lr 3e-3",
    # both stages
    "full_muon_W128_b64_1400_500_lr6e-3_wsd": f"--preset cpu {M} --batch_size 64 --ar_iters 1400 "
                                              "--mars_iters 500 --lr 6e-3 --mars_lr 6e-3 "
                                              "--schedule wsd",
    "course_muon_W128_f6_800_400_wsd": f"--preset course {M} --ar_iters 800 --mars_iters 400 "
                                       "--lr 3e-3 --mars_lr 3e-3 --schedule wsd",
    # the cpu preset's families (docs/family_search_cpu.json): its mix, stage 2's lr, the cost
    "cpu": "--preset cpu",
    "cpu_mix": f"--preset cpu --mix {MORE_WEAK}",
    "cpu_again": "--preset cpu",  # the first cpu run shared the machine with other work: timed again alone
    "cpu_mix_count7": f"--preset cpu --mix {MORE_WEAK.replace('count:5', 'count:7')}",
    # stage 2 alone from cpu_mix's stage 1: its time is this stage's, plus cpu_mix's stage 1
    "cpu_mix_s2_mars_lr3e-3": f"--preset cpu --mix {MORE_WEAK} --stage mars --init_from "
                              "out/search/cpu_mix/ar.pt --mars_lr 3e-3",
    "cpu_mix_s2_400_mars_lr3e-3": f"--preset cpu --mix {MORE_WEAK} --stage mars --init_from "
                                  "out/search/cpu_mix/ar.pt --mars_iters 400 --mars_lr 3e-3",
}


def machine():
    """What a time means: the CPU's name, its cores, the kernels torch runs on it, and the
    precision train.py's rule picks there."""
    name = platform.processor()
    if os.path.exists("/proc/cpuinfo"):
        name = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                     if line.startswith("model name")), name)
    return {"cpu": name, "cores": os.cpu_count(), "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "precision_rule": train.precision_rule("cpu")}


def score(out_dir, limit):
    """A MARS checkpoint on the first `limit` validation prompts, greedy, at three thresholds."""
    ckpt = load_checkpoint(os.path.join(out_dir, "mars.pt"))
    val = data.splits_of(ckpt["train_config"])["val"][:limit]
    model, tok = model_from_checkpoint(ckpt)
    figures = {f"mars_tau{tau}": train.evaluate(model, tok, val, B=ckpt["mars"]["B"], tau=tau)
               for tau in (1.0, 0.95, 0.9)}
    for r in figures.values():
        r.pop("right")  # per prompt: the JSON keeps the figures
    return figures


def run(name, flags, root, limit=VAL):
    """Train one candidate alone and time the whole command; its validation figures."""
    out_dir = os.path.join(root, name)
    cmd = f"python train.py {flags} --summary_limit {limit} {QUIET} --precision float32"
    t0 = time.time()
    subprocess.run(f"{cmd} --out_dir {out_dir}", shell=True, check=True, capture_output=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
    rec = {"name": name, "command": cmd, "changed": flags.split(maxsplit=2)[2:], "commit": commit.strip(),
           "wall_s": round(time.time() - t0, 1), "machine": machine()}
    stages = ["ar", "mars"] if "--stage" not in flags else [flags.split("--stage ")[1].split()[0]]
    for s in stages:
        last = json.load(open(os.path.join(out_dir, f"{s}_log.json")))[-1]
        rec[f"{s}_val"] = {"accuracy": last["val_accuracy"], "per_task": last["val_per_task"],
                           "seconds": last["stage_seconds"], "val_loss": last.get("val_loss")}
    if "mars" in stages:
        rec.update(score(out_dir, limit))
    return rec


def minutes(r, rows):
    """A candidate's whole command in minutes: a stage-2 row's stage 1 is the row it starts from."""
    start = re.search(r"--init_from out/search/(\S+)/ar.pt", r["command"])
    before = next(s["ar_val"]["seconds"] for s in rows if s["name"] == start.group(1)) if start else 0
    return (r["wall_s"] + before) / 60


def plot(path):
    """Minutes against validation accuracy (AR SFT) and tokens per forward at tau 0.95."""
    from matplotlib.figure import Figure
    d = json.load(open(path))
    fig = Figure(figsize=(11, 4))
    a1, a2 = fig.subplots(1, 2)
    chosen = d.get("chosen", {})  # a search file names one, or one per preset
    chosen = set(chosen.values()) if isinstance(chosen, dict) else {chosen}
    for r in [r for r in d["candidates"] if not r.get("untimed")]:
        m, best = minutes(r, d["candidates"]), r["name"] in chosen
        kw = dict(marker="*" if best else "o", s=160 if best else 40,
                  color="C3" if best else "C0" if "mars_tau0.95" in r else "C2")
        if "ar_val" in r:  # a stage-2 row has none
            a1.scatter(m, r["ar_val"]["accuracy"], **kw)
            a1.annotate(r["name"], (m, r["ar_val"]["accuracy"]), fontsize=6, xytext=(3, 3),
                        textcoords="offset points")
        if "mars_tau0.95" in r:
            a2.scatter(m, r["mars_tau0.95"]["tokens_per_forward"], **kw)
            a2.annotate(r["name"], (m, r["mars_tau0.95"]["tokens_per_forward"]), fontsize=6,
                        xytext=(3, 3), textcoords="offset points")
    ref = d.get("old_default_run")
    if ref:
        a1.scatter(ref["minutes"], ref["ar_accuracy"], marker="s", color="k", label=ref["label"])
        a2.scatter(ref["minutes"], ref["tokens_per_forward_tau0.95"], marker="s", color="k",
                   label=ref["label"])
        a1.legend(fontsize=6, loc="lower right")
    a1.set(xlabel="minutes, whole command (stage-1 screens: stage 1 only, green)",
           ylabel="AR SFT accuracy, validation", title="stage 1")
    a2.set(xlabel="minutes, whole command", ylabel="tokens per forward at tau = 0.95",
           title="MARS")
    fig.suptitle(f"{d['machine']['cpu']}, {d['machine']['cores']} cores, "
                 f"{d['machine']['cpu_capability']} (star: chosen)", fontsize=9)
    out = os.path.splitext(path)[0] + ".png"
    fig.savefig(out, dpi=110, bbox_inches="tight")
    print(f"wrote {out}")


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", help="comma-separated candidate names (default: all not yet in --out)")
    p.add_argument("--out", help="run the candidates and write (append to) this JSON")
    p.add_argument("--runs", default="out/search", help="where candidates train (default out/search)")
    p.add_argument("--plot", help="draw a search JSON's trade-off beside it (.png)")
    args = p.parse_args()
    if not (args.out or args.plot):
        p.error("give --out (run a search) or --plot (draw one)")
    if args.out:
        d = json.load(open(args.out)) if os.path.exists(args.out) else {"candidates": []}
        d["machine"] = machine()
        for name, flags in CANDIDATES.items():
            done = any(r["name"] == name for r in d["candidates"])
            if done or (args.only and name not in args.only.split(",")):
                continue
            d["candidates"].append(run(name, flags, args.runs))
            print(f"{name}: {d['candidates'][-1]['wall_s']} s", file=sys.stderr, flush=True)
            with open(args.out, "w") as f:
                json.dump(d, f, indent=1)
    if args.plot:
        plot(args.plot)


if __name__ == "__main__":
    main()
