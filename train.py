"""Train stage 1 (AR SFT) and stage 2 (MARS) on the instruction set.

    python train.py                       # both stages with the default preset, then a held-out summary
    python train.py --preset tiny         # seconds, for tests
    python train.py --stage mars --init_from out/ar.pt
    python train.py --stage control       # the control: stage 2 without its noisy stream
    python train.py --stage mars --init_from Qwen2.5-0.5B-Instruct/ --data my.jsonl   # a real model
    torchrun --standalone --nproc_per_node=2 train.py --preset tiny   # data parallel

Writes <out_dir>/ar.pt and mars.pt (control.pt with --stage control; self-contained: weights, model config,
tokenizer, training config, optimizer state for --resume), a JSON log and a loss plot per stage, summary.json.
"""
import json
import math
import os
import signal
import sys
import time
from dataclasses import asdict

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import data
import mars
import tokenizer
from cli import Parser, UserError, check_device, load_checkpoint, model_from_checkpoint, run_cli
from model import GPT, GPTConfig
from sample import decode_examples

# One source of truth for every number: flags override single entries. A real model's recipe: extras/hf_train.py.
TOY = dict(warmup=0.05, weight_decay=0.1, betas=[0.9, 0.95])
PRESETS = {
    "tiny": dict(n_layer=2, n_head=2, n_embd=64, max_seq_len=64, vocab_size=512, n_train=4000, summary_limit=40,
                 batch_size=16, ar_iters=60, mars_iters=60, lr=3e-3, mars_lr=3e-3, eval_every=30, save_every=30, **TOY),
    # cpu: bf16 autocast and 5,000 stage-1 steps, chosen on validation (docs/recipe_search_cpu.json)
    "cpu": dict(n_layer=4, n_head=4, n_embd=256, max_seq_len=64, vocab_size=2048, n_train=40000, summary_limit=None,
                batch_size=32, ar_iters=5000, mars_iters=2400, lr=2e-3, mars_lr=2e-3, eval_every=200, save_every=200,
                dtype="bfloat16", **TOY),
    "gpu": dict(n_layer=8, n_head=8, n_embd=512, max_seq_len=64, vocab_size=2048, n_train=200000, summary_limit=None,
                batch_size=128, ar_iters=6000, mars_iters=6000, lr=1e-3, mars_lr=1e-3, eval_every=500, save_every=500,
                **TOY),
}
MODEL_KEYS = ("n_layer", "n_head", "n_embd", "max_seq_len")
STEP_COST = {"ar": 1.0, "control": 1.0, "mars": 1.9}  # time of a step against stage 1's (docs/profile_cpu.json)
OVERRIDES = [("n_layer", int, "layers"), ("n_head", int, "attention heads"), ("n_embd", int, "model width"),
             ("max_seq_len", int, "context in tokens; longer examples are dropped"),
             ("vocab_size", int, "tokenizer vocabulary (at most)"), ("n_train", int, "built-in training examples"),
             ("batch_size", int, "global batch in sequences, whatever the number of processes"),
             ("micro_batch", int, "sequences per forward per process (default batch_size / processes)"),
             ("ar_iters", int, "steps of stage 1"), ("mars_iters", int, "steps of stage 2 and the control"),
             ("lr", float, "peak learning rate of stage 1 (linear warmup, then cosine to zero)"),
             ("mars_lr", float, "peak learning rate of stage 2 and the control"),
             ("warmup", float, "warmup, a fraction of the stage's steps"), ("weight_decay", float, "on matrices"),
             ("eval_every", int, "steps between validation losses"), ("save_every", int, "steps between checkpoints"),
             ("summary_limit", int, "validation and test prompts decoded at the end (default all)")]


def get_args(argv=None):
    p = Parser(__doc__)
    p.add_argument("--preset", choices=[*PRESETS, "hf"], help="tiny (seconds), cpu, gpu, or hf (the paper's recipe "
                   "for a real model, the default when --init_from is one or was trained from one)")
    p.add_argument("--stage", choices=["ar", "mars", "all", "control"], default="all", help="ar: stage 1 (AR SFT); "
                   "mars: stage 2; all: both, then the summary (default); control: stage 2 without its noisy stream")
    p.add_argument("--init_from", help="what stage 2 or the control starts from (default <out_dir>/ar.pt), or a "
                                       "Hugging Face model directory, where every stage starts")
    p.add_argument("--out_dir", default="out", help="where checkpoints, logs and plots go (default out)")
    p.add_argument("--data", help="your own instruction data: JSONL of {prompt, response} or {messages}")
    p.add_argument("--resume", action="store_true", help="continue an interrupted run from its --out_dir")
    p.add_argument("--device", help="cpu, cuda, cuda:1, ... (default cuda when available)")
    p.add_argument("--seed", type=int, default=0, help="seed for data, initialisation and batch order")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="autocast precision of training (default: the "
                   "preset's, else bfloat16 on CUDA); weights, optimizer and decoding stay float32")
    p.add_argument("--buckets", type=int, default=16, help="length buckets; a batch comes from one, so it has "
                                                           "little padding (default 16; 1: uniform batches)")
    p.add_argument("--grad_clip", type=float, default=1.0, help="clip the gradient norm to this (default 1.0)")
    g = p.add_argument_group("MARS (stage 2)")
    g.add_argument("--block_size", type=int, default=4, help="B, the MARS block: masks predicted together (default 4)")
    g.add_argument("--ar_weight", type=float, help="alpha, weight of the clean-stream (AR) loss (default 1.0; 0 is "
                                                   "not the paper's 'w/o SFT loss' ablation: that is --no_sft)")
    g.add_argument("--no_sft", action="store_true", help="the paper's 'w/o SFT loss' ablation: no clean-stream loss, "
                                                         "each sequence's noisy loss weighted 1/t, t ~ U[0.001, 1)")
    g.add_argument("--block_offset", choices=["fixed", "random"], default="fixed", help="fixed: the paper's blocks, "
                   "at multiples of B (default); random: shifted by a random offset every step (an ablation)")
    g = p.add_argument_group("preset overrides (default: the preset's value)")
    for name, kind, text in OVERRIDES:
        g.add_argument(f"--{name}", type=kind, help=text)
    return resolve(p, p.parse_args(argv))


def resolve(p, args):
    """Fills what the flags left open from the preset; refuses what cannot run."""
    stage2 = args.stage in ("mars", "control")  # they start from --init_from, by default <out_dir>/ar.pt
    args.from_hf = from_hf(args.init_from or (os.path.join(args.out_dir, "ar.pt") if stage2 else None))
    args.preset = args.preset or ("hf" if args.from_hf else "gpu" if torch.cuda.is_available() else "cpu")
    if args.preset == "hf" and not args.from_hf:
        p.error("--preset hf fine-tunes a real model: give --init_from DIR (a Hugging Face model directory)")
    if args.preset == "hf":
        from extras.hf_train import PRESET as preset  # the Hugging Face path only
    for k, v in (preset if args.preset == "hf" else PRESETS[args.preset]).items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    args.data = args.data and os.path.abspath(args.data)  # the checkpoint must find it from anywhere
    counts = ("block_size", "ar_iters", "mars_iters", "eval_every", "save_every", "batch_size", "buckets")
    if any(getattr(args, k) is not None and getattr(args, k) < 1 for k in counts):
        p.error(f"--{', --'.join(counts)} must be >= 1")
    if not args.from_hf and (args.n_embd % args.n_head or (args.n_embd // args.n_head) % 2):
        p.error("--n_embd must split into --n_head heads of an even width (rotary positions rotate pairs)")
    if (args.ar_weight or 0) < 0 or (args.no_sft and args.ar_weight is not None):
        p.error("--ar_weight must be >= 0, and --no_sft has no clean-stream loss to weight")
    args.ar_weight = 0.0 if args.no_sft else 1.0 if args.ar_weight is None else args.ar_weight
    check_device(args.device)
    return args


def from_hf(path):
    """Whether a run starts from a real model: a Hugging Face directory, or our checkpoint trained from one
    (it carries "hf"; read with mmap, so its tensors stay on disk)."""
    if path is None or os.path.isdir(path):
        return path is not None
    try:  # a missing or unreadable file is reported when the stage loads it
        return "hf" in torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception:
        return False


def stage2_flags(args):
    """What a MARS checkpoint records of its stage-2 flags (and --resume checks)."""
    return {"B": args.block_size, "ar_weight": args.ar_weight, "no_sft": args.no_sft, "block_offset": args.block_offset}


def lr_at(it, peak, warmup_frac, iters):
    warmup = max(1, int(warmup_frac * iters))
    if it < warmup:
        return peak * (it + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (it - warmup) / max(1, iters - warmup)))


class Stage:
    """One stage (every stage runs this loop; only the loss differs) and what it keeps: rows in
    length buckets, optimizer, batch order, log.
    hf: what the checkpoint records of the Hugging Face model the run started from (None for the toy)."""

    def __init__(self, name, model, tok, splits, args, dist_info, state=None, hf=None):
        self.name, self.model, self.tok, self.args, self.hf, self.t_created = name, model, tok, args, hf, time.time()
        (self.rank, self.world), self.path = dist_info, os.path.join(args.out_dir, f"{name}.pt")
        self.multiple = 1 if name == "ar" else args.block_size  # stage 2 and the control pad rows to B's multiples
        self.rows = data.tokenize(splits["train"], tok, args.max_seq_len, self.multiple)
        self.val_rows = data.tokenize(splits["val"], tok, args.max_seq_len, self.multiple)[:256]
        self.val_examples = splits["val"][:args.summary_limit]
        if not self.rows:
            raise UserError(f"no training example fits --max_seq_len {args.max_seq_len}")
        self.buckets = data.length_buckets(self.rows, args.buckets, self.multiple, min_rows=8 * args.batch_size)
        self.iters, self.peak_lr = (args.ar_iters, args.lr) if name == "ar" else (args.mars_iters, args.mars_lr)
        self.micro = args.micro_batch or args.batch_size // self.world
        if self.micro < 1 or args.batch_size % (self.micro * self.world):
            raise UserError(f"--batch_size {args.batch_size} is not a multiple of --micro_batch {self.micro} x "
                            f"{self.world} processes")
        self.accum = args.batch_size // (self.micro * self.world)
        groups = [{"params": [p for p in model.parameters() if p.dim() == d], "weight_decay": wd}  # decay matrices
                  for d, wd in ((2, args.weight_decay), (1, 0.0))]
        self.optimizer = torch.optim.AdamW(groups, self.peak_lr, tuple(args.betas), fused="cuda" in args.device)
        self.order = torch.Generator().manual_seed(args.seed + (name != "ar"))  # control and mars: the same batches
        self.start, self.history = (state["iter"], state["history"]) if state else (0, [])
        if state:  # --resume
            self.optimizer.load_state_dict(state["optimizer"])
            self.order.set_state(state["order_rng"])
        run = torch.compile(model) if args.compile else model
        self.run = DDP(run) if self.world > 1 else run
        self.amp = torch.autocast(torch.device(args.device).type, getattr(torch, args.dtype),
                                  enabled=args.dtype != "float32")

    def batch(self, rows):
        return (t.to(self.args.device) for t in data.make_batch(rows, self.tok.eot, self.multiple))

    def draws(self, rng, n):
        """A step's random draws for n sequences: the MARS block offset, and the --no_sft weights (1/t per
        sequence, drawn for the global batch so that each process takes its own)."""
        a = self.args
        offset = int(torch.randint(a.block_size, (1,), generator=rng)) if a.block_offset == "random" else 0
        return offset, mars.no_sft_weights(n, rng, a.device) if a.no_sft else None

    def loss(self, m, x, y, offset=0, weight=None):
        """The stage's loss and what to log. The control is MARS without its noisy stream: the clean term
        alone, with the same per-sequence mean, padding, batches and schedule."""
        if self.name != "mars":
            loss = mars.ar_loss(m, x, y, per_sequence=self.name == "control")
            return loss, {"loss": loss}
        loss, noisy, clean = mars.mars_loss(m, x, y, self.tok.mask, self.args.block_size, self.args.ar_weight,
                                            offset, weight)
        return loss, {"loss": loss, "noisy": noisy, "clean": clean}

    def step(self, it):
        """One optimizer step: every process draws the same global batch, then takes its own share.
        Returns the log record and the batch's tokens (padding aside)."""
        args, micro = self.args, self.micro
        lr = lr_at(it, self.peak_lr, args.warmup, self.iters)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        drawn = data.draw_batch(self.buckets, args.batch_size, self.order)
        step_rng = torch.Generator().manual_seed(int(torch.randint(2**62, (1,), generator=self.order)))
        offset, weights = self.draws(step_rng, args.batch_size)
        logged = {}
        for a in range(self.accum):
            mine = slice((self.rank * self.accum + a) * micro, (self.rank * self.accum + a + 1) * micro)
            if self.world > 1:
                self.run.require_backward_grad_sync = a == self.accum - 1
            with self.amp:
                loss, parts = self.loss(self.run, *self.batch([self.rows[i] for i in drawn[mine]]), offset,
                                        None if weights is None else weights[mine])
            (loss / self.accum).backward()
            for k, v in parts.items():
                logged[k] = logged.get(k, 0.0) + v.item() / self.accum
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), args.grad_clip)
        if not torch.isfinite(norm):  # identical on every process after the all-reduce
            raise UserError(f"non-finite loss or gradient at {self.name} step {it} (loss {logged['loss']:.4g}); "
                            f"stopped without updating; the last good checkpoint is {self.path}"
                            + ("" if os.path.exists(self.path) else " (none was written yet)"))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"iter": it + 1, "lr": lr, **logged}, sum(len(self.rows[i][0]) - 1 for i in drawn)

    @torch.no_grad()
    def val_losses(self):
        """The training loss on the validation rows, its random draws from a fixed seed (--no_sft: unweighted)."""
        self.model.eval()
        sums, rng = {}, torch.Generator().manual_seed(1234)
        for i in range(0, len(self.val_rows), self.micro):
            with self.amp:
                _, parts = self.loss(self.model, *self.batch(self.val_rows[i:i + self.micro]), self.draws(rng, 1)[0])
            for k, v in parts.items():
                sums[k] = sums.get(k, 0.0) + v.item()
        self.model.train()
        return {f"val_{k}": v / math.ceil(len(self.val_rows) / self.micro) for k, v in sums.items()}

    def save(self, it, done):
        """An atomic checkpoint (temp file + rename) of plain types, loadable with weights_only=True."""
        ckpt = {"model": self.model.state_dict(), "model_config": asdict(self.model.config), "done": done,
                "tokenizer": self.tok.state(), "train_config": vars(self.args), "stage": self.name, "iter": it,
                "optimizer": self.optimizer.state_dict(), "order_rng": self.order.get_state(), "history": self.history}
        if self.hf is not None:
            ckpt["hf"] = self.hf
        if self.name == "mars":
            ckpt["mars"] = stage2_flags(self.args)
        elif self.name == "control":
            ckpt["control"] = {"B": self.args.block_size}
        torch.save(ckpt, self.path + ".tmp")
        os.replace(self.path + ".tmp", self.path)

    def train(self, later=0.0):
        """Runs the stage to its end or to Ctrl-C (caught, so the loop stops at a step with a checkpoint).
        later: what the run does after this stage, in stage-1 steps, for the ETA of the whole run."""
        args, previous = self.args, self.history[-1]["elapsed_s"] if self.history else 0.0
        interrupt, handler = [], signal.signal(signal.SIGINT, lambda *_: interrupt.append(1))
        try:
            t0, t_last, tokens = time.time(), time.time(), 0
            for it in range(self.start, self.iters):
                record, n = self.step(it)
                tokens, last = tokens + n, it + 1 == self.iters
                record["elapsed_s"] = round(previous + time.time() - t0, 2)
                if (it + 1) % args.eval_every == 0 or last:
                    record.update(self.val_losses())
                self.history.append(record)
                if self.rank == 0 and ((it + 1) % max(10, self.iters // 50) == 0 or last or "val_loss" in record):
                    per_step = (time.time() - t0) / (it + 1 - self.start)
                    self.report(record, tokens / (time.time() - t_last), per_step, later)
                    t_last, tokens = time.time(), 0
                stop = torch.tensor(float(bool(interrupt)))
                if self.world > 1:  # every process stops at the same step
                    dist.all_reduce(stop)
                if self.rank == 0 and (stop.item() or last or (it + 1) % args.save_every == 0):
                    self.save(it + 1, last)
                if stop.item() and not last:
                    if self.rank == 0:
                        cmd = " ".join(["python"] + sys.argv + ([] if "--resume" in sys.argv else ["--resume"]))
                        print(f"\ninterrupted: {self.path} holds step {it + 1} of {self.iters}; resume with:\n  {cmd}")
                    raise SystemExit(130)
        finally:
            signal.signal(signal.SIGINT, handler)
        if self.rank == 0 and self.history:  # the last record: validation accuracy and the stage's wall time
            if self.val_examples:  # what a recipe is chosen on (the test split only reports); MARS at tau = 1.0
                r = score(self.model, self.tok, self.val_examples, B=args.block_size if self.name == "mars" else 1)
                print(f"validation accuracy {100 * r['accuracy']:.1f}% on {r['n']} prompts: "
                      + ", ".join(f"{k} {100 * v:.0f}" for k, v in r["per_task"].items()), flush=True)
                self.history[-1].update(val_accuracy=r["accuracy"], val_per_task=r["per_task"])
            self.history[-1]["stage_seconds"] = round(previous + time.time() - self.t_created, 2)
            write_log_and_plot(self.name, self.history, args.out_dir)

    def report(self, record, tokens_per_s, per_step, later):
        """One progress line: the time left in the stage, and in the whole run."""
        eta = per_step * (self.iters - record["iter"])
        run = eta + per_step / STEP_COST[self.name] * later
        parts = " ".join(f"{k} {v:.3f}" for k, v in record.items() if k not in ("iter", "lr", "elapsed_s"))
        print(f"{self.name} {record['iter']}/{self.iters} | {parts} | lr {record['lr']:.2e} | {tokens_per_s:,.0f} "
              f"tok/s | ETA stage {eta / 60:.1f} min, run {run / 60:.1f} min", flush=True)


def score(model, tok, examples, B=1, tau=1.0):
    """Greedy exact-answer accuracy, overall and per family, and tokens per forward (output tokens over
    the forwards each prompt's row took part in), decoding 64 prompts at a time."""
    model.eval()
    done = list(decode_examples(model, tok, examples, B=B, tau=tau))
    model.train()
    right = [int(ok) for _, _, ok in done]
    tokens, steps = sum(len(g.tokens) for _, g, _ in done), sum(g.steps for _, g, _ in done)
    tasks = sorted({e["task"] for e in examples})
    per_task = {f: [r for e, r in zip(examples, right) if e["task"] == f] for f in tasks}
    return {"n": len(right), "accuracy": sum(right) / len(right), "tokens_per_forward": tokens / max(steps, 1),
            "per_task": {f: round(sum(r) / len(r), 4) for f, r in per_task.items()}}


def summary(out_dir, test, device):
    """The closing check: held-out accuracy of stage 1 and of MARS at tau = 1.0 and 0.9 -> summary.json
    (the paper's tables in full, with intervals: python -m extras.eval)."""
    if not test:
        return print("no held-out test examples in this data: skipping the summary")
    print(f"\nheld-out test set ({len(test)} prompts)\n| model | accuracy | tokens/forward |\n|---|---|---|")
    rows = []
    for name, stage, tau in [("stage 1 (AR SFT)", "ar", None), ("MARS tau=1.0", "mars", 1.0), ("MARS tau=0.9", "mars", 0.9)]:
        ckpt = load_checkpoint(os.path.join(out_dir, f"{stage}.pt"), device)
        r = score(*model_from_checkpoint(ckpt, device), test, B=ckpt.get("mars", {}).get("B", 1), tau=tau or 1.0)
        rows.append({"model": name, "threshold": tau, **r})
        print(f"| {name} | {100 * r['accuracy']:.1f}% | {r['tokens_per_forward']:.2f} |")
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(rows, f, indent=1)


def write_log_and_plot(stage, history, out_dir):
    with open(os.path.join(out_dir, f"{stage}_log.json"), "w") as f:
        json.dump(history, f)
    from matplotlib.figure import Figure  # no pyplot: leaves the caller's backend alone
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    for key in [k for k in ("loss", "noisy", "clean", "val_loss") if k in history[-1]]:
        points = [(h["iter"], h[key]) for h in history if key in h]
        ax.plot(*zip(*points), "o-" if key == "val_loss" else "-", label=key, lw=0.8)
    ax.set(xlabel="step", ylabel="cross-entropy", yscale="log", title=f"stage {stage}")
    ax.legend()
    fig.savefig(os.path.join(out_dir, f"{stage}_loss.png"), dpi=100, bbox_inches="tight")


def plan_stages(args, say):
    """The stages to run, and the checkpoint of a stage interrupted earlier (--resume)."""
    stages = ["ar", "mars"] if args.stage == "all" else [args.stage]
    for stage in reversed(stages if args.resume else []):
        path = os.path.join(args.out_dir, f"{stage}.pt")
        if not os.path.exists(path):
            continue
        ckpt = load_checkpoint(path)
        if ckpt.get("done"):
            stages = stages[stages.index(stage) + 1:]
            say(f"resuming: stage {stage} is complete in {path}" + ("" if stages else "; nothing to do"))
            return stages, {}
        saved, now = ckpt.get("mars") or ckpt.get("control") or {}, stage2_flags(args)
        changed = [f"{k} {saved[k]} -> {now[k]}" for k in saved if saved[k] != now[k]]
        if changed:
            raise UserError(f"--resume with changed stage-2 flags ({', '.join(changed)}); rerun with the flags of "
                            f"{path}, or start a new --out_dir")
        say(f"resuming stage {stage} at step {ckpt['iter']} from {path}")
        return stages[stages.index(stage):], {stage: ckpt}
    if args.resume:
        say(f"resuming: no checkpoint in {args.out_dir}; starting from scratch")
    return stages, {}


def start_stage(stage, state, args, splits, say):
    """The model, tokenizer and splits a stage starts from, and its Hugging Face record (None for the toy)."""
    if args.from_hf:  # a real model: extras/hf_train.py, imported on this path only
        from extras.hf_train import start_stage as start_from_hf
        return start_from_hf(stage, state, args, splits, MODEL_KEYS)
    if stage == "ar" and state is None:  # the toy, from scratch
        splits = data.load_splits(args.data, args.seed, args.n_train)
        tok = tokenizer.Tokenizer.train((data.plain_text(e) for e in splits["train"]), args.vocab_size)
        model = GPT(GPTConfig(vocab_size=tok.n_vocab, **{k: getattr(args, k) for k in MODEL_KEYS})).to(args.device)
        say(f"instruction set: {', '.join(f'{k} {len(v)}' for k, v in splits.items())}; tokenizer: "
            f"{tok.n_vocab} tokens; model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
        return model, tok, splits, None
    source = state or load_checkpoint(args.init_from or os.path.join(args.out_dir, "ar.pt"))
    if state is None and source.get("stage") != "ar":
        raise UserError("--init_from must be a stage-1 (ar) checkpoint or a Hugging Face model directory")
    model, tok = model_from_checkpoint(source, args.device)
    for k in MODEL_KEYS:  # the architecture comes from the checkpoint
        setattr(args, k, source["model_config"][k])
    prev = source["train_config"]
    args.data = args.data or prev["data"]
    return model, tok, splits or data.load_splits(args.data, prev["seed"], prev["n_train"]), None


def cost_after(stage, stages, args, splits):
    """What the run does after this stage, in stage-1 steps: the later stages, the validation accuracies
    and the summary (decoding a prompt takes about as long as training on a row)."""
    rest = stages[stages.index(stage) + 1:]
    steps = sum(STEP_COST[s] * ((args.ar_iters if s == "ar" else args.mars_iters) or 0) for s in rest)
    prompts = (1 + len(rest)) * len(splits["val"][:args.summary_limit])
    prompts += 3 * len(splits["test"][:args.summary_limit]) if args.stage == "all" else 0
    return steps + prompts / args.batch_size


def main(argv=None):
    args, t0 = get_args(argv), time.time()
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    if world > 1:  # torchrun: one process per device
        dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo")
        if args.device.startswith("cuda"):
            args.device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
            torch.cuda.set_device(args.device)
    say = print if rank == 0 else lambda *_: None
    os.makedirs(args.out_dir, exist_ok=True)
    torch.manual_seed(args.seed)
    stages, resume_state = plan_stages(args, say)
    splits = None
    for stage in stages:
        state = resume_state.get(stage)
        model, tok, splits, hf = start_stage(stage, state, args, splits, say)
        Stage(stage, model, tok, splits, args, (rank, world), state, hf).train(cost_after(stage, stages, args, splits))
        if world > 1:  # the next stage reads the checkpoint rank 0 has just written
            dist.barrier()
    if rank == 0 and args.stage == "all" and stages:
        summary(args.out_dir, splits["test"][:args.summary_limit], args.device)
    if stages:
        say(f"done in {(time.time() - t0) / 60:.1f} min")
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    run_cli(main)
