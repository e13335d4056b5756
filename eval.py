"""The paper's tables in miniature: quality, tokens per forward, wall clock.

    python eval.py                  # out/ar.pt and out/mars.pt -> out/eval.json, out/pareto.png
    python eval.py --limit 100      # a quick look

1. Quality on the held-out test set (paper Tables 2 and 4): AR SFT (stage 1,
   AR decoding), MARS at tau = 1.0, MARS over a threshold sweep, and lossless
   MARS; exact-answer accuracy and tokens per forward, overall and per family.
2. The Pareto plot (paper Figure 5): accuracy against tokens per forward.
3. Wall clock (paper Table 5): AR with KV cache against MARS without cache,
   with the sliding cache, lossless, and with the block cache in batches; the
   median of several repeats after a warm-up, on the same prompts.
"""
import json
import os
import platform
import statistics
import sys

import torch

import data
from sample import Parser, UserError, generate, load_checkpoint, model_from_checkpoint, run_cli


def score(model, tok, examples, batch_size=64, **decode):
    """Exact-answer accuracy and tokens per forward, overall and per task family.

    `decode` goes to sample.generate (B, tau, cache, lossless, ...)."""
    per_task = {}
    for i in range(0, len(examples), batch_size):
        batch = examples[i:i + batch_size]
        gens = generate(model, [tok.prompt_ids(e["prompt"]) for e in batch], tok.eot, tok.mask, **decode)
        for e, g in zip(batch, gens):
            text = tok.decode([t for t in g.tokens if t != tok.eot])
            t = per_task.setdefault(e["task"], {"n": 0, "correct": 0, "tokens": 0, "forwards": 0})
            t["n"] += 1
            t["correct"] += data.check(e, text)
            t["tokens"] += len(g.tokens)
            t["forwards"] += g.forwards

    def summarise(t):
        return {"accuracy": t["correct"] / t["n"], "tokens_per_forward": t["tokens"] / max(t["forwards"], 1), "n": t["n"]}
    total = {k: sum(t[k] for t in per_task.values()) for k in ("n", "correct", "tokens", "forwards")}
    return {**summarise(total), "per_task": {k: summarise(v) for k, v in sorted(per_task.items())}}


def tokens_per_second(model, tok, prompts, batch_size, repeats, **decode):
    """(tokens/s, tokens/forward): the median over `repeats` (after one warm-up) of
    generated tokens / wall seconds, decoding `prompts` in batches of `batch_size`."""
    ids = [tok.prompt_ids(p) for p in prompts]
    rates = []
    for r in range(repeats + 1):
        tokens = seconds = forwards = 0
        for i in range(0, len(ids), batch_size):
            gens = generate(model, ids[i:i + batch_size], tok.eot, tok.mask, **decode)
            tokens += sum(len(g.tokens) for g in gens)
            forwards += sum(g.forwards for g in gens)
            seconds += gens[0].seconds
        if r > 0:
            rates.append(tokens / seconds)
    return statistics.median(rates), tokens / forwards


def machine():
    cpu = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        names = [l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")]
        cpu = names[0] if names else cpu
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"


def get_args(argv=None):
    p = Parser(__doc__)
    p.add_argument("--ar_ckpt", default="out/ar.pt", help="stage-1 (AR SFT) checkpoint (default out/ar.pt)")
    p.add_argument("--ckpt", default="out/mars.pt", help="MARS checkpoint (default out/mars.pt)")
    p.add_argument("--out_dir", default="out", help="where eval.json and pareto.png go (default out)")
    p.add_argument("--limit", type=int, default=None, help="use only the first N held-out prompts (default all)")
    p.add_argument("--thresholds", type=float, nargs="+", default=[0.99, 0.98, 0.95, 0.9, 0.8, 0.7, 0.5],
                   help="the tau sweep of the quality table (tau = 1.0 is always included)")
    p.add_argument("--speed_threshold", type=float, default=0.9, help="tau of the wall-clock table (default 0.9)")
    p.add_argument("--speed_prompts", type=int, default=32, help="held-out prompts timed per row (default 32)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per row, after a warm-up; the median is reported")
    p.add_argument("--batch_sizes", type=int, nargs="+", default=[4, 16], help="batch sizes of the batched rows")
    p.add_argument("--cache_blocks", type=int, nargs="+", default=[8, 16, 32], help="block-cache sizes to time")
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default cuda when available)")
    args = p.parse_args(argv)
    if any(not 0 < t <= 1 for t in args.thresholds + [args.speed_threshold]):
        p.error("thresholds must be in (0, 1]")
    if min([args.speed_prompts, args.repeats] + args.batch_sizes + args.cache_blocks + [args.limit or 1]) < 1:
        p.error("--limit, --speed_prompts, --repeats, --batch_sizes and --cache_blocks must be at least 1")
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return args


def main(argv=None):
    args = get_args(argv)
    ar_ckpt, mars_ckpt = load_checkpoint(args.ar_ckpt, args.device), load_checkpoint(args.ckpt, args.device)
    if "mars" not in mars_ckpt:
        raise UserError(f"{args.ckpt} is not a MARS checkpoint")
    ar_model, tok = model_from_checkpoint(ar_ckpt, args.device)
    model, mtok = model_from_checkpoint(mars_ckpt, args.device)
    ar_model.eval(), model.eval()
    B = mars_ckpt["mars"]["B"]
    cfg = mars_ckpt["train_config"]
    test = data.load_splits(cfg["data"], cfg["seed"], cfg["n_train"])["test"][:args.limit]
    os.makedirs(args.out_dir, exist_ok=True)

    # 1. quality
    quality = []

    def add_quality(decoder, threshold, m, t, **decode):
        r = score(m, t, test, **decode)
        quality.append({"decoder": decoder, "threshold": threshold, **r})
        print(f"  {decoder:9s} tau={threshold}: accuracy {100 * r['accuracy']:.1f}%, "
              f"{r['tokens_per_forward']:.2f} tokens/forward", file=sys.stderr, flush=True)

    print(f"quality on {len(test)} held-out prompts (B = {B})", file=sys.stderr)
    add_quality("ar", None, ar_model, tok, B=1)
    for tau in [1.0] + sorted(set(args.thresholds) - {1.0}, reverse=True):
        add_quality("mars", tau, model, mtok, B=B, tau=tau)
    add_quality("lossless", None, model, mtok, B=B, lossless=True)

    # 2. the Pareto plot
    plot_pareto(quality, os.path.join(args.out_dir, "pareto.png"), B)

    # 3. wall clock
    prompts = [e["prompt"] for e in test[:args.speed_prompts]]
    tau = args.speed_threshold
    speed = []
    print(f"wall clock on {len(prompts)} prompts, tau = {tau}, median of {args.repeats}", file=sys.stderr)

    def add_speed(decoder, batch_size, m, t, cache_block=None, threshold=None, **decode):
        rate, tpf = tokens_per_second(m, t, prompts, batch_size, args.repeats, cache_block=cache_block or 16, **decode)
        base = next((s["tokens_per_second"] for s in speed if s["decoder"] == "ar" and s["batch_size"] == batch_size), rate)
        speed.append({"decoder": decoder, "batch_size": batch_size, "cache_block": cache_block, "threshold": threshold,
                      "tokens_per_second": rate, "speedup": rate / base, "tokens_per_forward": tpf})
        print(f"  {decoder:13s} batch {batch_size:2d} cache_block {cache_block}: {rate:7.1f} tokens/s, "
              f"{tpf:.2f} tokens/forward, {rate / base:.2f}x AR", file=sys.stderr, flush=True)

    for bs in [1] + args.batch_sizes:
        add_speed("ar", bs, ar_model, tok, B=1)  # AR with KV cache: the baseline of this batch size
        if bs == 1:
            add_speed("mars_nocache", 1, model, mtok, B=B, tau=tau, threshold=tau, cache="none")
            add_speed("lossless", 1, model, mtok, B=B, lossless=True)
        add_speed("mars_sliding", bs, model, mtok, B=B, tau=tau, threshold=tau, cache="sliding")
        for cb in args.cache_blocks:
            add_speed("mars_block", bs, model, mtok, B=B, tau=tau, threshold=tau, cache="block", cache_block=cb)

    result = {"quality": quality, "speed": speed, "machine": machine(), "device": args.device, "B": B,
              "ar_ckpt": args.ar_ckpt, "ckpt": args.ckpt, "n_test": len(test), "speed_prompts": len(prompts)}
    with open(os.path.join(args.out_dir, "eval.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(markdown(result))


def plot_pareto(quality, path, B):
    from matplotlib.figure import Figure  # no pyplot: leaves the caller's backend alone
    sweep = [q for q in quality if q["decoder"] == "mars"]
    ar = next(q for q in quality if q["decoder"] == "ar")
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    ax.plot([q["tokens_per_forward"] for q in sweep], [100 * q["accuracy"] for q in sweep], "o-", label=f"MARS (B={B})")
    for q in sweep:
        ax.annotate(f"{q['threshold']}", (q["tokens_per_forward"], 100 * q["accuracy"]),
                    textcoords="offset points", xytext=(4, 4), fontsize=8)
    lossless = [q for q in quality if q["decoder"] == "lossless"]
    for q in lossless:
        ax.plot(q["tokens_per_forward"], 100 * q["accuracy"], "s", label="MARS lossless")
    ax.axhline(100 * ar["accuracy"], ls=":", color="gray", label="AR SFT")
    ax.set(xlabel="tokens per forward", ylabel="held-out accuracy (%)", title="accuracy vs tokens per forward (tau)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def markdown(result):
    q = result["quality"]
    tasks = list(q[0]["per_task"])
    name = lambda r: r["decoder"] if r["threshold"] is None else f"{r['decoder']} tau={r['threshold']}"
    lines = [f"Quality ({result['n_test']} held-out prompts, B = {result['B']}): accuracy % (tokens/forward)", "",
             "| decoder | all | " + " | ".join(tasks) + " |", "|---" * (len(tasks) + 2) + "|"]
    for r in q:
        cells = [f"{100 * r['accuracy']:.1f} ({r['tokens_per_forward']:.2f})"]
        cells += [f"{100 * r['per_task'][t]['accuracy']:.0f} ({r['per_task'][t]['tokens_per_forward']:.2f})" for t in tasks]
        lines.append(f"| {name(r)} | " + " | ".join(cells) + " |")
    lines += ["", f"Wall clock ({result['speed_prompts']} prompts; {result['machine']}; {result['device']})", "",
              "| decoder | batch | cache_block | tau | tokens/forward | tokens/s | speedup vs AR |",
              "|---|---|---|---|---|---|---|"]
    for s in result["speed"]:
        lines.append(f"| {s['decoder']} | {s['batch_size']} | {s['cache_block'] or '-'} | {s['threshold'] or '-'} | "
                     f"{s['tokens_per_forward']:.2f} | {s['tokens_per_second']:.0f} | {s['speedup']:.2f}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    run_cli(main)
