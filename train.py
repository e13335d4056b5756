"""Train stage 1 (AR SFT) and stage 2 (MARS) on the toy instruction set, then score both.

    python train.py                  # both stages, then the held-out summary, in out/
    python train.py --preset tiny    # seconds
    python train.py --stage control  # stage 2 without its noisy stream
    torchrun --standalone --nproc_per_node=2 train.py --preset tiny

A real model: python -m extras.real.train, this loop with its own Stage.
"""
import json
import math
import os
import signal
import sys
import textwrap
import time
from dataclasses import asdict

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import common
import data
import mars
import sample
import stats
import tokenizer
from common import Config, Parser, UserError, add_device, add_table, check_device, listed
from common import autocast, load_checkpoint, model_from_checkpoint, precision_rule, run_cli
from model import GPT, GPTConfig

# presets: every number of a run, each also a flag

COMMON = dict(B=4, ar_weight=1.0, buckets=16, grad_clip=1.0, seed=0, data_seed=0, mix=None,
              precision="auto",
              micro_batch=None, tasks=None, warmup=0.05, weight_decay=0.1,
              betas=[0.9, 0.95], optimizer="adamw", schedule="cosine", decay=0.4,
              max_seq_len=64, vocab_size=2048, n_train=40000, batch_size=32,
              summary_limit=None)
PRESETS = {
    "tiny": dict(COMMON, n_layer=2, n_head=2, n_embd=64, vocab_size=512, n_train=4000,
                 summary_limit=40, batch_size=16, ar_iters=60, mars_iters=60, lr=3e-3,
                 mars_lr=3e-3, eval_every=30, save_every=30,
                 precision="float32"),  # the same losses on every machine
    # course and cpu: Muon and WSD, chosen on validation (docs/preset_search_cpu.json); cpu's
    # shares and stage 2's lr too (docs/family_search_cpu.json); course's stage-2 lr: docs/course_cpu.json
    "course": dict(COMMON, n_layer=4, n_head=4, n_embd=128,
                   tasks=["spell", "reverse", "copy", "words", "convert", "facts"],
                   ar_iters=1000, mars_iters=400, lr=3e-3, mars_lr=1.5e-3, optimizer="muon",
                   schedule="wsd", eval_every=200, save_every=200),
    "cpu": dict(COMMON, n_layer=4, n_head=4, n_embd=128, batch_size=64, ar_iters=1400,
                mars_iters=700, lr=6e-3, mars_lr=3e-3, optimizer="muon", schedule="wsd",
                mix=dict(add=2.4, count=5, multiples=1, words=1.5), eval_every=200, save_every=200),
    "gpu": dict(COMMON, n_layer=8, n_head=8, n_embd=512, n_train=200000,
                batch_size=128, ar_iters=6000, mars_iters=6000, lr=1e-3, mars_lr=1e-3,
                eval_every=500, save_every=500),
}
HELP = dict(B="the paper's block size", ar_weight="alpha: stage 2's clean-loss weight",
            buckets="length buckets of the batches", precision="auto: bf16 where native",
            micro_batch="rows a forward takes", tasks="e.g. spell,copy", warmup="fraction",
            optimizer="muon: Muon on hidden matrices", schedule="wsd: flat, then to 0",
            decay="fraction of the steps wsd decays over", lr="stage 1's peak",
            mars_lr="stage 2's peak", seed="the weights' and batches' draws",
            data_seed="the instruction set's draw (its held-out prompts too)",
            mix="training shares over data.MIX's, e.g. add:2,count:5 (held-out prompts stay)")
CHOICES = dict(precision=["auto", "float32", "bfloat16"], optimizer=["adamw", "muon"],
               schedule=["cosine", "wsd"])
MOVED = ("--no_sft", "--block_offset", "--targets", "--clean_padding", "--mask_row")
MODEL_KEYS = ("n_layer", "n_head", "n_embd", "max_seq_len")
EVAL_BATCH = 64  # prompts decoded at once when scoring
VAL_SEED, VAL_SEQS = 1234, 256  # the validation loss's draws and sequences


def shares(text):
    """--mix add:2,count:5 -> {"add": 2.0, "count": 5.0}"""
    pairs = [item.split(":") for item in text.split(",")]
    if any(len(p) != 2 for p in pairs):
        raise ValueError(text)
    return {task: float(share) for task, share in pairs}


TYPES = dict(micro_batch=int, summary_limit=int, tasks=listed(str), mix=shares)  # None in some rows

# data and model


def start_stage(name, state, cfg, splits, say):
    """(model, tok, splits, what the source fixes of cfg): stage 1 from scratch, or from a
    checkpoint: the stage's own (--resume) or stage 1's (--init_from)."""
    if name == "ar" and state is None:
        splits = data.load_splits(cfg.data, cfg.data_seed, cfg.n_train, cfg.tasks, mix=cfg.mix)
        tok = tokenizer.Tokenizer.train(map(data.plain_text, splits["train"]), cfg.vocab_size)
        shape = {k: getattr(cfg, k) for k in MODEL_KEYS}
        model = GPT(GPTConfig(vocab_size=tok.n_vocab, **shape)).to(cfg.device)
        n = sum(p.numel() for p in model.parameters())
        say(f"instruction set: {', '.join(f'{k} {len(v)}' for k, v in splits.items())}; "
            f"tokenizer: {tok.n_vocab} tokens; model: {n / 1e6:.2f}M parameters")
        return model, tok, splits, {}
    source = state or load_checkpoint(cfg.init_from or os.path.join(cfg.out_dir, "ar.pt"))
    if state is None and source.get("stage") != "ar":
        raise UserError("--init_from must be a stage-1 (ar) checkpoint")
    model, tok = model_from_checkpoint(source, cfg.device)
    prev = source["train_config"]
    fixed = {k: source["model_config"][k] for k in MODEL_KEYS}
    fixed.update(data=cfg.data or prev["data"], tasks=prev.get("tasks"), mix=prev.get("mix"),
                 data_seed=prev.get("data_seed", prev["seed"]))  # older checkpoints: one seed
    return model, tok, splits or data.splits_of({**prev, **fixed}), fixed


# optimizer

def lr_at(it, peak, warmup_frac, iters, schedule="cosine", decay=0.4):
    warmup = max(1, int(warmup_frac * iters))
    if it < warmup:
        return peak * (it + 1) / warmup
    if schedule == "wsd":  # stable, then linear to 0 over the last `decay` of the steps
        start = int((1 - decay) * iters)
        return peak if it < start else peak * (iters - it) / max(1, iters - start)
    return peak * 0.5 * (1 + math.cos(math.pi * (it - warmup) / max(1, iters - warmup)))


def optimizers(model, cfg, lr):
    """AdamW (fused: faster on a CPU too) decaying matrices only; with muon, Muon takes the
    2-D weights but the embedding, which the head shares."""
    named, muon = list(model.named_parameters()), cfg.optimizer == "muon"
    hidden = [p for n, p in named if muon and p.dim() == 2 and not n.startswith("wte")]
    rest = [p for _, p in named if all(p is not h for h in hidden)]
    groups = [{"params": [p for p in rest if p.dim() == d], "weight_decay": wd}
              for d, wd in ((2, cfg.weight_decay), (1, 0.0))]
    adamw = torch.optim.AdamW(groups, lr, tuple(cfg.betas), fused=True)
    return [Muon(hidden, lr, cfg.weight_decay), adamw] if hidden else [adamw]


class Muon(torch.optim.Optimizer):
    """Nesterov momentum, the update orthogonalised, scaled to about AdamW's size. float32:
    torch.optim.Muon's bf16 is many times slower on CPUs without native bf16."""

    def __init__(self, params, lr, weight_decay=0.0, momentum=0.95):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum))

    def step(self):
        with torch.no_grad():  # the update is no part of any graph
            for group in self.param_groups:
                lr, beta, by_shape = group["lr"], group["momentum"], {}
                for p in group["params"]:
                    buf = self.state[p].setdefault("momentum", torch.zeros_like(p))
                    buf.lerp_(p.grad, 1 - beta)
                    by_shape.setdefault(p.shape, []).append((p, p.grad.lerp(buf, beta)))
                for shape, pairs in by_shape.items():  # one batched product per shape
                    updates = orthogonalise(torch.stack([u for _, u in pairs]))
                    for (p, _), u in zip(pairs, updates):
                        p.mul_(1 - lr * group["weight_decay"])
                        p.add_(u, alpha=-lr * 0.2 * max(shape) ** 0.5)


def orthogonalise(G, steps=5):
    """About U V^T of each G[i] = U S V^T: Newton-Schulz iterations (Jordan's quintic)."""
    X = G.mT if G.shape[1] > G.shape[2] else G
    X = X / (X.norm(dim=(1, 2), keepdim=True) + 1e-7)
    for _ in range(steps):
        A = X @ X.mT
        X = 3.4445 * X + (-4.7750 * A + 2.0315 * A @ A) @ X
    return X.mT if G.shape[1] > G.shape[2] else X


# a stage: its batches, loss and checkpoint

class Stage:
    """A tool's subclass may override loss, next_batch or micro_batches (drawing from
    self.rng), checkpoint, and settings: the flags --resume holds a run to."""

    def __init__(self, name, model, tok, splits, cfg, rank=0, world=1, state=None):
        self.name, self.raw_model, self.tok, self.cfg = name, model, tok, cfg
        self.rank, self.world, self.t0 = rank, world, time.time()
        self.path = os.path.join(cfg.out_dir, f"{name}.pt")
        self.multiple = 1 if name == "ar" else cfg.B  # stage 2 pads to multiples of B
        self.seqs = data.tokenize(splits["train"], tok, cfg.max_seq_len, self.multiple)
        if not self.seqs:
            raise UserError(f"no training example fits --max_seq_len {cfg.max_seq_len}")
        val = data.tokenize(splits["val"], tok, cfg.max_seq_len, self.multiple)
        self.val_seqs, self.val_examples = val[:VAL_SEQS], splits["val"][:cfg.summary_limit]
        ar, self.batch_size = name == "ar", cfg.batch_size
        self.iters, self.peak_lr = (cfg.ar_iters, cfg.lr) if ar else (cfg.mars_iters, cfg.mars_lr)
        self.buckets = data.length_buckets(self.seqs, cfg.buckets, self.multiple,
                                           min_seqs=8 * self.batch_size)
        self.micro = cfg.micro_batch or max(1, self.batch_size // world)
        self.accum, rest = divmod(self.batch_size, self.micro * world)
        if rest or not self.accum:
            raise UserError(f"--batch_size {self.batch_size} is not a multiple of "
                            f"--micro_batch {self.micro} x {world} processes")
        self.optimizers = optimizers(model, cfg, self.peak_lr)
        self.order = torch.Generator().manual_seed(cfg.seed + (not ar))  # mars = control
        self.first_step, self.history = 0, []
        if state:  # --resume
            saved = state.get(name, {})
            changed = [f"{k} {saved[k]} -> {v}" for k, v in self.settings().items()
                       if saved.get(k, v) != v]
            if changed:
                raise UserError(f"--resume with changed stage-2 flags ({', '.join(changed)})"
                                f"; rerun with those of {self.path}, or a new --out_dir")
            opts = state["optimizer"]  # older checkpoints hold AdamW's alone
            for opt, s in zip(self.optimizers, opts if isinstance(opts, list) else [opts]):
                opt.load_state_dict(s)
            self.order.set_state(state["order_rng"])
            self.first_step, self.history = state["iter"], state["history"]
        compiled = torch.compile(model) if cfg.compile else model
        self.model = DDP(compiled) if world > 1 else compiled

    def amp(self):
        return autocast(self.cfg.device, self.cfg.precision, self.cfg.max_seq_len)

    def next_batch(self):
        # every process draws the global batch, and a seed for a subclass's draws
        seqs = [self.seqs[i] for i in data.draw_batch(self.buckets, self.batch_size, self.order)]
        seed = int(torch.randint(2**62, (1,), generator=self.order))
        self.rng = torch.Generator().manual_seed(seed)
        return seqs

    def share(self, a):
        first = (self.rank * self.accum + a) * self.micro  # this process's micro-batch a
        return slice(first, first + self.micro)

    def micro_batches(self, seqs):
        for a in range(self.accum):
            if self.world > 1:  # DDP averages the gradients after the last one only
                self.model.require_backward_grad_sync = a == self.accum - 1
            yield self.batch(seqs[self.share(a)])

    def batch(self, seqs):
        x, y = data.make_batch(seqs, self.tok.eot, self.multiple)
        return x.to(self.cfg.device), y.to(self.cfg.device)

    def loss(self, model, x, y):
        """(loss, what to log). The control is MARS without its noisy stream: the clean term
        alone, with the same per-sequence mean, padding, batches and schedule."""
        if self.name != "mars":
            loss = mars.ar_loss(model, x, y, per_sequence=self.name == "control")
            return loss, {"loss": loss}
        B, ar_weight = self.cfg.B, self.cfg.ar_weight
        loss, noisy, clean = mars.mars_loss(model, x, y, self.tok.mask, B, ar_weight)
        return loss, {"loss": loss, "noisy": noisy, "clean": clean}

    @torch.no_grad()
    def val_losses(self):
        if not self.val_seqs:  # a data file's val split may be empty
            return {}
        self.raw_model.eval()
        self.rng, logs = torch.Generator().manual_seed(VAL_SEED), []
        for i in range(0, len(self.val_seqs), self.micro):
            x, y = self.batch(self.val_seqs[i:i + self.micro])
            with self.amp():
                logs.append(self.loss(self.raw_model, x, y)[1])
        self.raw_model.train()
        return {f"val_{k}": sum(r[k].item() for r in logs) / len(logs) for k in logs[0]}

    def settings(self):
        B = {"B": self.cfg.B}
        return {"ar": {}, "control": B}.get(self.name, {**B, "ar_weight": self.cfg.ar_weight})

    def checkpoint(self, step, done):
        m = self.raw_model
        ckpt = {"model": m.state_dict(), "model_config": asdict(m.config),
                "tokenizer": self.tok.state(), "train_config": dict(vars(self.cfg)),
                "stage": self.name, "iter": step, "done": done, "history": self.history,
                "optimizer": [o.state_dict() for o in self.optimizers],
                "order_rng": self.order.get_state()}
        return ckpt if self.name == "ar" else {**ckpt, self.name: self.settings()}

    def save(self, step, done):
        common.save(self.checkpoint(step, done), self.path)  # atomic


# the loop of every stage

def train(stage, later=0.0):
    """Ctrl-C stops it after a step, with a checkpoint. later: the steps of the run's later
    stages, for its ETA (at this stage's pace)."""
    cfg, pressed, tokens = stage.cfg, [], 0
    say = print if stage.rank == 0 else lambda *_, **__: None
    before = stage.history[-1]["elapsed_s"] if stage.history else 0.0  # --resume's
    t0 = t_line = time.time()
    handler = signal.signal(signal.SIGINT, lambda *_: pressed.append(1))
    try:
        for it in range(stage.first_step, stage.iters):
            lr = lr_at(it, stage.peak_lr, cfg.warmup, stage.iters, cfg.schedule, cfg.decay)
            for group in (g for opt in stage.optimizers for g in opt.param_groups):
                group["lr"] = lr
            seqs, logged = stage.next_batch(), {}
            for x, y in stage.micro_batches(seqs):  # the gradients add up
                with stage.amp():
                    loss, parts = stage.loss(stage.model, x, y)
                (loss / stage.accum).backward()
                for k, v in parts.items():
                    logged[k] = logged.get(k, 0.0) + v.item() / stage.accum
            norm = torch.nn.utils.clip_grad_norm_(stage.raw_model.parameters(), cfg.grad_clip)
            if not torch.isfinite(norm):  # alike on every process: gradients are averaged
                raise UserError(f"non-finite loss or gradient at {stage.name} step {it}; "
                                f"the last checkpoint, if any: {stage.path}")
            for opt in stage.optimizers:
                opt.step()
                opt.zero_grad(set_to_none=True)
            step, now = it + 1, time.time()
            last = step == stage.iters
            record = {"iter": step, "lr": lr, **logged, "elapsed_s": round(before + now - t0, 2)}
            if step % cfg.eval_every == 0 or last:
                record.update(stage.val_losses())
            stage.history.append(record)

            # progress: every 2% of the stage (10 steps at least), at validations, and 30 s
            # after the last line
            tokens += sum(len(ids) - 1 for ids, _ in seqs)
            due = step % max(10, stage.iters // 50) == 0 or last or "val_loss" in record
            if due or now - t_line >= 30:
                minutes = (now - t0) / (step - stage.first_step) / 60  # a step's
                eta = minutes * (stage.iters - step)
                eta_run = eta + minutes * later
                losses = " ".join(f"{k} {v:.3f}" for k, v in record.items()
                                  if k not in ("iter", "lr", "elapsed_s"))
                say(f"{stage.name} {step}/{stage.iters} | {losses} | lr {lr:.2e} | "
                    f"{tokens / (now - t_line):,.0f} tok/s | "
                    f"ETA stage {eta:.1f} min, run {eta_run:.1f} min", flush=True)
                t_line, tokens = now, 0

            stop = torch.tensor(float(bool(pressed)), device=cfg.device)  # NCCL: on device
            if stage.world > 1:  # every process stops at the same step
                dist.all_reduce(stop)
            if stage.rank == 0 and (stop or last or step % cfg.save_every == 0):
                stage.save(step, last)
            if stop and not last:
                again = [] if "--resume" in sys.argv else ["--resume"]
                say(f"\ninterrupted at step {step} of {stage.iters}; resume with:\n"
                    f"  python {' '.join(sys.argv + again)}")
                raise SystemExit(130)
    finally:
        signal.signal(signal.SIGINT, handler)
    if stage.rank == 0:
        finish(stage, before)


# evaluation

def finish(stage, before):
    """Validation accuracy, time and precision on the last record; the log; a loss plot."""
    cfg, record = stage.cfg, stage.history[-1]
    if stage.val_examples:
        B = cfg.B if stage.name == "mars" else 1
        r = evaluate(stage.raw_model, stage.tok, stage.val_examples, B=B)
        print(f"validation accuracy {100 * r['accuracy']:.1f}% on {r['n']} prompts: "
              + ", ".join(f"{k} {100 * v:.0f}" for k, v in r["per_task"].items()), flush=True)
        record.update(val_accuracy=r["accuracy"], val_per_task=r["per_task"])
    record.update(stage_seconds=round(before + time.time() - stage.t0, 2),
                  precision=cfg.precision_why)
    path = os.path.join(cfg.out_dir, stage.name)
    with open(f"{path}_log.json", "w") as f:
        json.dump(stage.history, f)
    from matplotlib.figure import Figure  # not pyplot: leaves the caller's backend alone
    ax = Figure(figsize=(6, 4)).subplots()
    for key in [k for k in ("loss", "noisy", "clean", "val_loss") if k in record]:
        ax.plot(*zip(*[(h["iter"], h[key]) for h in stage.history if key in h]), label=key)
    ax.set(xlabel="step", ylabel="cross-entropy", yscale="log", title=f"stage {stage.name}")
    ax.legend()
    ax.figure.savefig(f"{path}_loss.png", dpi=100, bbox_inches="tight")


def evaluate(model, tok, examples, B=1, tau=1.0, check=data.check):
    """Exact-answer accuracy with its 95% interval, overall and per family, tokens per
    forward, and each prompt right (1) or not (0)."""
    model.eval()
    done = []
    for i in range(0, len(examples), EVAL_BATCH):
        prompts = [tok.prompt_ids(e["prompt"]) for e in examples[i:i + EVAL_BATCH]]
        done += sample.generate(model, prompts, tok.eot, tok.mask, B, tau, n_vocab=tok.n_vocab)
    model.train()
    right = [int(check(e, tok.answer(out))) for e, (out, _) in zip(examples, done)]
    tokens, forwards = sum(len(out) for out, _ in done), sum(len(c) for _, c in done)
    per_task = {}
    for e, r in zip(examples, right):
        per_task.setdefault(e["task"], []).append(r)
    return {"n": len(right), "accuracy": sum(right) / len(right),
            "ci95": stats.wilson(sum(right), len(right)),
            "tokens_per_forward": tokens / max(forwards, 1),
            "per_task": {f: round(sum(r) / len(r), 4) for f, r in sorted(per_task.items())},
            "right": right}


def summary(out_dir, test, device, load=model_from_checkpoint):
    """Stage 1 and MARS at tau 1.0, 0.95 and 0.9 on the same test prompts, each with its 95%
    interval, and tau 1.0 against stage 1 prompt by prompt -> summary.json."""
    t0 = time.time()
    print(f"\nheld-out test set ({len(test)} prompts, 95% intervals)\n"
          "| model | accuracy | tokens/forward |\n|---|---|---|")
    table = []
    for label, name, tau in [("stage 1 (AR SFT)", "ar", None), ("MARS tau=1.0", "mars", 1.0),
                             ("MARS tau=0.95", "mars", 0.95), ("MARS tau=0.9", "mars", 0.9)]:
        ckpt = load_checkpoint(os.path.join(out_dir, f"{name}.pt"), device)
        B = ckpt.get("mars", {}).get("B", 1)
        r = evaluate(*load(ckpt, device), test, B=B, tau=tau or 1.0)
        table.append({"model": label, "threshold": tau, **r})
        lo, hi = r["ci95"]
        print(f"| {label} | {100 * r['accuracy']:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}] | "
              f"{r['tokens_per_forward']:.2f} |")
    # the same prompts right or wrong each: a paired interval is far narrower than two apart
    pair = stats.paired(table[1]["right"], table[0]["right"])
    for row in table:
        row.pop("right")
    lo, hi = pair["ci"]
    print(f"MARS tau=1.0 minus stage 1: {100 * pair['diff']:+.1f} points [{100 * lo:+.1f}, "
          f"{100 * hi:+.1f}] (right only with MARS {pair['a_only']}, only with stage 1 "
          f"{pair['b_only']}; McNemar p = {pair['p_value']:.2f})")
    result = {"table": table, "mars_tau1_minus_ar": pair, "seconds": round(time.time() - t0, 1)}
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(result, f, indent=1)


# command line and main

def get_config(argv=None, presets=PRESETS, extra=None):
    """The run's settings, resolved here only: a preset, the flags over it, the precision.
    A tool passes its own presets, and extra(parser) adds its own flags."""
    p = Parser(__doc__)
    p.add_argument("--preset", help=f"{', '.join(presets)} (default cpu, or gpu on CUDA)")
    p.add_argument("--stage", choices=["all", "ar", "mars", "control"], default="all")
    p.add_argument("--init_from", help="stage 1's .pt for stage 2 (default <out_dir>/ar.pt)")
    p.add_argument("--out_dir", default="out")
    p.add_argument("--data", help="your own JSONL of {prompt, response}")
    p.add_argument("--resume", action="store_true", help="continue the run in --out_dir")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    add_device(p)
    g = p.add_argument_group("the presets' numbers (a flag beats the preset)")
    add_table(g, presets, HELP, TYPES, CHOICES)
    if extra:
        extra(p)
    args, unknown = p.parse_known_args(argv)
    flag = unknown[0].split("=")[0] if unknown else ""
    if flag in MOVED:
        p.exit(2, f"error: {flag} is beyond the paper: python -m extras.real.train {flag} ...\n")
    if unknown:
        p.error(f"unrecognized arguments: {' '.join(unknown)}")
    default = "gpu" if args.device.startswith("cuda") else "cpu"
    preset = args.preset or (default if default in presets else next(iter(presets)))
    if preset not in presets:
        p.error(f"--preset {preset}: choose from {', '.join(presets)} "
                "(a real model: python -m extras.real.train)")
    given = {k: v for k, v in vars(args).items() if v is not None}
    c = {**vars(args), **presets[preset], **given, "preset": preset}
    c["data"] = args.data and os.path.abspath(args.data)  # a checkpoint finds it anywhere
    check_device(c["device"])

    counts = [k for k in presets[preset] if type(c[k]) is int and c[k] < 1
              and k not in ("seed", "data_seed", "summary_limit")]  # these may be 0
    if counts:
        p.error(f"--{counts[0]} must be >= 1, got {c[counts[0]]}")
    width, heads = c["n_embd"], c["n_head"]
    if width % heads or width // heads % 2:  # rotary embeddings pair a head's dimensions
        p.error(f"--n_embd {width} does not split into --n_head {heads} heads of even width")
    for flag in ("tasks", "mix"):
        unknown = sorted(set(c[flag] or []) - set(data.TASKS))
        if unknown:
            p.error(f"--{flag}: unknown families {unknown}; they are {','.join(data.TASKS)}")
    if any(share <= 0 for share in (c["mix"] or {}).values()):
        p.error(f"--mix: every share must be > 0, got {c['mix']}")
    if c["ar_weight"] < 0 or not 0 < c["decay"] <= 1 or not 0 <= c["warmup"] < 1:
        p.error("--ar_weight must be >= 0, --decay in (0, 1] and --warmup in [0, 1)")

    dtype, why = c["precision"], f"--precision {args.precision}"
    if dtype == "auto":
        dtype, why = precision_rule(c["device"])
    elif not args.precision:
        why = f"the {preset} preset's"
    c.update(precision=dtype, precision_why={"dtype": dtype, "reason": why})
    return Config(**c)


def run(cfg, make_stage=Stage, start=start_stage, load=model_from_checkpoint):
    """Each stage from start's (model, tok, splits, what its source fixes), then the summary.
    A tool passes its own Stage subclass, start and load (summary's)."""
    t0 = time.time()
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    if world > 1:  # torchrun: a process per device
        cuda = cfg.device.startswith("cuda")
        if cuda:
            cfg = cfg.replace(device=f"cuda:{os.environ['LOCAL_RANK']}")
            torch.cuda.set_device(cfg.device)
        dist.init_process_group("nccl" if cuda else "gloo")
    say = print if rank == 0 else lambda *_: None
    os.makedirs(cfg.out_dir, exist_ok=True)
    torch.manual_seed(cfg.seed)
    names = ["ar", "mars"] if cfg.stage == "all" else [cfg.stage]
    splits, ran = None, []
    for i, name in enumerate(names):
        path, state = os.path.join(cfg.out_dir, f"{name}.pt"), None
        if cfg.resume and os.path.exists(path):
            state = load_checkpoint(path)
            if state.get("done"):
                say(f"resuming: stage {name} is complete in {path}")
                continue
            say(f"resuming stage {name} at step {state['iter']} from {path}")
        model, tok, splits, fixed = start(name, state, cfg, splits, say)
        if not ran:  # the first stage's source completes the config
            cfg = cfg.replace(**fixed)
            say(textwrap.fill(f"config: {cfg}", 88, subsequent_indent="  "))
            say(f"precision: {cfg.precision}: {cfg.precision_why['reason']}")
        stage = make_stage(name, model, tok, splits, cfg, rank, world, state)
        later = sum(cfg.ar_iters if n == "ar" else cfg.mars_iters for n in names[i + 1:])
        try:
            train(stage, later)
        except torch.OutOfMemoryError:  # one line naming the knob, not a traceback
            raise UserError(f"out of memory on {cfg.device} in stage {name}, with micro-"
                            f"batches of {stage.micro} rows of up to {cfg.max_seq_len} "
                            f"tokens: lower --micro_batch (the batch of {stage.batch_size} "
                            "rows stays)") from None
        ran.append(name)
        if world > 1:  # the next stage reads the checkpoint rank 0 has just written
            dist.barrier()
    test = splits and splits["test"][:cfg.summary_limit]
    if rank == 0 and cfg.stage == "all" and ran and test:
        summary(cfg.out_dir, test, cfg.device, load)
    say(f"done in {(time.time() - t0) / 60:.1f} min")
    if world > 1:
        dist.destroy_process_group()


def main(argv=None):
    cfg = get_config(argv)
    path = cfg.init_from  # ours are .pt files; a real model is a directory or a name
    if path and (os.path.isdir(path) or not path.endswith(".pt")):
        raise UserError(f"a real model trains with python -m extras.real.train "
                        f"--init_from {path} --data my.jsonl")
    run(cfg)


if __name__ == "__main__":
    run_cli(main)
