"""The search behind `--preset course`: candidates for a class's run of a few minutes, each trained alone and
timed, then chosen on the validation prompts only (the test split is what the run's own summary reports).

    python -m extras.bench.course_search --out docs/course_search_cpu.json          # runs every candidate
    python -m extras.bench.course_search --plot docs/course_search_cpu.json         # the trade-off figure

Each candidate is `python train.py FLAGS` (wall time of the whole command: data, tokenizer, both stages, their
validation and the held-out summary), then its mars.pt decoded on the validation prompts at tau 1.0 and 0.9
(untimed). The JSON records the machine beside every time.
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import time

SIX = "spell,reverse,copy,words,convert,facts"
COMMON = "--summary_limit 300 --eval_every 100000 --save_every 100000"
CANDIDATES = {  # name: train.py flags (the cpu preset underneath)
    "L4W256_f6_800_500": f"--tasks {SIX} --ar_iters 800 --mars_iters 500 --lr 3e-3 --mars_lr 3e-3",
    "L4W128_f6_1500_800": f"--tasks {SIX} --n_embd 128 --ar_iters 1500 --mars_iters 800 --lr 3e-3 --mars_lr 3e-3",
    "L2W256_f6_1200_700": f"--tasks {SIX} --n_layer 2 --ar_iters 1200 --mars_iters 700 --lr 3e-3 --mars_lr 3e-3",
    "L4W128_all_1500_800": "--n_embd 128 --ar_iters 1500 --mars_iters 800 --lr 3e-3 --mars_lr 3e-3",
    "L4W128_f6_2000_1000": f"--tasks {SIX} --n_embd 128 --ar_iters 2000 --mars_iters 1000 --lr 3e-3 --mars_lr 3e-3",
    "L4W128_f6_1500_800_lr5e-3": f"--tasks {SIX} --n_embd 128 --ar_iters 1500 --mars_iters 800 --lr 5e-3 "
                                 "--mars_lr 5e-3",
    "L3W128_f6_2000_1000": f"--tasks {SIX} --n_embd 128 --n_layer 3 --ar_iters 2000 --mars_iters 1000 --lr 3e-3 "
                           "--mars_lr 3e-3",
    "L4W128_f6_1500_800_b64": f"--tasks {SIX} --n_embd 128 --ar_iters 1500 --mars_iters 800 --batch_size 64 "
                              "--lr 3e-3 --mars_lr 3e-3",
    "L4W128_f6_1800_900": f"--tasks {SIX} --n_embd 128 --ar_iters 1800 --mars_iters 900 --lr 3e-3 --mars_lr 3e-3",
}


def machine():
    """What a time means: the CPU's name and the kernels torch runs on it."""
    import torch
    name = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")),
                platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    return {"cpu": name, "cores": os.cpu_count(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch": torch.__version__}


def score(out_dir, limit=300):
    """The candidate's MARS checkpoint on the validation prompts, greedy, at tau 1.0 and 0.9."""
    import data
    import train
    from checkpoint import load_checkpoint, model_from_checkpoint
    ckpt = load_checkpoint(os.path.join(out_dir, "mars.pt"), "cpu")
    cfg = ckpt["train_config"]
    val = data.splits_of(cfg)["val"][:limit]
    model, tok = model_from_checkpoint(ckpt, "cpu")
    return {f"mars_tau{tau}": train.evaluate(model, tok, val, B=ckpt["mars"]["B"], tau=tau) for tau in (1.0, 0.9)}


def run(name, flags, root):
    out_dir = os.path.join(root, name)
    cmd = f"python train.py --preset cpu {flags} {COMMON}"
    t0 = time.time()
    subprocess.run(f"{cmd} --out_dir {out_dir}", shell=True, check=True, capture_output=True)
    rec = {"name": name, "command": cmd, "wall_s": round(time.time() - t0, 1)}
    logs = {s: json.load(open(os.path.join(out_dir, f"{s}_log.json"))) for s in ("ar", "mars")}
    rec["stage_seconds"] = {s: h[-1]["stage_seconds"] for s, h in logs.items()}
    rec["ar_val"] = {"accuracy": logs["ar"][-1]["val_accuracy"], "per_task": logs["ar"][-1]["val_per_task"]}
    rec["precision"] = logs["ar"][-1]["precision"]
    rec["test_summary"] = json.load(open(os.path.join(out_dir, "summary.json")))
    return {**rec, **score(out_dir)}


def plot(path):
    """Minutes against AR SFT's validation accuracy and MARS's tokens per forward at tau 0.9."""
    from matplotlib.figure import Figure
    d = json.load(open(path))
    rows = d["candidates"]
    fig = Figure(figsize=(11, 4))
    a1, a2 = fig.subplots(1, 2)
    for r in rows:
        m = r["wall_s"] / 60
        chosen = r["name"] == d.get("chosen")
        kw = dict(marker="*" if chosen else "o", s=160 if chosen else 40, color="C3" if chosen else "C0")
        if "NOT an idle" in r.get("timing_note", ""):  # its seconds were shared with other jobs: hollow
            kw.update(facecolors="none", edgecolors="C0")
        a1.scatter(m, r["ar_val"]["accuracy"], **kw)
        a2.scatter(m, r["mars_tau0.9"]["tokens_per_forward"], **kw)
        for a, y in ((a1, r["ar_val"]["accuracy"]), (a2, r["mars_tau0.9"]["tokens_per_forward"])):
            a.annotate(r["name"], (m, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
    ref = d.get("default_run") or {}  # added by hand: the default run's own figures (its source named)
    if ref:
        a1.scatter(ref["minutes"], ref["ar_accuracy"], marker="s", color="k", label=ref["label"])
        a2.scatter(ref["minutes"], ref["mars_tau0.9_tokens_per_forward"], marker="s", color="k", label=ref["label"])
    a1.set(xlabel="minutes (python train.py, whole run)", ylabel="AR SFT accuracy (validation; default: test)",
           title="quality of stage 1")
    a2.set(xlabel="minutes (python train.py, whole run)", ylabel="tokens per forward at tau = 0.9",
           title="MARS speed-up")
    for a in (a1, a2):
        a.set_xscale("log")
        a.set_xticks([1.5, 2, 3, 4, 6, 10, 16], ["1.5", "2", "3", "4", "6", "10", "16"])
        a.minorticks_off()
        a.legend(fontsize=7, loc="center right", title="hollow: timed beside other jobs", title_fontsize=7)
    fig.suptitle(f"course-run search: {d['machine']['cpu']}, {d['machine']['cores']} cores, "
                 f"{d['machine']['cpu_capability']} (star: the course preset)", fontsize=9)
    out = os.path.splitext(path)[0] + ".png"
    fig.savefig(out, dpi=110, bbox_inches="tight")
    print(f"wrote {out}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="run every candidate and write the search here (JSON)")
    p.add_argument("--runs", default="out/course_search", help="where the candidates train (default "
                                                                "out/course_search)")
    p.add_argument("--plot", help="draw the trade-off of a search JSON, beside it (.png)")
    args = p.parse_args()
    if not (args.out or args.plot):
        p.error("give --out (run the search) or --plot (draw one)")
    if args.out:
        rows = []
        for name, flags in CANDIDATES.items():
            rows.append(run(name, flags, args.runs))
            print(f"{name}: {rows[-1]['wall_s']} s", file=sys.stderr)
        with open(args.out, "w") as f:
            json.dump({"machine": machine(), "candidates": rows}, f, indent=1)
    if args.plot:
        plot(args.plot)


if __name__ == "__main__":
    main()
