"""Decoding outputs, token for token, in every deterministic mode of sample.py and of the engine's command
(python -m extras.engine): a refactor must not change them.

    python -m extras.bench.golden --ckpt out/mars.pt --out before.json      # before a change
    python -m extras.bench.golden --ckpt out/mars.pt --against before.json  # after it: exit 1 on any difference

Each mode runs its command with --json on the checkpoint's held-out prompts (the paper's modes `python sample.py`,
the engine's `python -m extras.engine`) and keeps what a forward committed (ids and chunks), by mode name; timings
are dropped. --masks auto is left out: its window follows the machine's timings.
"""
import argparse
import json
import subprocess
import sys

PAPER = {  # sample.py
    "paper tau 0.9": ["--threshold", "0.9"],
    "paper tau 0.7": ["--threshold", "0.7"],
    "paper tau 1.0": ["--threshold", "1.0"],
    "ar": ["--ar"],
}
ENGINE = {  # python -m extras.engine
    "lossless": ["--lossless"],
    "batch 8 tau 0.9": ["--batch_size", "8", "--threshold", "0.9"],
    "no cache tau 0.9": ["--cache", "none", "--threshold", "0.9"],
    "block cache tau 0.9": ["--cache", "block", "--B_cache", "8", "--threshold", "0.9"],
    "margin 0.5": ["--metric", "margin", "--threshold", "0.5"],
    "entropy 0.8": ["--metric", "entropy", "--threshold", "0.8"],
    "max_accept 2": ["--max_accept", "2", "--threshold", "0.5"],
    "sampled T 0.8 seed 1": ["--temperature", "0.8", "--seed", "1", "--threshold", "0.9"],
}
MODES = {**PAPER, **ENGINE}


def outputs(ckpt, num_prompts):
    """{mode: [{"prompt", "ids", "chunks"}]} from each mode's command, with --json."""
    result = {}
    for mode, flags in MODES.items():
        command = ["sample.py"] if mode in PAPER else ["-m", "extras.engine"]
        cmd = [sys.executable, *command, "--ckpt", ckpt, "--json", "--num_prompts", str(num_prompts), *flags]
        lines = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.splitlines()
        result[mode] = [{k: r[k] for k in ("prompt", "ids", "chunks")} for r in map(json.loads, lines)]
        print(f"{mode}: {len(lines)} prompts", file=sys.stderr)
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", default="out/mars.pt", help="a trained MARS checkpoint (default out/mars.pt)")
    p.add_argument("--num_prompts", type=int, default=40, help="held-out prompts per mode (default 40)")
    p.add_argument("--out", help="write the outputs here (JSON)")
    p.add_argument("--against", help="compare with outputs written earlier; exit 1 on any difference")
    args = p.parse_args()
    now = outputs(args.ckpt, args.num_prompts)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"ckpt": args.ckpt, "modes": now}, f)
    if args.against:
        before = json.load(open(args.against))["modes"]
        changed = [m for m in MODES if before.get(m) != now[m]]
        print("identical in every mode" if not changed else f"changed: {', '.join(changed)}")
        sys.exit(1 if changed else 0)


if __name__ == "__main__":
    main()
