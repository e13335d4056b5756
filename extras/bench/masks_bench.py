"""A window sized by cost (--masks auto, cost.py) against fixed B - 1 masks and AR, measured side by side.

    python -m extras.bench.masks_bench                   # out/mars.pt -> docs/masks_cpu.json (progress and ETA on stderr)
    python -m extras.bench.masks_bench --ckpt smollm2 --out docs/masks_smollm2_cpu.json   # a real model, a few prompts

Three decoders of one checkpoint: AR with the KV cache (the checkpoint at B = 1), MARS with B - 1 masks at
every forward (the paper's) and MARS with --masks auto, at each batch size, cache (sliding; the paper's block
cache with --B_cache) and tau.
1. Speed, on --timing_prompts held-out prompts: a warm-up round, then --rounds rounds. In a round, at each batch
   size, AR decodes the prompts, then each (cache, tau) decodes them fixed and auto, the two in alternating
   order, so that a slow spell of a shared machine hits every decoder of a round alike. A rate is output
   tokens over the seconds of generate_batch's clock; a decoder's speedup is the median over rounds of its
   rate over AR's in the same round, with the [min, max].
2. Accuracy on --accuracy_prompts held-out prompts (default all): AR and fixed once, at batch 64 (their outputs
   do not depend on the batch), auto at every batch size (its masks do), with the masks it fed per forward.
auto's cost model is profiled once at start and written to the JSON, with the command that regenerates it.
"""
import json
import os
import shlex
import statistics
import sys
import time

from extras.engine import cost
import data
from common import UserError, load_checkpoint, model_from_checkpoint
from common import Parser, add_device, run_cli, threshold
from extras.engine.engine import CACHE_MODES, decode_step, generate_batch
from extras.bench.eval import machine, read_prompts, score

QUALITY_BATCH = 64  # AR's and fixed's accuracy passes: their outputs are the same at any batch size


def get_args(argv=None):
    p = Parser(__doc__)
    p.add_argument("--ckpt", default="out/mars.pt", help="checkpoint (default out/mars.pt); a real model too, e.g. "
                   "smollm2 (an AR model: its masks are untrained, give --B)")
    p.add_argument("--out", default="docs/masks_cpu.json", help="the JSON written (default docs/masks_cpu.json)")
    p.add_argument("--B", type=int, default=None,
                   help="the paper's block size B (default: the checkpoint's; 4 for an AR one)")
    p.add_argument("--batch_sizes", type=int, nargs="+", default=None,
                   help="default 1 4 16 32; 1 8 for a checkpoint not trained here")
    p.add_argument("--caches", nargs="+", choices=[c for c in CACHE_MODES if c != "none"], default=["sliding", "block"],
                   help="caches to compare (default sliding block)")
    p.add_argument("--B_cache", type=int, default=16, help="the block cache's B_cache (default 16)")
    p.add_argument("--taus", type=threshold, nargs="+", default=[0.95, 0.9], help="thresholds (default 0.95 0.9)")
    p.add_argument("--timing_prompts", type=int, default=None,
                   help="held-out prompts per timed pass (default 256; 8 for a checkpoint not trained here)")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds after the warm-up (default 5; 2 for a "
                   "checkpoint not trained here)")
    p.add_argument("--accuracy_prompts", type=int, default=None, help="held-out prompts of the accuracy passes "
                   "(default all of them; the timing prompts for a checkpoint not trained here); 0 skips them")
    p.add_argument("--max_new_tokens", type=int, default=64, help="answer budget (default 64)")
    p.add_argument("--data", help="JSONL of {prompt, answer}: the prompts of a checkpoint not trained here "
                   "(default: the built-in task set's held-out prompts); with --accuracy_prompts 0 a prompt is "
                   "enough, e.g. extras.real.distill's --heldout file")
    add_device(p)
    args = p.parse_args(argv)
    for name in ("B", "B_cache", "timing_prompts", "rounds", "max_new_tokens"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    if min(args.batch_sizes or [1]) < 1 or (args.accuracy_prompts or 0) < 0:
        p.error("--batch_sizes must be at least 1, --accuracy_prompts at least 0")
    return args


def setup(args):
    """(model, tokenizer, B, held-out examples, note), filling the defaults that depend on the checkpoint."""
    ckpt = load_checkpoint(args.ckpt, args.device)
    model, tok = model_from_checkpoint(ckpt, args.device)
    ours = "train_config" in ckpt
    B = args.B or (ckpt["mars"]["B"] if "mars" in ckpt else 4)
    if args.data and args.accuracy_prompts == 0:  # timing only: the prompts, no answer to score
        examples = read_prompts(args.data, 0)
    elif args.data:
        examples = data.read_jsonl(args.data)
    elif ours:
        cfg = ckpt["train_config"]
        examples = data.splits_of(cfg)["test"]
    else:
        examples = data.build_instruction_set(0)["test"]
    examples = [e for e in examples if len(tok.prompt_ids(e["prompt"])) < model.config.max_seq_len]
    if not examples:
        raise UserError("no held-out prompt fits the model's context")
    args.batch_sizes = args.batch_sizes or ([1, 4, 16, 32] if ours else [1, 8])
    args.timing_prompts = args.timing_prompts or (256 if ours else 8)
    args.rounds = args.rounds or (5 if ours else 2)
    if args.accuracy_prompts is None:
        args.accuracy_prompts = len(examples) if ours else args.timing_prompts
    real = ("AR is this checkpoint at B = 1, not the real model it was trained from: the same shapes cost the "
            "same per forward, and one set of weights keeps the answers alike")
    note = (f"{args.ckpt} is an AR checkpoint: its masks were never trained (B = {B})" if "mars" not in ckpt
            else real if "hf" in ckpt else "")
    return model.eval(), tok, B, examples, note


def decoders(B, args):
    """{(cache, tau): {mode: generate_batch options}}, the comparisons of every batch size."""
    caches = {"sliding": dict(cache="sliding"), "block": dict(cache="block", B_cache=args.B_cache)}
    return {(cache, tau): {mode: dict(B=B, tau=tau, masks=mode, **caches[cache]) for mode in ("fixed", "auto")}
            for cache in args.caches for tau in args.taus}


def timed_pass(model, tok, prompts, batch_size, max_new_tokens, **decode):
    """(output tokens, forwards, seconds) of one pass over prompts (lists of ids), batch by batch."""
    tokens = forwards = seconds = 0
    for i in range(0, len(prompts), batch_size):
        gens = generate_batch(model, prompts[i:i + batch_size], tok.eot, tok.mask, max_new_tokens=max_new_tokens,
                              n_vocab=tok.n_vocab, **decode)
        tokens += sum(len(g.tokens) for g in gens)
        forwards += sum(g.forwards for g in gens)
        seconds += gens[0].seconds
    return tokens, forwards, seconds


def speed(model, tok, B, examples, args, progress):
    """{(batch, cache, tau, mode): {rates, ratios, tokens_per_forward}}, mode "ar" under cache and tau None."""
    prompts = [tok.prompt_ids(e["prompt"]) for e in examples[:args.timing_prompts]]
    runs = decoders(B, args)
    out, t0 = {}, time.perf_counter()
    for r in range(args.rounds + 1):  # round 0 warms up
        if r:
            progress(f"a round takes about {(time.perf_counter() - t0) / r:.0f}s: the timing ends in about "
                     f"{(time.perf_counter() - t0) / r * (args.rounds + 1 - r):.0f}s")
        for bs in args.batch_sizes:
            passes = [((bs, None, None, "ar"), dict(B=1))]
            for i, ((cache, tau), modes) in enumerate(runs.items()):
                order = ("fixed", "auto") if (r + i) % 2 == 0 else ("auto", "fixed")
                passes += [((bs, cache, tau, mode), modes[mode]) for mode in order]
            for key, decode in passes:
                tokens, forwards, seconds = timed_pass(model, tok, prompts, bs, args.max_new_tokens, **decode)
                progress(f"round {r}/{args.rounds} batch {bs} {key[1] or 'AR'} {key[2] or ''} {key[3]}: "
                         f"{tokens / seconds:.0f} tokens/s, {tokens / forwards:.2f} tokens/forward")
                if r:
                    row = out.setdefault(key, {"rates": [], "tokens_per_forward": tokens / forwards})
                    row["rates"].append(tokens / seconds)
    for (bs, cache, tau, mode), row in out.items():
        ar = out[(bs, None, None, "ar")]["rates"]
        row["ratios"] = [x / a for x, a in zip(row["rates"], ar)]
    return out


def accuracy(model, tok, B, examples, args, progress):
    """{(batch or None, cache, tau, mode): score summary}: batch None for AR and fixed (any batch), auto per batch."""
    test, out = examples[:args.accuracy_prompts], {}
    if not test:
        return out
    passes = [((None, None, None, "ar"), QUALITY_BATCH, dict(B=1))]
    for (cache, tau), modes in decoders(B, args).items():
        passes.append(((None, cache, tau, "fixed"), QUALITY_BATCH, modes["fixed"]))
        passes += [((bs, cache, tau, "auto"), bs, modes["auto"]) for bs in args.batch_sizes]
    for key, bs, decode in passes:
        trace = []
        r = score(model, tok, test, bs, max_new_tokens=args.max_new_tokens, trace=trace, **decode)
        masks = sum(e["fed"].count(tok.mask) for e in trace) / max(len(trace), 1)
        out[key] = {"accuracy": r["accuracy"], "ci": r["ci"], "n": r["n"], "masks_per_forward": masks,
                    "tokens_per_forward": r["tokens_per_forward"]}
        progress(f"accuracy batch {bs} {key[1] or 'AR'} {key[2] or ''} {key[3]}: {100 * r['accuracy']:.1f}%, "
                 f"{masks:.2f} masks/forward")
    return out


def rows(speeds, accs, args):
    """One JSON row per batch size, cache, tau and decoder (AR once per batch size)."""
    out = []
    for (bs, cache, tau, mode), s in speeds.items():
        a = accs.get((bs, cache, tau, mode)) or accs.get((None, cache, tau, mode)) or {}
        out.append({"batch_size": bs, "cache": cache, "B_cache": args.B_cache if cache == "block" else None,
                    "tau": tau, "decoder": mode, "tokens_per_forward": s["tokens_per_forward"],
                    "tokens_per_second": statistics.median(s["rates"]), "speedup": statistics.median(s["ratios"]),
                    "speedup_spread": [min(s["ratios"]), max(s["ratios"])], "speedup_rounds": s["ratios"],
                    **{f"accuracy_{k}" if k != "accuracy" else k: v for k, v in a.items()}})
    return out


def goals(result):
    """The issue's goals for auto, per (batch, cache, tau): within 3% of the faster of AR and fixed; faster than
    AR where fixed is slower; accuracy within 0.5 points of fixed."""
    by = {(r["batch_size"], r["cache"], r["tau"], r["decoder"]): r for r in result["rows"]}
    checks = []
    for (bs, cache, tau, mode), auto in by.items():
        if mode != "auto":
            continue
        fixed = by[(bs, cache, tau, "fixed")]
        check = {"batch_size": bs, "cache": cache, "tau": tau,
                 "vs_best": auto["speedup"] / max(1.0, fixed["speedup"]),
                 "beats_ar_where_fixed_does_not": None if fixed["speedup"] >= 1 else auto["speedup"] > 1}
        if "accuracy" in auto and "accuracy" in fixed:
            check["accuracy_points"] = 100 * (auto["accuracy"] - fixed["accuracy"])
        checks.append(check)
    return {"rows": checks, "within_3_percent_of_best": all(c["vs_best"] >= 0.97 for c in checks),
            "beats_ar_where_fixed_does_not": all(c["beats_ar_where_fixed_does_not"] is not False for c in checks),
            "accuracy_within_half_a_point": all(c.get("accuracy_points", 0) >= -0.5 for c in checks)}


def markdown(result):
    lines = ["| batch | cache | tau | decoder | tokens/forward | tokens/s | x AR [min, max] | accuracy % "
             "| masks/forward |", "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        acc = f"{100 * r['accuracy']:.1f}" if "accuracy" in r else "-"
        masks = f"{r['accuracy_masks_per_forward']:.2f}" if "accuracy_masks_per_forward" in r else "-"
        lo, hi = r["speedup_spread"]
        lines.append(f"| {r['batch_size']} | {r['cache'] or '-'} | {r['tau'] or '-'} | {r['decoder']} | "
                     f"{r['tokens_per_forward']:.2f} | {r['tokens_per_second']:.0f} | {r['speedup']:.2f} "
                     f"[{lo:.2f}, {hi:.2f}] | {acc} | {masks} |")
    return "\n".join(lines)


def main(argv=None):
    args = get_args(argv)
    t0 = time.perf_counter()
    model, tok, B, examples, note = setup(args)
    if B < 2:
        raise UserError("MARS needs B >= 2: give --B")

    def progress(line):
        print(f"[{time.perf_counter() - t0:5.0f}s] {line}", file=sys.stderr, flush=True)

    step_cost = cost.measured(decode_step, model, tok.mask, max(args.batch_sizes), B)  # auto's, profiled once, here
    progress(f"auto's cost model: batches {step_cost.batches}, widths {step_cost.widths}")
    speeds = speed(model, tok, B, examples, args, progress)
    accs = accuracy(model, tok, B, examples, args, progress)
    result = {"command": "python -m extras.bench.masks_bench " + shlex.join(sys.argv[1:] if argv is None else argv),
              "machine": machine(), "device": args.device, "ckpt": args.ckpt, "B": B, "note": note,
              "timing_prompts": min(args.timing_prompts, len(examples)), "rounds": args.rounds,
              "accuracy_prompts": min(args.accuracy_prompts, len(examples)), "max_new_tokens": args.max_new_tokens,
              "how": __doc__.split("\n\n", 2)[2].strip(),
              "step_cost": {"batches": step_cost.batches, "widths": step_cost.widths,
                            "seconds": step_cost.seconds.tolist()}}
    result["rows"] = rows(speeds, accs, args)
    result["goals"] = goals(result)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(markdown(result))
    progress(f"done: {args.out}")


if __name__ == "__main__":
    run_cli(main)
