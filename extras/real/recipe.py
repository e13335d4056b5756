"""One command for MARS on a real model: self-written prompts, their answers, MARS, the AR control, the evaluation.

    python -m extras.real.recipe --preset gpu --out_dir out/recipe          # one H100/H200-class GPU
    python -m extras.real.recipe --preset cpu --out_dir out/recipe_cpu      # two CPU cores, about an hour
    python -m extras.real.recipe --preset small --base out/ar.pt ...        # seconds: the pipeline itself (tests)

Phases, each a command of its own (printed before it runs, so any can be rerun alone):
  1. python -m extras.real.self_prompts: requests the base model writes itself (skipped with --self_prompts FILE);
  2. python -m extras.real.distill: its greedy answers to them and to the template prompts; held-out checkable
     instructions and a held-out slice of the self-written requests, never trained on;
  3. train.py --stage mars from the base on those answers, with the recipe's levers (PRESETS, chosen on validation
     prompts: docs/levers_smollm2_cpu.json);
  4. train.py --stage control: the AR loss alone on the same data and schedule, the like-for-like control;
  5. python -m extras.real.eval, twice: on the held-out checkable instructions (quality, fidelity, speed against
     the base and the control) and on the held-out self-written requests (tokens per forward and fidelity on the
     model's own distribution).
A phase whose output exists is skipped, and the phases that can resume do: after an interruption, rerun the same
command. Progress: each phase's own lines, and the recipe's ETA between phases.
"""
import glob
import os
import shlex
import subprocess
import sys
import time

from common import UserError, check_device, starts_from_hf
from common import Parser, add_device, run_cli

# Rows of 512 tokens at most. SmolLM2 answers its own requests at length: at a budget of 128 tokens, 296 of 400
# answers were cut off on the CPU (docs/distill_self_smollm2_cpu.json), so the gpu preset gives 384. Its sizes are
# estimated from the rates measured on an H200 (about 8,000 prompts answered a minute, 800 MARS steps of 64 rows in
# 142 s, on rows half as long) for about 15 minutes in all; the whole was never run (docs/real_models.md).
PRESETS = {
    "gpu": dict(n_self=8000, n_train=4000, n_val=48, n_heldout=320, n_heldout_self=128, n_val_self=48, n_train_self=0,
                max_new_tokens=384, steps=600, batch_size=64, micro_batch=64, sample_batch=256, answer_batch=256,
                eval_n=0),
    "cpu": dict(n_self=2000, n_train=240, n_val=24, n_heldout=320, n_heldout_self=64, n_val_self=24, n_train_self=400,
                max_new_tokens=128, steps=60, batch_size=8, micro_batch=8, sample_batch=64, answer_batch=48,
                eval_n=96),
    "small": dict(n_self=8, n_train=12, n_val=4, n_heldout=4, n_heldout_self=2, n_val_self=2, n_train_self=0,
                  max_new_tokens=8,
                  steps=4, batch_size=4, micro_batch=4, sample_batch=4, answer_batch=4, eval_n=0),
}
# the recipe's levers over train.py's hf preset, chosen on validation prompts (docs/levers_smollm2_cpu.json): lr 2e-4
# taught the masks most, and soft targets kept the agreement with the base that this lr costs with hard ones
LEVERS = ["--mars_lr", "2e-4", "--mask_row", "mean", "--targets", "soft", "--warmup", "0.1"]
TOY_LEVERS = [a for a in LEVERS if a not in ("--mask_row", "mean")]  # a toy base (--preset small) learns its row
WEIGHTS = {"self_prompts": 1.0, "distill": 2.0, "mars": 4.0, "control": 3.0, "eval": 2.0}  # for the ETA only


def phases(args, c):
    """[(name, command, the file it makes)] of the recipe, c: the preset's sizes."""
    at = lambda *parts: os.path.join(args.out_dir, *parts)  # noqa: E731
    py, dev, every = [sys.executable], ["--device", args.device], max(1, c["steps"] // 4)
    requests, data, mars, control = args.self_prompts or at("self_prompts.jsonl"), at("distilled.jsonl"), \
        at("mars", "mars.pt"), at("control", "control.pt")
    sizes = lambda *keys: [a for k in keys for a in (f"--{k}", str(c[k]))]  # noqa: E731
    train = [*py, "train.py", "--init_from", args.base, "--data", data, "--max_seq_len", "512", "--batch_size",
             str(c["batch_size"]), "--micro_batch", str(c["micro_batch"]), "--mars_iters", str(c["steps"]),
             "--eval_every", str(every), "--save_every", str(every), "--summary_limit", "0",
             *(LEVERS if starts_from_hf(args.base) else TOY_LEVERS), *dev]
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
    steps = phases(args, PRESETS[args.preset])
    total, t0, spent = sum(WEIGHTS[n] for n, _, _ in steps), time.time(), 0.0
    for k in range(len(steps)):
        name, cmd, path = phases(args, PRESETS[args.preset])[k]
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
    p.add_argument("--preset", choices=PRESETS, default="gpu", help="the sizes: gpu (about 15 min on one H100/H200, "
                   "unmeasured), cpu (two cores, about an hour) or small (seconds, for tests) (default gpu)")
    p.add_argument("--base", default="smollm2", help="the chat model MARS starts from (default smollm2)")
    p.add_argument("--out_dir", default="out/recipe", help="where every phase writes (default out/recipe)")
    p.add_argument("--self_prompts", help="a JSONL of self-written requests made earlier (python -m "
                   "extras.real.self_prompts): skips phase 1")
    add_device(p)
    return p.parse_args(argv)


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
