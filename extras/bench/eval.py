"""The paper's tables in miniature: quality with confidence intervals, ablations, wall clock.

    python -m extras.bench.eval                                  # out/ar.pt, out/mars.pt (+ out/control.pt) -> out/
    python -m extras.bench.eval --ckpt out/mars.pt out/b8.pt     # a Pareto curve per MARS checkpoint
    python -m extras.bench.eval --limit 200 --repeats 2          # a quick look
    python -m extras.bench.eval --masks auto                     # every MARS decoder feeds the masks that pay (cost.py)
    python -m extras.bench.eval --ckpt DIR_or.pt --data gsm8k_test.jsonl   # your JSONL: accuracy, tokens/forward (section 4)

Writes eval.json, pareto.png and metrics.png to --out_dir and prints the tables as Markdown.

1. Quality on the held-out test set (paper Tables 2 and 4): AR SFT (stage 1),
   the control (stage 2 without its noisy stream: the clean AR term alone, on
   stage 2's batches; beyond the paper, used when its checkpoint exists), MARS at
   tau = 1.0, over a threshold sweep, and lossless. Every accuracy comes with
   a 95% Wilson interval; MARS at tau = 1.0 is compared with AR SFT and with
   the control on the same prompts (paired difference with Newcombe's interval,
   exact McNemar test). Lossless and tau = 1.0 are checked token for token
   against the MARS checkpoint decoded as AR (--ar); accuracy and tokens per
   forward are also given per task family and per answer length, which is
   where MARS pays or does not. Tokens per forward is ours (output tokens over
   each row's forwards) with the official samplers' counter beside it in
   eval.json (see FIELDS).
2. Ablations (paper Table 3, Figures 5 and 7): a threshold sweep per MARS
   checkpoint, drawn as one Pareto plot (pareto.png), and on the first
   checkpoint the confidence metrics prob, entropy and margin (metrics.png).
3. Wall clock (paper Table 5): at each threshold of --speed_thresholds, MARS
   with the sliding cache and with the paper's block cache, at each batch
   size, against AR with KV cache (stage 1) at the same batch size; without
   cache and lossless at batch 1. AR and the decoder alternate batch by batch
   (AR, X, AR, X, ...), so that a slow spell of the machine hits both; the
   speedup is the median over repeats of the ratio of their rates [min, max].
4. Your own JSONL (--data): one checkpoint (ours or a Hugging Face directory) on every record
   of a file of {prompt, answer} (GSM8K's {question, answer "... #### 72"} too) or {prompt,
   response}: accuracy and tokens per forward at tau = 1.0 and a short sweep, nothing else.
   A numeric answer is scored as the paper's GSM8K chain of thought is (records.check, in
   extras/real/records.py: the number after "The answer is", else the last number), any other answer exactly.
"""
import json
import math
import os
import platform
import statistics
import sys

import torch

import data
from common import Parser, UserError, add_device, run_cli
from extras.checkpoints import foreign
from extras.engine.engine import MASK_MODES, METRICS, decode_examples, generate_batch
from extras.bench.report import markdown, plot
from stats import paired, wilson
from extras.real import records

# The paper's Table 5 (Qwen2.5-7B, one H200, GSM8K, tau = 0.95), for the report.
PAPER_TABLE5 = ("paper (Qwen2.5-7B, one H200, GSM8K, tau = 0.95): block cache 1.71x at batch 4 (B_cache 32), "
                "1.60x at batch 8 (B_cache 32), 1.34x at batch 16 (B_cache 16); "
                "without cache 0.90x / 0.49x / 0.23x at batch 4 / 8 / 16")

# What the less obvious fields of eval.json mean (written into it as "fields").
FIELDS = {
    "tokens_per_forward": "ours: output tokens (through the first <|endoftext|>) summed over the prompts, divided "
                          "by the forwards each prompt's row took part in (waits and block writes of the block cache "
                          "included), summed over the prompts; independent of the batch size for the sliding cache",
    "tokens_per_forward_official": "the official samplers' counter (MARSCachedSampler, MARSBlockCachedSampler): per "
                                   "batch, the tokens every row accepted, those past <|endoftext|> in the same "
                                   "forward or block included, over the batch's forwards, each counted once, summed "
                                   "over batches; about batch_size times ours",
    "batch_size": "prompts decoded together in that row (quality rows: 64; speed rows: their batch)",
    "per_length": "the same figures per answer length: the reference response's tokens, <|endoftext|> included",
    "paired.ci": "Newcombe's hybrid score interval for paired proportions (method 10), 95%",
    "identical_to_ar": "prompts whose output differs, token for token, from the MARS checkpoint decoded as AR",
    "speedup": "median over repeats of (decoder's tokens/s) / (AR's tokens/s), both over one pass of the speed "
               "prompts, batch by batch alternating; speedup_spread is [min, max], the lists are *_repeats",
}

# ---------------------------------------------------------------------------
# Quality


LENGTH_BUCKETS = ((1, 4), (5, 8), (9, 16), (17, None))  # answer tokens: short answers leave little to guess ahead


def length_bucket(n):
    lo, hi = next((lo, hi) for lo, hi in LENGTH_BUCKETS if hi is None or n <= hi)
    return f"{lo}-{hi}" if hi else f"{lo}+"


def official_tpf(batches):
    """Tokens per forward as the official samplers count it (MARSCachedSampler, MARSBlockCachedSampler): over
    every batch, the tokens all its rows accepted, those past <|endoftext|> in the same forward or block
    included, over the batch's forwards, each counted once whatever the batch size. `batches`: one list of
    finished requests per generate_batch call. At batch 1 it differs from ours (tokens / steps) only past
    <|endoftext|>; at batch b it is about b times ours."""
    accepted = sum(g.accepted for gens in batches for g in gens)
    # a batch's forwards: every request takes part from the first, and the batch runs until the last one leaves
    return accepted / max(sum(max(g.forwards for g in gens) for gens in batches if gens), 1)


def score(model, tok, examples, batch_size=64, **decode):
    """Exact-answer accuracy (with its 95% interval) and tokens per forward, overall, per task family and
    per answer length; "correct" (one 0/1 per example, in order) and "outputs" (the generated ids) for pairing.

    tokens_per_forward (ours): output tokens (through the first <|endoftext|>) summed over the prompts,
    divided by the forwards each prompt's row took part in (Request.forwards: the block cache's waits and
    writes included), summed over the prompts. It does not depend on the batch size for the sliding cache
    and no cache (a row's forwards are its own), and it is defined for any subset of the prompts.
    tokens_per_forward_official: the official samplers' counter (official_tpf) at this batch size:
    accepted tokens of all rows, those past <|endoftext|> in the same forward included, over the batches'
    forwards, each counted once. It is about batch_size times ours; at batch 1 it equals ours but for the
    tokens past <|endoftext|>. answer_tokens of a prompt: its reference response in tokens, the closing
    <|endoftext|> included (what AR decoding needs forwards for).

    `decode` goes to engine.generate_batch (B, tau, cache, lossless, metric, ...)."""
    done = list(decode_examples(model, tok, examples, batch_size, check=records.check, **decode))
    correct = [int(ok) for _, _, ok in done]
    outputs, forwards = [g.tokens for _, g, _ in done], [g.forwards for _, g, _ in done]
    tokens = [len(t) for t in outputs]
    batches = [[g for _, g, _ in done[i:i + batch_size]] for i in range(0, len(done), batch_size)]

    def summarise(rows):
        k = sum(correct[i] for i in rows)
        n_tokens, n_forwards = sum(tokens[i] for i in rows), sum(forwards[i] for i in rows)
        return {"accuracy": k / len(rows), "ci": wilson(k, len(rows)),
                "tokens_per_forward": n_tokens / max(n_forwards, 1), "tokens": n_tokens, "forwards": n_forwards,
                "n": len(rows)}
    families = sorted({e["task"] for e in examples})
    per_task = {f: summarise([i for i, e in enumerate(examples) if e["task"] == f]) for f in families}
    lengths = [length_bucket(len(tok.encode(e["response"])) + 1) if "response" in e else None for e in examples]
    per_length = {}
    for bucket in (length_bucket(lo) for lo, _ in LENGTH_BUCKETS):
        rows = [i for i, x in enumerate(lengths) if x == bucket]
        if rows:
            per_length[bucket] = summarise(rows)
    return {**summarise(range(len(examples))), "tokens_per_forward_official": official_tpf(batches),
            "batch_size": batch_size, "per_task": per_task, "per_length": per_length, "correct": correct,
            "outputs": outputs}


def label(ckpt):
    """A MARS checkpoint's name on the plots, from what its recipe changes: "B=8, w/o SFT loss, 600 steps"."""
    m = ckpt["mars"]
    parts = [f"B={m['B']}"]
    if m.get("no_sft"):
        parts.append("w/o SFT loss")
    elif m.get("ar_weight", 1.0) != 1.0:
        parts.append(f"ar_weight={m['ar_weight']}")
    if m.get("block_offset", "fixed") != "fixed":
        parts.append(f"{m['block_offset']} block offset")
    return ", ".join(parts + [f"{ckpt['iter']} steps"])


# ---------------------------------------------------------------------------
# Wall clock


def against_ar(ar, x, prompts, batch_size, repeats):
    """Wall clock of decoder x against AR, each a (model, tok, decode) triple.

    Batch by batch, AR decodes the prompts and then x decodes the same ones, so
    both see the same moment of a machine whose speed drifts; one pass over all
    prompts is a repeat, the first a warm-up. Returns x's row, AR's rates and AR's official counter.

    A repeat's rate is its output tokens over its seconds (generate_batch's clock, which waits for
    the device), summed over the batches of the pass; the repeat's ratio is x's rate over AR's. The
    speedup is the median of the per-repeat ratios, speedup_spread their [min, max]; the lists are in
    the row. tokens_per_forward (ours) and tokens_per_forward_official come from the same timed
    passes (greedy decoding commits the same tokens in every pass), so every figure of a row is one
    measurement."""
    ids = [[t.prompt_ids(p) for p in prompts] for _, t, _ in (ar, x)]
    ar_rates, rates, ratios = [], [], []
    for r in range(repeats + 1):
        tokens, forwards, seconds, batches = [0, 0], [0, 0], [0.0, 0.0], ([], [])
        for i in range(0, len(prompts), batch_size):
            for k, (m, t, decode) in enumerate((ar, x)):
                gens = generate_batch(m, ids[k][i:i + batch_size], t.eot, t.mask, **decode)
                tokens[k] += sum(len(g.tokens) for g in gens)
                forwards[k] += sum(g.forwards for g in gens)
                seconds[k] += gens[0].seconds
                batches[k].append(gens)
        if r > 0:
            ar_rates.append(tokens[0] / seconds[0])
            rates.append(tokens[1] / seconds[1])
            ratios.append(rates[-1] / ar_rates[-1])
    row = {"tokens_per_second": statistics.median(rates), "tokens_per_forward": tokens[1] / forwards[1],
           "tokens_per_forward_official": official_tpf(batches[1]), "speedup": statistics.median(ratios),
           "speedup_spread": [min(ratios), max(ratios)], "speedup_repeats": ratios, "tokens_per_second_repeats": rates,
           "ar_tokens_per_second_repeats": ar_rates}
    return row, ar_rates, official_tpf(batches[0])


def wall_clock(ar, mars_model, B, prompts, args):
    """The speed rows, batch size by batch size: AR's row, then each MARS decoder's."""
    speed = []
    print(f"wall clock on {len(prompts)} prompts, {args.repeats} repeats per row after a warm-up", file=sys.stderr)
    for bs in args.batch_sizes:
        decoders = [(tau, "mars_sliding", dict(cache="sliding"), None) for tau in args.speed_thresholds]
        decoders += [(tau, "mars_block", dict(cache="block", B_cache=cb), cb)
                     for tau in args.speed_thresholds for cb in args.B_cache]
        if bs == 1:
            decoders += [(tau, "mars_nocache", dict(cache="none"), None) for tau in args.speed_thresholds]
            decoders += [(None, "lossless", dict(lossless=True), None)]
        ar_rates, rows = [], []
        for tau, name, decode, cb in decoders:
            x = dict(B=B, tau=tau or 1.0, masks=args.masks, **decode)
            r, a, ar_official = against_ar((*ar, dict(B=1)), (*mars_model, x), prompts, bs, args.repeats)
            ar_rates += a
            rows.append({"decoder": name, "batch_size": bs, "threshold": tau, "cache_block": cb, **r})
            print(f"  {name:12s} batch {bs:2d} tau {tau} B_cache {cb}: {r['tokens_per_second']:7.1f} tokens/s, "
                  f"{r['tokens_per_forward']:.2f} tokens/forward, {r['speedup']:.2f}x AR "
                  f"[{r['speedup_spread'][0]:.2f}, {r['speedup_spread'][1]:.2f}]", file=sys.stderr, flush=True)
        # AR's own row: its spread is its rates' range over their median, the noise every ratio above sits in
        med = statistics.median(ar_rates)
        speed += [{"decoder": "ar", "batch_size": bs, "threshold": None, "cache_block": None, "tokens_per_second": med,
                   "tokens_per_forward": 1.0, "tokens_per_forward_official": ar_official, "speedup": 1.0,
                   "speedup_spread": [min(ar_rates) / med, max(ar_rates) / med]}] + rows
    return speed


def read_prompts(path, n):
    """The first n records (all with n = 0) of a JSONL of {task, prompt[, answer]}, e.g. the held-out and validation
    prompts extras.real.distill writes: prompts to decode, with or without an answer."""
    try:
        with open(path, encoding="utf-8") as f:
            records = [json.loads(line) for line in f if line.strip()]
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: not a readable JSONL ({e})") from None
    if not records or not all(isinstance(r, dict) and isinstance(r.get("prompt"), str) for r in records):
        raise UserError(f"{path}: expected one {{task, prompt[, answer]}} per line")
    if n and len(records) < n:
        raise UserError(f"{path} holds {len(records)} prompts, fewer than the {n} asked for")
    return records[:n or None]


def machine():
    cpu = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        names = [l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")]
        cpu = names[0] if names else cpu
    load = f", load {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    return (f"{cpu} (torch CPU capability {torch.backends.cpu.get_cpu_capability()}), {os.cpu_count()} cores, "
            f"torch {torch.__version__}, {torch.get_num_threads()} threads{load}")


# ---------------------------------------------------------------------------


def get_args(argv=None):
    p = Parser(__doc__)
    p.add_argument("--ar_ckpt", default="out/ar.pt", help="stage-1 (AR SFT) checkpoint (default out/ar.pt)")
    p.add_argument("--ckpt", nargs="+", default=["out/mars.pt"],
                   help="MARS checkpoints (default out/mars.pt): the first gets every table; each gets a threshold "
                        "sweep and a curve on pareto.png, labelled from its recipe (B, w/o SFT loss, ...)")
    p.add_argument("--control_ckpt", default=None,
                   help="the control: stage 2 without its noisy stream (python train.py --stage control); "
                        "default control.pt beside --ar_ckpt, skipped when that file does not exist")
    p.add_argument("--out_dir", default="out", help="where eval.json, pareto.png and metrics.png go (default out)")
    p.add_argument("--limit", type=int, default=None, help="use only the first N held-out prompts (default all)")
    p.add_argument("--data", help="score --ckpt's first checkpoint on your JSONL of {prompt, answer} or {prompt, "
                                  "response} (e.g. GSM8K) at tau = 1.0 and --thresholds (default 0.95 0.9) only")
    p.add_argument("--max_new_tokens", type=int, default=256, help="with --data: the answer's budget (default 256, "
                                                                   "the paper's)")
    p.add_argument("--thresholds", type=float, nargs="+", default=None,
                   help="the tau sweep of the quality tables, for every checkpoint and metric "
                        "(default 0.99 0.98 0.95 0.9 0.8 0.7 0.5; 1.0 is always included)")
    p.add_argument("--speed_thresholds", type=float, nargs="+", default=[0.95, 0.9],
                   help="tau of the wall-clock rows (default 0.95, the paper's, and 0.9)")
    p.add_argument("--speed_prompts", type=int, default=32, help="held-out prompts decoded per timed repeat (default 32)")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed passes over the speed prompts per wall-clock row, after a warm-up pass; "
                        "the median speedup is reported (default 3)")
    p.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 4, 16],
                   help="batch sizes of the wall-clock rows (default 1 4 16); no-cache and lossless rows need 1")
    p.add_argument("--B_cache", type=int, nargs="+", default=[4, 8, 16, 32],
                   help="the paper's B_cache (positions filled between two cache writes) of the block-cache rows, "
                        "one row each (default 4 8 16 32)")
    p.add_argument("--masks", choices=MASK_MODES, default="fixed", help="masks of every MARS decoder: fixed "
                   "(default, the paper's B - 1 per forward) or auto (as many as pay for what they cost on this machine, "
                   "cost.py; beyond the paper, and its outputs depend on the machine's timings; the block-cache rows "
                   "then slide)")
    add_device(p)
    args = p.parse_args(argv)
    args.thresholds = args.thresholds or ([0.95, 0.9] if args.data else [0.99, 0.98, 0.95, 0.9, 0.8, 0.7, 0.5])
    if any(not 0 < t <= 1 for t in args.thresholds + args.speed_thresholds):
        p.error("thresholds must be in (0, 1]")
    if min([args.speed_prompts, args.repeats] + args.batch_sizes + args.B_cache + [args.limit or 1]) < 1:
        p.error("--limit, --speed_prompts, --repeats, --batch_sizes and --B_cache must be at least 1")
    return args


def main(argv=None):
    args = get_args(argv)
    if args.data:
        return score_jsonl(args)
    control_path = args.control_ckpt or os.path.join(os.path.dirname(args.ar_ckpt), "control.pt")
    if args.control_ckpt is None and not os.path.isfile(control_path):
        control_path = None  # the default control is optional; one asked for by name must exist
    loaded = [foreign.load(path, args.device) for path in args.ckpt]
    ckpts, models = [c for c, _, _ in loaded], [(m, t) for _, m, t in loaded]
    for path, ckpt in zip(args.ckpt, ckpts):
        if "mars" not in ckpt:
            raise UserError(f"{path} is not a MARS checkpoint")
    _, ar_model, ar_tok = foreign.load(args.ar_ckpt, args.device)
    control = None
    if control_path:
        control_ckpt, *control = foreign.load(control_path, args.device)
        if "mars" in control_ckpt:
            raise UserError(f"{control_path} is a MARS checkpoint; the control is trained without the noisy stream")
    for m, _ in models + [(ar_model, ar_tok)] + ([control] if control else []):
        m.eval()
    model, tok = models[0]
    B = ckpts[0]["mars"]["B"]
    if "train_config" not in ckpts[0]:  # a Hugging Face directory: no held-out split of its own
        raise UserError(f"{args.ckpt[0]} has no held-out test set of its training data: score it on yours "
                        "with --data my_eval.jsonl")
    cfg = ckpts[0]["train_config"]
    test = data.splits_of(cfg, read=records.read_record)["test"][:args.limit]
    if not test:
        raise UserError("the data of this checkpoint has no held-out test examples to evaluate")
    taus = [1.0] + sorted(set(args.thresholds) - {1.0}, reverse=True)
    os.makedirs(args.out_dir, exist_ok=True)

    # 1. quality of the first MARS checkpoint against AR SFT and the control
    def row(decoder, threshold, m, t, **decode):
        r = score(m, t, test, masks=args.masks, **decode)  # AR (B = 1) feeds no masks either way
        lo, hi = r["ci"]
        name = decoder + (f" ({decode['metric']})" if "metric" in decode else "")
        print(f"  {name:15s} tau={threshold or '-'}: accuracy {100 * r['accuracy']:.1f}% "
              f"[{100 * lo:.1f}, {100 * hi:.1f}], {r['tokens_per_forward']:.2f} tokens/forward",
              file=sys.stderr, flush=True)
        return {"decoder": decoder, "threshold": threshold, **r}

    print(f"quality on {len(test)} held-out prompts (B = {B})", file=sys.stderr)
    quality = [row("ar", None, ar_model, ar_tok, B=1)]
    if control:
        quality.append(row("control", None, *control, B=1))
    sweep = [row("mars", tau, model, tok, B=B, tau=tau) for tau in taus]
    quality += sweep + [row("lossless", None, model, tok, B=B, lossless=True)]
    # lossless and tau = 1.0 against `sample.py --ar` on the same checkpoint (B = 1), token for token
    print("  the MARS checkpoint decoded as AR (B = 1), the reference of lossless", file=sys.stderr, flush=True)
    as_ar = score(model, tok, test, B=1)["outputs"]
    outputs = {(q["decoder"], q["threshold"]): q["outputs"] for q in quality}
    identity = {"reference": "the first MARS checkpoint decoded as AR (sample.py --ar: B = 1, greedy, sliding cache)",
                "n": len(test), **{f"{name}_differ": sum(a != b for a, b in zip(outputs[key], as_ar))
                                   for name, key in (("lossless", ("lossless", None)), ("tau1", ("mars", 1.0)))}}
    correct = {(q["decoder"], q["threshold"]): q["correct"] for q in quality}
    mars1 = correct[("mars", 1.0)]
    paired_rows = [{"a": "MARS tau=1.0", "b": "AR SFT", **paired(mars1, correct[("ar", None)])}]
    if control:
        paired_rows.append({"a": "MARS tau=1.0", "b": "control", **paired(mars1, correct[("control", None)])})
    paired_rows += [{"a": f"MARS tau={tau}", "b": "MARS tau=1.0", **paired(correct[("mars", tau)], mars1)}
                    for tau in taus[1:]]

    # 2. ablations: a sweep per MARS checkpoint, and the confidence metrics on the first
    ablations = [{"ckpt": args.ckpt[0], "label": label(ckpts[0]), "mars": ckpts[0]["mars"], "sweep": sweep}]
    for path, ckpt, (m, t) in zip(args.ckpt[1:], ckpts[1:], models[1:]):
        print(f"threshold sweep of {path}", file=sys.stderr)
        b = ckpt["mars"]["B"]
        ablations.append({"ckpt": path, "label": label(ckpt), "mars": ckpt["mars"],
                          "sweep": [row("mars", tau, m, t, B=b, tau=tau) for tau in taus]})
    labels = [a["label"] for a in ablations]
    for a in ablations:  # the same recipe twice: tell the curves apart by file
        if labels.count(a["label"]) > 1:
            a["label"] += f" ({a['ckpt']})"
    print("confidence metrics (first checkpoint)", file=sys.stderr)
    metrics = {"prob": sweep}
    for metric in METRICS:
        if metric != "prob":  # tau = 1.0 commits one token whatever the metric: share that row
            metrics[metric] = [sweep[0]] + [row("mars", tau, model, tok, B=B, tau=tau, metric=metric)
                                            for tau in taus[1:]]
    V = model.config.vocab_size
    entropy_note = (f"entropy confidence is 1 - H/ln(V), V = {V}: tau = c accepts H <= (1 - c) * ln V "
                    f"= (1 - c) * {math.log(V):.3f} nats (the paper thresholds H in nats directly)")

    baselines = {"AR SFT": quality[0]["accuracy"]} | ({"control": quality[1]["accuracy"]} if control else {})
    plot(os.path.join(args.out_dir, "pareto.png"), [(f"MARS {a['label']}", a["sweep"]) for a in ablations], baselines,
         "accuracy vs tokens per forward, one curve per checkpoint (tau)", lossless=quality[-1])
    plot(os.path.join(args.out_dir, "metrics.png"), [(f"{k} (B={B})", v) for k, v in metrics.items()], baselines,
         "confidence metrics: accuracy vs tokens per forward (tau)")

    # 3. wall clock
    prompts = [e["prompt"] for e in test[:args.speed_prompts]]
    speed = wall_clock((ar_model, ar_tok), (model, tok), B, prompts, args)

    for q in quality + [r for a in ablations for r in a["sweep"]] + [r for v in metrics.values() for r in v]:
        q.pop("correct", None)  # per-prompt lists served the pairing; the JSON keeps the summaries
        q.pop("outputs", None)
    result = {"quality": quality, "paired": paired_rows, "identical_to_ar": identity,
              "fields": FIELDS, "ablations": ablations, "metrics": metrics,
              "entropy_note": entropy_note, "speed": speed, "paper_table5": PAPER_TABLE5, "machine": machine(),
              "device": args.device, "B": B, "masks": args.masks, "ar_ckpt": args.ar_ckpt, "ckpt": args.ckpt,
              "control_ckpt": control_path, "n_test": len(test), "speed_prompts": len(prompts), "repeats": args.repeats}
    with open(os.path.join(args.out_dir, "eval.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(markdown(result))


def score_jsonl(args):
    """Section 4: the first --ckpt on every record of --data, at tau = 1.0 and --thresholds (a MARS
    checkpoint; an AR one at tau = 1.0 only) -> <out_dir>/eval_data.json and a Markdown table."""
    ckpt, model, tok = foreign.load(args.ckpt[0], args.device)
    model.eval()
    examples = data.read_jsonl(args.data, read=records.read_record)[:args.limit]
    if not examples:
        raise UserError(f"{args.data}: no records")
    B = ckpt["mars"]["B"] if "mars" in ckpt else 1
    taus = [1.0] + (sorted(set(args.thresholds) - {1.0}, reverse=True) if B > 1 else [])
    rows = []
    print(f"{args.ckpt[0]} on {len(examples)} records of {args.data} (B = {B})", file=sys.stderr)
    for tau in taus:
        r = score(model, tok, examples, B=B, tau=tau, max_new_tokens=args.max_new_tokens, masks=args.masks)
        rows.append({"threshold": tau, **{k: v for k, v in r.items() if k != "outputs"}})
        print(f"  tau={tau}: accuracy {100 * r['accuracy']:.1f}% [{100 * r['ci'][0]:.1f}, {100 * r['ci'][1]:.1f}], "
              f"{r['tokens_per_forward']:.2f} tokens/forward", file=sys.stderr, flush=True)
    result = {"ckpt": args.ckpt[0], "data": args.data, "n": len(examples), "B": B, "masks": args.masks,
              "checkers": sorted({e["task"] for e in examples}), "max_new_tokens": args.max_new_tokens,
              "rows": rows, "machine": machine(), "device": args.device}
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "eval_data.json"), "w") as f:
        json.dump(result, f, indent=1)
    print("| tau | accuracy % | 95% CI | tokens/forward |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['threshold']} | {100 * r['accuracy']:.1f} | [{100 * r['ci'][0]:.1f}, {100 * r['ci'][1]:.1f}] | "
              f"{r['tokens_per_forward']:.2f} |")


if __name__ == "__main__":
    run_cli(main)
