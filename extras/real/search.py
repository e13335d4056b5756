"""The lever search: short MARS runs on a real model at equal rows seen, one lever at a time, each measured on the
validation prompts (never the held-out ones), to find a recipe whose masks learn while the model stays itself.

    python -m extras.real.search --data out/smollm/distilled.jsonl --val out/smollm/val.jsonl \\
        --out docs/levers_smollm2_cpu.json

Each row of LEVERS runs `python -m extras.real.train --stage mars --init_from <base>` for --steps
steps on --data with the flags it lists, in a process of its own, then measures its MARS
checkpoint against the base model's greedy answers to the validation prompts: the teacher-forced
AR agreement (the share of the base answers' tokens its AR argmax predicts), the answers
identical to the base's at tau = 1.0, and at tau = 0.9 the tokens per forward and the answers
identical to its own AR answer, and lossless the tokens per forward; also the run's validation
losses (on the data's tokens, whatever the targets). A row already in --out is kept (rerun the
same command to resume); a checkpoint is deleted once measured (1.6 GB each for SmolLM2).
"""
import json
import os
import shlex
import subprocess
import sys
import time

import torch

from common import UserError, build_model
from common import Parser, add_device, run_cli
from extras.bench.eval import machine, read_prompts
from extras.checkpoints import foreign
from extras.real.eval import AR, LOSSLESS, ar_agreement, decode, identical, name

# name -> extras.real.train flags over the shared ones (the reference's, then the lever's: a later flag wins). The reference is
# the paper's hard-label recipe at the lr where the masks learned on a GPU (docs/real_models.md); each other row moves
# one lever; the last moves two together: soft targets at the lr that taught the masks most.
REFERENCE = ["--mars_lr", "1e-4", "--mask_row", "mean"]
LEVERS = {
    "reference: hard targets, lr 1e-4": [],
    "soft targets": ["--targets", "soft"],
    "clean padding dropped": ["--clean_padding", "drop"],
    "lr 2e-4": ["--mars_lr", "2e-4"],
    "ar_weight 4": ["--ar_weight", "4"],
    "soft targets, lr 2e-4": ["--targets", "soft", "--mars_lr", "2e-4"],
    "lr 5e-5": ["--mars_lr", "5e-5"],
    "block offset random": ["--block_offset", "random"],
}
TAU = 0.9


def train_command(lever, args, out_dir):
    flags = ["--stage", "mars", "--init_from", args.base, "--data", args.data, "--out_dir", out_dir,
             "--batch_size", str(args.batch_size), "--micro_batch", str(args.batch_size), "--max_seq_len", "256",
             "--mars_iters", str(args.steps), "--warmup", str(args.warmup), "--eval_every", str(args.steps),
             "--save_every", str(args.steps), "--summary_limit", "0", "--device", args.device]
    extra = REFERENCE + LEVERS[lever]
    return [sys.executable, "-m", "extras.real.train", *flags, *extra]


def measure(path, tok, prompts, base_runs, args):
    """The validation figures of one MARS checkpoint."""
    ckpt = foreign.read_checkpoint(path, args.device)
    model = build_model(ckpt, args.device).eval()
    B = ckpt["mars"]["B"]
    runs = decode(model, tok, prompts, [AR, {"tau": TAU}, LOSSLESS], args, B)
    own, fast = runs[name(AR)], runs[name({"tau": TAU})]
    last = ckpt["history"][-1]
    return {"val_noisy_loss": round(last["val_noisy"], 4) if "val_noisy" in last else None,
            "val_clean_loss": round(last.get("val_clean", last["val_loss"]), 4),
            "ar_agreement": ar_agreement(model, tok, prompts, base_runs),
            "identical_at_tau_1": identical(own, base_runs),
            f"tokens_per_forward_at_tau_{TAU}": tokens_per_forward(fast),
            f"identical_to_own_ar_at_tau_{TAU}": identical(fast, own),
            "tokens_per_forward_lossless": tokens_per_forward(runs[name(LOSSLESS)]),
            "train_seconds": last["elapsed_s"]}


def tokens_per_forward(runs):
    return round(sum(len(r.tokens) for r in runs) / max(sum(r.forwards for r in runs), 1), 4)


def regenerating_command(argv):
    """This invocation without --only: the command that regenerates every row of --out (it resumes, so a row
    already there is kept; without the file it runs them all)."""
    kept, skipping = [], False
    for a in argv:
        skipping = a == "--only" or (skipping and not a.startswith("--"))
        kept += [] if skipping else [a]
    return shlex.join(["python", "-m", "extras.real.search", *kept])


def get_args(argv=None):
    p = Parser(__doc__)
    p.add_argument("--base", default="smollm2", help="the model MARS starts from (default smollm2)")
    p.add_argument("--data", required=True, help="the distilled training answers (python -m extras.real.distill)")
    p.add_argument("--val", required=True, help="the validation prompts (python -m extras.real.distill --val)")
    p.add_argument("--out", required=True, help="the JSON to write, row by row")
    p.add_argument("--out_dir", default="out/smollm/search", help="where the runs train (default out/smollm/search)")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps per run (default 60)")
    p.add_argument("--batch_size", type=int, default=8, help="rows per step (default 8)")
    p.add_argument("--warmup", type=float, default=0.1, help="warmup share of the steps (default 0.1)")
    p.add_argument("--only", nargs="*", choices=LEVERS, help="run these levers only (default: all)")
    p.add_argument("--batch", type=int, default=32, help="rows decoded together (default 32)")
    p.add_argument("--max_new_tokens", type=int, default=64, help="the answers' budget while measuring (default 64)")
    add_device(p)
    args = p.parse_args(argv)
    if min(args.steps, args.batch_size, args.batch, args.max_new_tokens) < 1 or not 0 <= args.warmup < 1:
        p.error("--steps, --batch_size, --batch and --max_new_tokens must be at least 1, --warmup in [0, 1)")
    return args


@torch.inference_mode()
def main(argv=None):
    args = get_args(argv)
    command = regenerating_command(sys.argv[1:] if argv is None else argv)
    result = json.load(open(args.out)) if os.path.exists(args.out) else {"rows": []}
    done = {r["lever"] for r in result["rows"]}
    examples = read_prompts(args.val, 0)
    _, base, tok = foreign.load(args.base, args.device)
    prompts = [tok.prompt_ids(e["prompt"]) for e in examples]
    print(f"the base model's answers to {len(prompts)} validation prompts", flush=True)
    base_runs = decode(base.eval(), tok, prompts, [AR], args)[name(AR)]
    for lever in args.only or LEVERS:
        if lever in done:
            continue
        out_dir = os.path.join(args.out_dir, "".join(c if c.isalnum() else "_" for c in lever))
        cmd = train_command(lever, args, out_dir)
        print(f"\n== {lever}: {shlex.join(cmd[1:])}", flush=True)
        t0 = time.time()
        if subprocess.run(cmd).returncode:
            raise UserError(f"the run of {lever!r} failed (its command is above)")
        path = os.path.join(out_dir, "mars.pt")
        row = {"lever": lever, "train_command": shlex.join(["python", *cmd[1:]]),
               **measure(path, tok, prompts, base_runs, args), "seconds": round(time.time() - t0, 1)}
        os.remove(path)
        result = {"command": command, "machine": machine(), "base": args.base, "steps": args.steps,
                  "batch_size": args.batch_size, "warmup": args.warmup, "val_prompts": len(prompts),
                  "rows": result["rows"] + [row]}
        with open(args.out + ".tmp", "w") as f:
            json.dump(result, f, indent=1)
        os.replace(args.out + ".tmp", args.out)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    run_cli(main)
