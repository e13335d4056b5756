"""One command for MARS on a real model: self-written prompts, their answers, MARS, the AR control, the evaluation.

    python -m extras.real.recipe --preset gpu --out_dir out/recipe          # one H100/H200-class GPU
    python -m extras.real.recipe --preset cpu --out_dir out/recipe_cpu      # two CPU cores, about an hour
    python -m extras.real.recipe --preset small --base out/ar.pt ...        # seconds: the pipeline itself (tests)
    python -m extras.real.recipe --preset gpu --minutes 10 ...              # a first check: sized to 10 minutes

Phases, each a command of its own (printed before it runs, so any can be rerun alone):
  1. python -m extras.real.self_prompts: requests the base model writes itself (skipped with --self_prompts FILE);
  2. python -m extras.real.distill: its greedy answers to them and to the template prompts; held-out checkable
     instructions and a held-out slice of the self-written requests, never trained on;
  3. python -m extras.real.train --stage mars from the base on those answers, with the recipe's levers
     (LEVERS, chosen on validation prompts: docs/levers_smollm2_cpu.json);
  4. python -m extras.real.train --stage control: the AR loss alone on the same data and schedule, the
     like-for-like control;
  5. python -m extras.real.eval, twice: on the held-out checkable instructions (quality, fidelity, speed against
     the base and the control) and on the held-out self-written requests (tokens per forward and fidelity on the
     model's own distribution).
A phase whose output exists is skipped, and the phases that can resume do: after an interruption, rerun the same
command. Progress: each phase's own lines, and the recipe's ETA between phases.

Before the first phase it prints each phase's estimated minutes (estimate): the rates measured on one H200 on
2026-12-04 (RATES, eager decoding before the CUDA graphs) applied to the rows' lengths (LENGTHS: the answers'
mean length at the budget, self-written requests answered at length). An estimate, never checked against a whole
run; on another device the H200's rates do not apply and it says so. --minutes sizes the preset's prompts, answer
budget and steps down together until the estimate fits.
"""
import glob
import math
import os
import shlex
import subprocess
import sys
import time

from common import UserError, check_device
from common import Parser, add_device, run_cli
from extras.real.train import starts_from_real

# Rows of 512 tokens at most. SmolLM2 answers its own requests at length: at a budget of 128 tokens, 296 of 400
# answers were cut off on the CPU (docs/distill_self_smollm2_cpu.json), so the gpu preset gives 256. Its sizes take
# 12.5 minutes by estimate(), under 15 (docs/real_models.md); the whole was never run.
PRESETS = {
    "gpu": dict(n_self=4000, n_train=4000, n_val=48, n_heldout=320, n_heldout_self=128, n_val_self=48, n_train_self=0,
                max_new_tokens=256, steps=400, batch_size=64, micro_batch=64, sample_batch=512, answer_batch=512,
                eval_n=0),
    "cpu": dict(n_self=2000, n_train=240, n_val=24, n_heldout=320, n_heldout_self=64, n_val_self=24, n_train_self=400,
                max_new_tokens=128, steps=60, batch_size=8, micro_batch=8, sample_batch=64, answer_batch=48,
                eval_n=96),
    "small": dict(n_self=8, n_train=12, n_val=4, n_heldout=4, n_heldout_self=2, n_val_self=2, n_train_self=0,
                  max_new_tokens=8,
                  steps=4, batch_size=4, micro_batch=4, sample_batch=4, answer_batch=4, eval_n=0),
}
# the recipe's levers over the hf preset (extras/real/train.py), chosen on validation prompts
# (docs/levers_smollm2_cpu.json): lr 2e-4 taught the masks most, and soft targets kept the
# agreement with the base that this lr costs with hard ones
LEVERS = ["--mars_lr", "2e-4", "--mask_row", "mean", "--targets", "soft", "--warmup", "0.1"]
TOY_LEVERS = [a for a in LEVERS if a not in ("--mask_row", "mean")]  # a toy base (--preset small) learns its row
WEIGHTS = {"self_prompts": 1.0, "distill": 2.0, "mars": 4.0, "control": 3.0, "eval": 2.0}  # for the ETA only
# One H200, 2026-12-04 (docs/h200_2026-12-04), SmolLM2-135M, eager decoding (before the CUDA graphs), bf16 training:
RATES = dict(
    forward_s=0.021,  # a decoding forward at batch 1: AR at 47.0 tokens/s (real_smollm2_h200_lr5e-5.json, wall)
    forward_row_s=0.000123,  # and per row more: at batch 512, 8,000 answers, 293k tokens in 47.8 s (84 ms a forward;
    # distill_smollm2_h200.json: 7,513 of 30.8 tokens, 487 cut off at 128)
    train_tokens_s=26900,  # MARS, clean-stream row tokens: 800 steps of 64 rows of 74.7 in 142 s (mars_log_h200_...)
    load_s=4.3)  # a model loaded: three in 13.0 s (real_smollm2_h200_lr5e-5.json, seconds.load)
LENGTHS = dict(
    prompt=43.9,  # a row's prompt tokens, chat template included: 74.7 - 30.8 (distill_smollm2_h200.json)
    template_answer=30.8,  # a template prompt's answer at 128 (the same file; its budget rarely binds: 6% cut off)
    self_answer=47.8, self_cut=0.74,  # self-written requests: 296 of 400 cut off at 128; the rest's mean (kept rows)
    self_request=64, self_read=1.36)  # a request's sampling budget; requests sampled per one kept (2,712 for 2,000)
# (docs/distill_self_smollm2_cpu.json, docs/self_prompts_smollm2_cpu.json); a cut-off answer is counted at the
# budget (an upper bound). Assumptions: a teacher's forward adds a third to a step (--targets soft); the control's
# step (one stream) costs half a MARS step; a step's cost grows with its tokens (attention's square left out).
TEACHER, CONTROL, LOADS, EVAL_RUNS, EVAL_BATCH = 4 / 3, 0.5, 12, 6, 32  # 12 model loads; eval: base, control,
# tau 1.0, 0.95, 0.9 and lossless, 32 rows at a time (extras.real.eval's --batch)


def estimate(c):
    """{phase: seconds} of preset sizes c, by the rows' lengths at RATES (an estimate: see the module's doc)."""
    forward = lambda rows: RATES["forward_s"] + RATES["forward_row_s"] * rows  # noqa: E731 -- a decoding forward
    own = (1 - LENGTHS["self_cut"]) * LENGTHS["self_answer"] + LENGTHS["self_cut"] * c["max_new_tokens"]
    template = min(LENGTHS["template_answer"], c["max_new_tokens"])
    n_own = c["n_train_self"] + c["n_val_self"] if c["n_train_self"] else c["n_self"] - c["n_heldout_self"]
    answers = (c["n_train"] + c["n_val"]) * template + n_own * own
    row = LENGTHS["prompt"] + answers / (c["n_train"] + c["n_val"] + n_own)
    read = math.ceil(c["n_self"] * LENGTHS["self_read"] / c["sample_batch"])
    mars = c["steps"] * c["batch_size"] * row / RATES["train_tokens_s"] * TEACHER
    n_eval = c["eval_n"] or c["n_heldout"]
    evaluated = EVAL_RUNS * (n_eval * template + c["n_heldout_self"] * own)
    wall = 3 * (8 * template * forward(1) + 24 * template / 8 * forward(8))  # AR, tau 0.9, lossless at 1 and 8
    return {"self_prompts": read * LENGTHS["self_request"] * forward(c["sample_batch"]),
            "distill": answers / c["answer_batch"] * forward(c["answer_batch"]),
            "mars": mars, "control": mars * CONTROL,
            "eval": evaluated / EVAL_BATCH * forward(EVAL_BATCH) + wall, "loads": LOADS * RATES["load_s"]}


def scaled(c, s):
    """The sizes c with its prompts, steps and answer budget scaled by s (the held-out sets kept: the evaluation's
    precision), at least a few of each and an answer budget of 128 tokens."""
    out = dict(c, steps=max(4, round(c["steps"] * s)), max_new_tokens=max(min(128, c["max_new_tokens"]),
                                                                          round(c["max_new_tokens"] * s)))
    for k in ("n_self", "n_train", "n_train_self"):
        out[k] = max(min(c[k], 8), round(c[k] * s)) if c[k] else 0
    out["n_self"] = max(out["n_self"], c["n_heldout_self"] + c["n_val_self"] + 8)  # some requests left to train on
    return out


def fit(c, minutes):
    """The largest scaling of c (at most 1) whose estimate fits `minutes`; UserError if even the smallest does not."""
    fits = lambda s: sum(estimate(scaled(c, s)).values()) <= 60 * minutes  # noqa: E731
    if fits(1.0):
        return c
    lo, hi = 0.0, 1.0
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    if not fits(lo):
        raise UserError(f"--minutes {minutes:g}: even the smallest sizes are estimated at "
                        f"{sum(estimate(scaled(c, 0)).values()) / 60:.1f} min")
    return scaled(c, lo)


def say_estimate(c, device, say=print):
    """The estimate, phase by phase, labelled as one."""
    e = estimate(c)
    where = "" if device.startswith("cuda") else f" (the H200's rates: on {device} the phases take longer)"
    say(f"estimated{where}, from the rates of one H200 by the rows' lengths, never checked against a whole run: "
        + ", ".join(f"{k} {v / 60:.1f}" for k, v in e.items()) + f" min; {sum(e.values()) / 60:.1f} min in all")
    say("sizes: " + ", ".join(f"{k} {v}" for k, v in c.items()), flush=True)


def phases(args, c):
    """[(name, command, the file it makes)] of the recipe, c: the preset's sizes."""
    at = lambda *parts: os.path.join(args.out_dir, *parts)  # noqa: E731
    py, dev, every = [sys.executable], ["--device", args.device], max(1, c["steps"] // 4)
    requests, data, mars, control = args.self_prompts or at("self_prompts.jsonl"), at("distilled.jsonl"), \
        at("mars", "mars.pt"), at("control", "control.pt")
    sizes = lambda *keys: [a for k in keys for a in (f"--{k}", str(c[k]))]  # noqa: E731
    train = [*py, "-m", "extras.real.train", "--init_from", args.base, "--data", data,
             "--max_seq_len", "512", "--batch_size", str(c["batch_size"]),
             "--micro_batch", str(c["micro_batch"]), "--mars_iters", str(c["steps"]),
             "--eval_every", str(every), "--save_every", str(every), "--summary_limit", "0",
             *(LEVERS if starts_from_real(args.base) else TOY_LEVERS), *dev]
    evaluate = [*py, "-m", "extras.real.eval", "--base", args.base, "--ckpt", mars, "--control", control,
                "--max_new_tokens", str(c["max_new_tokens"]), "--thresholds", "1.0", "0.95", "0.9", *dev]
    kept = sorted(glob.glob(at("mars", "mars_step*.pt")))  # kept by extras.real.snapshots; eval sorts by step
    steps = [("self_prompts", [*py, "-m", "extras.real.self_prompts", "--ckpt", args.base, "--n", str(c["n_self"]),
                               "--batch", str(c["sample_batch"]), "--max_tokens", "64", "--out", requests,
                               "--stats", at("self_prompts_stats.json"), *dev], requests),
             ("distill", [*py, "-m", "extras.real.distill", "--ckpt", args.base, "--out", data, "--val",
                          at("val.jsonl"), "--heldout", at("heldout.jsonl"), "--self_prompts", requests,
                          "--heldout_self", at("heldout_self.jsonl"), "--stats", at("distill_stats.json"),
                          *sizes("n_train", "n_val", "n_heldout", "n_heldout_self", "n_val_self", "n_train_self",
                                 "max_new_tokens"), "--batch", str(c["answer_batch"]), *dev], data),
             ("mars", [*py, "-m", "extras.real.snapshots", mars, "--", *train, "--stage", "mars", "--out_dir",
                       at("mars"), "--resume"], mars),
             ("control", [*train, "--stage", "control", "--out_dir", at("control"), "--resume"], control),
             ("eval", [*evaluate, "--heldout", at("heldout.jsonl"), "--n", str(c["eval_n"]),
                       *(["--trend", *kept] if kept else []), "--out", at("real.json")], at("real.json")),
             ("eval", [*evaluate, "--heldout", at("heldout_self.jsonl"), "--wall_n1", "0", "--wall_n8", "0",
                       "--out", at("real_self.json")], at("real_self.json"))]  # all of them
    return steps[1:] if args.self_prompts else steps


def done(name, path):
    """Whether a phase's output is complete: a training stage's checkpoint says so, the other files are written
    at their phase's end, atomically."""
    if not os.path.exists(path):
        return False
    if name in ("mars", "control"):
        import torch
        return bool(torch.load(path, map_location="cpu", weights_only=True, mmap=True).get("done"))
    return True


def run(args, say=print):
    """Runs each phase not yet done, in turn, with the recipe's ETA between phases; UserError if one fails. The
    phases are built again before each one: the evaluation's trend takes the checkpoints training kept."""
    sizes = fit(PRESETS[args.preset], args.minutes) if args.minutes else PRESETS[args.preset]
    say_estimate(sizes, args.device, say)
    steps = phases(args, sizes)
    total, t0, spent = sum(WEIGHTS[n] for n, _, _ in steps), time.time(), 0.0
    for k in range(len(steps)):
        name, cmd, path = phases(args, sizes)[k]
        if done(name, path):
            say(f"[{k + 1}/{len(steps)}] {name}: done ({path})")
            total -= WEIGHTS[name]
            continue
        say(f"[{k + 1}/{len(steps)}] {name}: {shlex.join(['python', *cmd[1:]])}", flush=True)
        if subprocess.run(cmd).returncode:
            raise UserError(f"phase {name} failed (its command is above); rerun this command to resume")
        spent += WEIGHTS[name]
        left = (time.time() - t0) / spent * (total - spent)
        say(f"[{k + 1}/{len(steps)}] {name}: done in {(time.time() - t0) / 60:.1f} min so far | "
            f"ETA {left / 60:.1f} min", flush=True)


def get_args(argv=None):
    p = Parser(__doc__)
    p.add_argument("--preset", choices=PRESETS, default="gpu", help="the sizes: gpu (12.5 min on one H100/H200 "
                   "by estimate, never run), cpu (two cores, about an hour) or small (seconds, for tests) (default "
                   "gpu)")
    p.add_argument("--minutes", type=float, help="a budget: the preset's prompts, answer budget and steps scaled "
                   "down until the estimate fits it (e.g. 10 for a first check on a GPU)")
    p.add_argument("--base", default="smollm2", help="the chat model MARS starts from (default smollm2)")
    p.add_argument("--out_dir", default="out/recipe", help="where every phase writes (default out/recipe)")
    p.add_argument("--self_prompts", help="a JSONL of self-written requests made earlier (python -m "
                   "extras.real.self_prompts): skips phase 1")
    add_device(p)
    args = p.parse_args(argv)
    if args.minutes is not None and args.minutes <= 0:
        p.error("--minutes must be positive")
    return args


def main(argv=None):
    args = get_args(argv)
    check_device(args.device)  # before any phase: each would refuse it after minutes of the others
    os.makedirs(args.out_dir, exist_ok=True)
    try:
        run(args)
    except KeyboardInterrupt:
        raise KeyboardInterrupt(f"what the finished phases made is in {args.out_dir}; rerun the same command to "
                                "resume") from None
    print(f"done: {os.path.join(args.out_dir, 'real.json')} and real_self.json")


if __name__ == "__main__":
    run_cli(main)
