"""Is bf16 autocast faster than float32 for training here? train.py does not time it: it
follows a rule (train.precision_rule: bf16 where the hardware has native bf16). This command
measures, for anyone who doubts the rule on their machine: a forward and backward of a
preset's model on a step's tokens, in float32 and under train.autocast's bf16, and what the
rule picks.

    python -m extras.bench.precision                          # the cpu preset's model
    python -m extras.bench.precision --preset course --threads 2
    ATEN_CPU_CAPABILITY=avx2 python -m extras.bench.precision  # as an AVX2-only CPU would

On a CPU with native bf16 (an AVX512-BF16 EPYC) bf16 made a training step 2.2-2.7x faster;
without it (AVX2 only) 10-30x slower. A GPU's short runs time kernel launches as much as the
precisions (docs/gpu.md): read its figures with that in mind.
"""
import json
import math
import time

import torch

import train
from common import Parser, add_device, check_device, run_cli
from model import GPT, GPTConfig

PROBE_SECONDS = 2.0  # what the timed runs may take in all
BF16_MARGIN = 0.9  # bf16 counts as faster at 90% of float32's time or less: noise never tips it


def step_timer(model, seq_len, device, autocast):
    """time_run(rows, bf16): seconds of one forward and backward of the model, as a training
    step runs it, on `rows` tokens in sequences of up to seq_len, in float32 or under bf16
    autocast (autocast: train.autocast). The whole step, not one matmul: norms, softmax and
    attention gain less than matmuls. No weight changes; the gradients are dropped."""
    device = torch.device(device)  # zeros as tokens: the values do not change the speed
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None

    def time_run(rows, bf16):
        x = torch.zeros(max(1, rows // seq_len), min(rows, seq_len), dtype=torch.long,
                        device=device)
        sync()
        t = time.perf_counter()
        with autocast(device, "bfloat16" if bf16 else "float32", seq_len):
            loss = model(x).float().logsumexp(-1).mean()
        loss.backward()
        sync()
        seconds = time.perf_counter() - t
        model.zero_grad(set_to_none=True)
        return seconds
    return time_run


def probe(time_run, tokens, budget=PROBE_SECONDS):
    """(float32 seconds, bf16 seconds, rows): each precision's time for `tokens` tokens,
    predicted as a fixed part plus a cost per token from the best of up to 5 alternating rounds
    of runs on 1 and on `rows` tokens, until the runs have taken `budget` seconds. The fixed
    part (every weight's gradient) dominates a big model's short runs and would hide the
    difference a step of many tokens shows. Runs on 1 and 16 tokens warm up and size the rest:
    `rows` makes the slower precision's run a tenth of the budget."""
    warm = [[min(time_run(n, bf16) for _ in range(2)) for n in (1, 16)] for bf16 in (False, True)]
    per_token = max(max(t16 - t1, 1e-9) / 15 for t1, t16 in warm)
    rows = max(16, min(tokens, int(budget / 10 / per_token)))
    best, spent = {}, 0.0
    for _ in range(5):
        for bf16 in (False, True):
            for n in (1, rows):
                t = time_run(n, bf16)
                best[n, bf16], spent = min(best.get((n, bf16), math.inf), t), spent + t
        if spent > budget:
            break

    def predicted(bf16):
        one, many = best[1, bf16], best[rows, bf16]
        return one + max(many - one, 0.0) * (tokens - 1) / (rows - 1)
    return predicted(False), predicted(True), rows


def decide(float32_s, bfloat16_s):
    """The faster precision: bf16 where it takes at most BF16_MARGIN of float32's time."""
    return "bfloat16" if bfloat16_s <= BF16_MARGIN * float32_s else "float32"


def measure(preset="cpu", device="cpu", budget=PROBE_SECONDS):
    """The timings on a preset's model (random weights: they do not change the speed), which
    precision they find faster, and what train.py's rule picks."""
    p = train.PRESETS[preset]
    torch.manual_seed(0)
    shape = {k: p[k] for k in train.MODEL_KEYS}
    model = GPT(GPTConfig(vocab_size=p["vocab_size"], **shape)).to(device)
    tokens = (p["micro_batch"] or p["batch_size"]) * p["max_seq_len"]
    timer = step_timer(model, p["max_seq_len"], device, train.autocast)
    fp32, bf16, rows = probe(timer, tokens, budget)
    rule, why = train.precision_rule(str(device))
    where = (torch.cuda.get_device_name(device) if str(device).startswith("cuda")
             else f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    return {"preset": preset, "device": where, "threads": torch.get_num_threads(),
            "tokens": tokens, "rows": rows, "float32_ms": round(1e3 * fp32, 3),
            "bfloat16_ms": round(1e3 * bf16, 3), "faster": decide(fp32, bf16),
            "rule": rule, "rule_why": why}


def main(argv=None):
    p = Parser(__doc__)
    p.add_argument("--preset", choices=list(train.PRESETS), default="cpu",
                   help="whose model and step to time (default cpu)")
    add_device(p)
    p.add_argument("--threads", type=int, help="torch threads (default torch's)")
    p.add_argument("--budget", type=float, default=PROBE_SECONDS,
                   help=f"seconds the timed runs may take (default {PROBE_SECONDS})")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = p.parse_args(argv)
    check_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    r = measure(args.preset, args.device, args.budget)
    if args.json:
        return print(json.dumps(r))
    ratio = r["bfloat16_ms"] / r["float32_ms"]
    verdict = "agree" if r["faster"] == r["rule"] else (
        f"disagree: train.py --precision {r['faster']} trains in the faster one here")
    print(f"the {r['preset']} preset's model, a forward and backward on a step's {r['tokens']} "
          f"tokens ({r['device']}, {r['threads']} threads):\n"
          f"  float32   {r['float32_ms']:9.2f} ms\n"
          f"  bfloat16  {r['bfloat16_ms']:9.2f} ms ({ratio:.2f}x float32's time)\n"
          f"faster here: {r['faster']} (bf16 counts at {BF16_MARGIN}x or less)\n"
          f"train.py's rule picks {r['rule']} ({r['rule_why']}): they {verdict}")


if __name__ == "__main__":
    run_cli(main)
