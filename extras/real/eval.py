"""MARS on a real model, measured on held-out prompts as the paper measures: the MARS checkpoint (by
python -m extras.real.distill, then train.py --stage mars) against the base model it started from and
against an AR control trained on the same data with the same schedule (train.py --stage control).

    python -m extras.real.eval --base smollm2 --control out/smollm/control/mars.pt --ckpt out/smollm/mars.pt \
        --heldout out/smollm/heldout.jsonl --out docs/real_smollm2_cpu.json

Writes --out (JSON, with the command that regenerates it) and a PNG beside it:
1. Quality and fidelity, on the held-out prompts: the base model (AR), the control (AR) and MARS at each tau of
   --thresholds and lossless. Quality: the share of checkable instructions passed (extras/real/checks.py's
   checkers), with its Wilson 95% interval, overall and per kind. Fidelity: answers identical, token for
   token, to the base model's greedy answer, and to the MARS model's own AR answer (tau = 1.0); agreement:
   the base answers' tokens written before the first difference; teacher-forced agreement: the share of the
   base answers' tokens that a model's AR argmax predicts when fed the base answer's prefix. Speed: tokens per
   forward (output tokens over the forwards each prompt's row took part in, so independent of the batch).
   Every run of a model decodes its prompts together (continuous batching, --batch rows; each request
   commits what it would alone).
2. Wall clock against AR with the KV cache (the base model at B = 1), at batch 1 on the first --wall_n1
   prompts and at batch 8 on the first --wall_n8: batch by batch, AR then each MARS decoder of
   --wall_thresholds, so a slow spell of the machine hits all; one timed pass after an untimed one over the same
   batches where the engine captures CUDA graphs (every shape it times captured before), else after a warm-up
   forward per decoder (a CPU captures nothing).
Every model decodes in --decode_dtype: auto measures it (extras/bench/decode_dtype.py: bf16 weights where the
device runs them faster, as on a CPU with native bf16; float32 otherwise), and the choice and why are printed
and recorded.
3. With --trend: tokens per forward, identical answers and AR agreement at --trend_tau on the first --trend_n
   prompts, for the base model (step 0: its <|mask|> was never trained) and each --trend checkpoint, by
   training step (train.py overwrites mars.pt; python -m extras.real.snapshots keeps each one it writes).
The JSON's "fields" defines each figure.
"""
import json
import os
import re
import shlex
import sys
import time

import torch

import data
import mars
from extras.engine import engine
from common import UserError, build_model
from common import Parser, add_device, run_cli, threshold
from extras.checkpoints import foreign
from stats import wilson
from extras.bench import decode_dtype
from extras.real import checks
from extras.real.distill import decode_all
from extras.bench.eval import machine, read_prompts

# What the less obvious fields of the result mean (written into it).
FIELDS = {
    "tokens_per_forward": "output tokens (through the end of turn) over the forwards each prompt's row took part "
                          "in, summed over the prompts: independent of the batch",
    "identical": "share of answers identical, token for token, to the base model's greedy answer",
    "identical_to_mars_ar": "the same against the MARS checkpoint's own AR answer (tau = 1.0): what accepting "
                            "several tokens per forward changes, training aside (lossless: 1 by construction)",
    "agreement": "the base answers' tokens written before the first difference, over all the base answers' tokens",
    "ar_agreement": "teacher-forced: share of the base answers' tokens that the MARS model's AR argmax predicts "
                    "when fed the base answer's prefix",
    "cut_off": "answers that reached the budget (max_new_tokens) without an end of turn",
    "quality": "checkable instructions passed (extras/real/checks.py), share and Wilson 95% interval, overall "
               "and per kind",
    "toy": "prompts of the toy's task families: exact = the family's checker (data.check), found = the expected "
           "answer appears in the answer as whole words",
    "speedup": "the decoder's tokens/s over AR's (the base model, KV cache), same prompts, batch by batch in turn, "
               "one timed pass",
    "seconds": "wall clock of each phase of this evaluation",
    "decode_dtype": "the dtype every model decoded in, and why (--decode_dtype; auto: measured)",
}
AR = {"tau": 1.0}  # a request's decoder: AR (tau = 1 feeds no masks), MARS at tau, or lossless
LOSSLESS = {"tau": 1.0, "lossless": True}


def name(decoder):
    return "lossless" if decoder.get("lossless") else f"tau={decoder['tau']}"


def decode(model, tok, prompts, decoders, args, B=1):
    """{decoder name: [finished engine.Request per prompt]}: every (prompt, decoder) pair in one engine."""
    requests = [engine.Request(p, index=i, **d) for d in decoders for i, p in enumerate(prompts)]
    list(decode_all(model, tok, requests, args.batch, args.max_new_tokens, B))  # the requests fill in place
    return {name(d): requests[k * len(prompts):(k + 1) * len(prompts)] for k, d in enumerate(decoders)}


def identical(runs, reference):
    """Share of runs whose answer is the reference's, token for token (None without a reference)."""
    if reference is None:
        return None
    return round(sum(a.tokens == b.tokens for a, b in zip(runs, reference)) / len(runs), 4)


def common_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def ar_agreement(model, tok, prompts, base_runs, rows=8):
    """Teacher-forced: the share of the base answers' tokens that the model's AR argmax predicts when fed the
    base answer's own prefix (a drift that decoding turns into a different answer from the first change on)."""
    hits = total = 0
    for i in range(0, len(prompts), rows):
        x, y = (t.to(model.wte.weight.device) for t in data.make_batch(
            [(p + b.tokens, len(p)) for p, b in zip(prompts[i:i + rows], base_runs[i:i + rows])], tok.eot))
        logits = mars.banned(model.lm_head(model.hidden(x)[y != -1]), tok.mask, tok.n_vocab)  # as decoding
        hits += int((logits.argmax(-1) == y[y != -1]).sum())
        total += int((y != -1).sum())
    return round(hits / max(total, 1), 4)


def found(answer, text):
    """The expected answer appears in the text as whole words (case-insensitive)."""
    return re.search(rf"(?<!\w){re.escape(answer.lower())}(?!\w)", text.lower()) is not None


def quality(checked):
    """The pass rate of the checkable instructions (extras/real/checks.py), with its Wilson 95% interval, overall
    and per kind."""
    def rate(pairs):
        k = sum(checks.passes(e, text) for e, text in pairs)
        return {"n": len(pairs), "pass": round(k / len(pairs), 4), "ci": [round(x, 4) for x in wilson(k, len(pairs))]}
    kinds = sorted({e["kind"] for e, _ in checked})
    return {**rate(checked), "per_kind": {k: rate([(e, t) for e, t in checked if e["kind"] == k]) for k in kinds}}


def scores(examples, base, runs, tok):
    """One row of the sweep: tokens per forward, agreement with the base answers, accuracy on the toy's families."""
    tokens, forwards = sum(len(r.tokens) for r in runs), sum(r.forwards for r in runs)
    row = {"tokens_per_forward": round(tokens / max(forwards, 1), 4), "tokens": tokens, "forwards": forwards,
           "identical": identical(runs, base),
           "agreement": round(sum(common_prefix(r.tokens, b.tokens) for r, b in zip(runs, base))
                              / max(sum(len(b.tokens) for b in base), 1), 4),
           "cut_off": sum(r.tokens[-1:] != [tok.eot] for r in runs)}
    texts = [tok.answer(r.tokens) for r in runs]
    checked = [(e, text) for e, text in zip(examples, texts) if "kind" in e]
    if checked:
        row["quality"] = quality(checked)
    toy = [(e, tok.answer(r.tokens)) for e, r in zip(examples, runs) if "answer" in e]
    if toy:
        row["toy"] = {"n": len(toy), "exact": round(sum(data.check(e, text) for e, text in toy) / len(toy), 4),
                      "found": round(sum(found(e["answer"], text) for e, text in toy) / len(toy), 4)}
    return row


def timed_passes(runs, tok, prompts, batch, max_new_tokens):
    """(seconds, tokens, forwards) per run (name, model, decoder) over the prompts, batch by batch in turn."""
    seconds, tokens, forwards = [0.0] * len(runs), [0] * len(runs), [0] * len(runs)
    for i in range(0, len(prompts), batch):
        for k, (_, model, d) in enumerate(runs):
            done = engine.generate_batch(model, prompts[i:i + batch], tok.eot, tok.mask, n_vocab=tok.n_vocab,
                                         max_new_tokens=max_new_tokens, **d)
            seconds[k] += done[0].seconds
            tokens[k] += sum(len(r.tokens) for r in done)
            forwards[k] += sum(r.forwards for r in done)
    return seconds, tokens, forwards


def wall_clock(base, mars_model, tok, prompts, batch, decoders, args, B):
    """Seconds and tokens of AR (the base model) and each MARS decoder over the same prompts, batch by batch
    in turn; speedup = the decoder's tokens/s over AR's. Warmed up first: where the engine captures CUDA graphs,
    by an untimed pass over the same batches (each (rows, width, keys) shape is captured on its first use, and AR
    and MARS use different ones); else by a forward per decoder (the first one pays for allocations)."""
    runs = [("ar", base, {**AR, "B": 1})] + [(name(d), mars_model, {**d, "B": B}) for d in decoders]
    if base.wte.weight.is_cuda:
        timed_passes(runs, tok, prompts, batch, args.max_new_tokens)
    else:
        timed_passes(runs, tok, prompts[:1], 1, 1)
    seconds, tokens, forwards = timed_passes(runs, tok, prompts, batch, args.max_new_tokens)
    ar_rate = tokens[0] / seconds[0]
    return [{"decoder": n, "batch_size": batch, "prompts": len(prompts), "seconds": round(s, 4), "tokens": t,
             "tokens_per_second": round(t / s, 2), "tokens_per_forward": round(t / f, 4),
             "speedup": round(t / s / ar_rate, 3)} for (n, _, _), s, t, f in zip(runs, seconds, tokens, forwards)]


def trend(base, tok, examples, prompts, base_runs, paths, args, B):
    """Tokens per forward and identical answers at --trend_tau by training step: the base model (step 0),
    then each checkpoint (e.g. the snapshots extras.real.snapshots kept of a run)."""
    d = {"tau": args.trend_tau}
    points = [{"step": 0, **scores(examples, base_runs, decode(base, tok, prompts, [d], args, B)[name(d)], tok),
               "ar_agreement": 1.0}]
    for path in paths:
        ckpt = foreign.read_checkpoint(path, args.device)
        model = build_model(ckpt, args.device, base.wte.weight.dtype).eval()
        runs = decode(model, tok, prompts, [d], args, B)[name(d)]
        points.append({"step": ckpt["iter"], "path": path, **scores(examples, base_runs, runs, tok),
                       "ar_agreement": ar_agreement(model, tok, prompts, base_runs)})
        print(f"  step {ckpt['iter']}: {points[-1]['tokens_per_forward']:.2f} tokens/forward, "
              f"{100 * points[-1]['identical']:.0f}% identical", flush=True)
    return sorted(points, key=lambda p: p["step"])


def plot(path, result):
    """Left: checks passed against tokens per forward (base and control: AR, one token per forward); right:
    answers identical to the base model's and to MARS's own AR answer."""
    from matplotlib.figure import Figure  # no pyplot: leaves the caller's backend alone
    fig = Figure(figsize=(12, 4.5), layout="constrained")
    left, right = fig.subplots(1, 2)
    for r in [result["base"]] + result["control"] + result["sweep"]:
        q = r.get("quality")
        if q:
            left.errorbar(r["tokens_per_forward"], 100 * q["pass"], fmt="o", capsize=3,
                          yerr=[[100 * (q["pass"] - q["ci"][0])], [100 * (q["ci"][1] - q["pass"])]])
            left.annotate(r["decoder"], (r["tokens_per_forward"], 100 * q["pass"]), textcoords="offset points",
                          xytext=(5, 3), fontsize=7)
    left.set(xlabel="tokens per forward", ylabel="checkable instructions passed (%)",
             title=f"{result['n']} held-out checkable instructions, 95% Wilson intervals")
    rows = [r for r in result["sweep"] if not r["decoder"].endswith("lossless")]
    for key, marker, text in (("identical", "o-", "identical to the base model's answer"),
                              ("identical_to_mars_ar", "x--", "identical to the MARS model's own AR answer")):
        right.plot([r["tokens_per_forward"] for r in rows], [100 * r[key] for r in rows], marker, label=text)
    for r in rows:
        right.annotate(r["decoder"], (r["tokens_per_forward"], 100 * r["identical"]), textcoords="offset points",
                       xytext=(4, 4), fontsize=7)
    right.set(xlabel="tokens per forward", ylabel="answers (%)", ylim=(0, 105), title=f"B = {result['B']}")
    right.legend(fontsize=7)
    fig.savefig(path, dpi=100)


def get_args(argv=None):
    p = Parser(__doc__)
    p.add_argument("--base", default="smollm2", help="the base model: a GGUF file or short name, a Hugging Face "
                                                     "directory or one of our checkpoints (default smollm2)")
    p.add_argument("--ckpt", required=True, help="the MARS checkpoint trained from it (train.py --stage mars)")
    p.add_argument("--control", help="the AR control trained from it on the same data and schedule (train.py "
                                     "--stage control), scored beside the base and MARS")
    p.add_argument("--heldout", required=True, help="held-out prompts, {task, prompt[, answer]} per line "
                                                    "(python -m extras.real.distill --heldout)")
    p.add_argument("--out", default="docs/real_smollm2_cpu.json", help="the JSON to write; the plot goes beside "
                                                                      "it as .png (default docs/real_smollm2_cpu.json)")
    p.add_argument("--n", type=int, default=0, help="held-out prompts of the sweep, the first ones (default 0: all)")
    p.add_argument("--thresholds", type=threshold, nargs="+", default=[1.0, 0.95, 0.9, 0.8, 0.7],
                   help="tau of the sweep (default 1.0 0.95 0.9 0.8 0.7); lossless is always added")
    p.add_argument("--batch", type=int, default=32, help="rows decoded together in the sweep and the trend "
                                                         "(default 32; the figures do not depend on it)")
    p.add_argument("--max_new_tokens", type=int, default=128, help="the answers' budget (default 128, "
                                                                   "extras.real.distill's)")
    p.add_argument("--wall_thresholds", type=threshold, nargs="*", default=[0.9],
                   help="tau of the wall-clock rows, with lossless (default 0.9)")
    p.add_argument("--wall_n1", type=int, default=8, help="prompts timed at batch 1 (default 8; 0: none)")
    p.add_argument("--wall_n8", type=int, default=24, help="prompts timed at batch 8 (default 24; 0: none)")
    p.add_argument("--trend", nargs="*", default=[], help="checkpoints saved along the training run, for the trend")
    p.add_argument("--trend_tau", type=threshold, default=0.9, help="tau of the trend (default 0.9)")
    p.add_argument("--trend_n", type=int, default=32, help="prompts of the trend, the first ones (default 32)")
    p.add_argument("--decode_dtype", choices=decode_dtype.DTYPES, default="auto", help="the dtype every model "
                   "decodes in (default auto: bf16 weights where the device runs them faster, measured; else "
                   "float32)")
    add_device(p)
    args = p.parse_args(argv)
    if min(args.batch, args.max_new_tokens, args.trend_n) < 1 or min(args.n, args.wall_n1, args.wall_n8) < 0:
        p.error("--batch, --max_new_tokens and --trend_n must be at least 1; --n, --wall_n1 and --wall_n8 at least 0")
    return args


def report(result):
    print(f"\n{result['n']} held-out prompts, B = {result['B']}, MARS after {result['train']['steps']} steps\n\n"
          "| model, decoder | checks passed (95% CI) | tokens/forward | identical to base | teacher-forced "
          "agreement | identical to MARS AR |\n" + "|---" * 6 + "|")
    for r in [result["base"]] + result.get("control", []) + result["sweep"]:
        q, own, tf = r.get("quality"), r.get("identical_to_mars_ar"), r.get("ar_agreement")
        shown = f"{100 * q['pass']:.1f}% [{100 * q['ci'][0]:.1f}, {100 * q['ci'][1]:.1f}]" if q else "-"
        print(f"| {r['decoder']} | {shown} | {r['tokens_per_forward']:.2f} | {100 * r['identical']:.1f}% | "
              f"{'-' if tf is None else f'{100 * tf:.1f}%'} | {'-' if own is None else f'{100 * own:.1f}%'} |")
    for w in result["wall"]:
        print(f"wall clock, batch {w['batch_size']}, {w['prompts']} prompts: {w['decoder']} "
              f"{w['tokens_per_second']:.1f} tokens/s, {w['tokens_per_forward']:.2f} tokens/forward, "
              f"{w['speedup']:.2f}x AR")


def training(ckpt):
    """What the result records of the training run: its steps, time, recipe and validation losses."""
    config, history = ckpt["train_config"], ckpt.get("history") or [{}]
    # the stage's own numbers: the hf preset fits them to the data and records them in train_config;
    # older checkpoints kept the fitted ones under "schedule"
    fitted = (config.get("schedule") or {}).get(ckpt["stage"]) if isinstance(config.get("schedule"), dict) else None
    batch, steps, lr = ((fitted["batch_size"], fitted["steps"], fitted["lr"]) if fitted else
                        (config["batch_size"], config["mars_iters"] if ckpt["stage"] != "ar" else config["ar_iters"],
                         config["mars_lr"] if ckpt["stage"] != "ar" else config["lr"]))
    return {"steps": ckpt["iter"], "seconds": history[-1].get("elapsed_s"),
            "validation": [{k: round(h[k], 4) if k != "iter" else h[k] for k in ("iter", "val_loss", "val_noisy",
                            "val_clean") if k in h} for h in history if "val_loss" in h],
            "batch_size": batch, "mars_iters": steps, "mars_lr": lr,
            **{k: config.get(k) for k in ("micro_batch", "max_seq_len", "warmup", "ar_weight", "mask_row", "precision",
                                          "data")}}


class Clock:
    """Seconds per phase of the run, for the result (what the evaluation costs)."""

    def __init__(self):
        self.t, self.phases = time.time(), {}

    def lap(self, phase):
        now = time.time()
        self.phases[phase] = round(now - self.t, 1)
        self.t = now


def control_rows(ckpt, tok, examples, prompts, base_runs, args, dtype):
    """The AR control (train.py --stage control: the same data and schedule, the AR loss alone), scored as the
    base is: what any fine-tune of this length costs, MARS aside."""
    model = build_model(ckpt, args.device, getattr(torch, dtype)).eval()
    runs = decode(model, tok, prompts, [AR], args)[name(AR)]
    return [{"decoder": "control AR", **scores(examples, base_runs, runs, tok),
             "ar_agreement": ar_agreement(model, tok, prompts, base_runs)}]


@torch.inference_mode()
def main(argv=None):
    args, clock = get_args(argv), Clock()
    command = shlex.join(["python", "-m", "extras.real.eval", *(sys.argv[1:] if argv is None else argv)])
    examples = read_prompts(args.heldout, args.n)
    ckpt = foreign.read_checkpoint(args.ckpt, args.device)
    if "mars" not in ckpt:
        raise UserError(f"{args.ckpt} is not a MARS checkpoint (train.py --stage mars writes one)")
    _, base, tok = foreign.load(args.base, args.device)
    mars_model, B = build_model(ckpt, args.device).eval(), ckpt["mars"]["B"]
    dtype, why = decode_dtype.choose(base.eval(), B, args.decode_dtype)
    print(f"decoding in {dtype}: {why['reason']}", flush=True)
    base, mars_model = decode_dtype.cast([base, mars_model], dtype)
    prompts = [tok.prompt_ids(e["prompt"]) for e in examples]
    clock.lap("load")
    print(f"sweep: {len(prompts)} prompts, base AR, then MARS at {args.thresholds} and lossless", flush=True)
    base_runs = decode(base, tok, prompts, [AR], args)[name(AR)]
    clock.lap("base")
    control_ckpt = foreign.read_checkpoint(args.control, args.device) if args.control else None
    control = control_rows(control_ckpt, tok, examples, prompts, base_runs, args, dtype) if control_ckpt else []
    clock.lap("control")
    runs = decode(mars_model, tok, prompts, [{"tau": t} for t in args.thresholds] + [LOSSLESS], args, B)
    agreement = ar_agreement(mars_model, tok, prompts, base_runs)
    clock.lap("sweep")
    wall = []
    for batch, n in ((1, args.wall_n1), (8, args.wall_n8)):
        if n:
            print(f"wall clock: batch {batch}, {n} prompts", flush=True)
            wall += wall_clock(base, mars_model, tok, prompts[:n], batch,
                               [{"tau": t} for t in args.wall_thresholds] + [LOSSLESS], args, B)
            clock.lap(f"wall_batch{batch}")
    n = min(args.trend_n, len(prompts))
    points = []
    if args.trend:
        print(f"trend: the base model and {len(args.trend)} checkpoints, {n} prompts", flush=True)
        points = trend(base, tok, examples[:n], prompts[:n], base_runs[:n], args.trend, args, B)
        clock.lap("trend")
    shown = runs.get(name({"tau": args.trend_tau}), [])[:3]
    result = {"command": command, "machine": machine(), "base_model": args.base, "ckpt": args.ckpt,
              "control_ckpt": args.control, "B": B, "n": len(prompts), "max_new_tokens": args.max_new_tokens,
              "batch": args.batch, "train": training(ckpt),
              "control_train": training(control_ckpt) if control_ckpt else None, "fields": FIELDS,
              "base": {"decoder": "base AR", **scores(examples, base_runs, base_runs, tok), "ar_agreement": 1.0},
              "control": control,
              "sweep": [{"decoder": f"MARS {k}", **scores(examples, base_runs, v, tok), "identical_to_mars_ar":
                         identical(v, runs.get("tau=1.0"))} for k, v in runs.items()],
              "ar_agreement": agreement,
              "wall": wall, "trend_tau": args.trend_tau, "trend_n": n, "trend": points,
              "examples": [{"prompt": examples[r.index]["prompt"], "tau": args.trend_tau,
                            "forwards": [tok.decode(c) for c in r.chunks]} for r in shown],
              "decode_dtype": why, "seconds": clock.phases}
    result["sweep"][0]["ar_agreement"] = agreement  # teacher-forced: the MARS model's AR stream, any tau
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(args.out + ".tmp", args.out)
    plot(os.path.splitext(args.out)[0] + ".png", result)
    report(result)
    print(f"\nwrote {args.out} and its .png in {sum(clock.phases.values()) / 60:.1f} min")


if __name__ == "__main__":
    run_cli(main)
