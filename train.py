"""Train stage 1 (AR SFT) and stage 2 (MARS) on the instruction set. Each stage runs one loop,
`train`; only its loss differs (Stage.loss: the paper's, or the options beyond it through one
hook).

    python train.py                  # both stages with the default preset, then a held-out summary
    python train.py --preset tiny    # seconds, for tests
    python train.py --stage mars --init_from out/ar.pt
    python train.py --stage control  # the control: stage 2 without its noisy stream
    python train.py --stage mars --init_from Qwen2.5-0.5B-Instruct/ --data my.jsonl  # a real model
    torchrun --standalone --nproc_per_node=2 train.py --preset tiny  # data parallel

Writes <out_dir>/ar.pt and mars.pt (control.pt with --stage control; self-contained: weights, model
config, tokenizer, training config, optimizer state for --resume), a JSON log and a loss plot per
stage, summary.json.
"""
import contextlib
import functools
import json
import math
import os
import signal
import sys
import textwrap
import time
from dataclasses import asdict
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.parallel import DistributedDataParallel as DDP

import common
import data
import mars
import sample
import tokenizer
from common import Parser, UserError, add_device, check_device, run_cli
from common import load_checkpoint, model_from_checkpoint
from model import GPT, GPTConfig

# ---------------------------------------------------------------------------
# The toy presets: one source of truth for every number. Every preset takes COMMON, and a flag
# overrides one entry. precision: of the autocast a training forward runs in; "auto" measures
# which is faster (derive). The real-model preset, hf (the paper's recipe), is HF_PRESET in
# extras/checkpoints/hf_train.py.
COMMON = dict(B=4, buckets=16, grad_clip=1.0, seed=0, precision="auto", micro_batch=None,
              epochs=None, tasks=None)
TOY = dict(COMMON, warmup=0.05, weight_decay=0.1, betas=[0.9, 0.95])
PRESETS = {
    "tiny": dict(TOY, n_layer=2, n_head=2, n_embd=64, max_seq_len=64, vocab_size=512, n_train=4000,
                 summary_limit=40, batch_size=16, ar_iters=60, mars_iters=60, lr=3e-3,
                 mars_lr=3e-3, eval_every=30, save_every=30,
                 precision="float32"),  # float32: the same losses on every machine
    # cpu: 5,000 stage-1 steps, chosen on validation (docs/recipe_search_cpu.json)
    "cpu": dict(TOY, n_layer=4, n_head=4, n_embd=256, max_seq_len=64, vocab_size=2048,
                n_train=40000, summary_limit=None, batch_size=32, ar_iters=5000, mars_iters=2400,
                lr=2e-3, mars_lr=2e-3, eval_every=200, save_every=200),
    # course: MARS seen working in a few minutes on a laptop CPU (docs/course.md): the six
    # templated families, a narrower model, fewer steps; chosen on validation prompts
    # (docs/course_search_cpu.json). The default run teaches the quality, this the mechanism.
    "course": dict(TOY, n_layer=4, n_head=4, n_embd=128, max_seq_len=64, vocab_size=2048,
                   n_train=40000, tasks=["spell", "reverse", "copy", "words", "convert", "facts"],
                   summary_limit=300, batch_size=32, ar_iters=2000, mars_iters=1000, lr=3e-3,
                   mars_lr=3e-3, eval_every=500, save_every=500),
    "gpu": dict(TOY, n_layer=8, n_head=8, n_embd=512, max_seq_len=64, vocab_size=2048,
                n_train=200000, summary_limit=None, batch_size=128, ar_iters=6000, mars_iters=6000,
                lr=1e-3, mars_lr=1e-3, eval_every=500, save_every=500),
}
MODEL_KEYS = ("n_layer", "n_head", "n_embd", "max_seq_len")
STEP_TIME = {"ar": 1.0, "control": 1.0, "mars": 1.9}  # a step's time (docs/profile_cpu.json)
EVAL_BATCH = 64  # prompts decoded at once when scoring: one forward serves them all
VAL_SEED = 1234  # the validation loss's random draws: the same at every evaluation
VAL_SEQS = 256  # validation sequences the validation loss averages over


def lr_at(it, peak, warmup_frac, iters):
    warmup = max(1, int(warmup_frac * iters))
    if it < warmup:
        return peak * (it + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (it - warmup) / max(1, iters - warmup)))


# ---------------------------------------------------------------------------
# A stage: its data, optimizer, batches and loss

class Stage:
    """What one stage keeps: its training sequences in length buckets, the optimizer, the batch
    order, the log. state: the checkpoint of this stage interrupted earlier (--resume); hf: what
    the checkpoint records of the Hugging Face model the run started from (None for the toy)."""

    def __init__(self, name, model, tok, splits, cfg, dist_info, state=None, hf=None):
        self.name, self.raw_model, self.tok, self.cfg, self.hf = name, model, tok, cfg, hf
        self.t_created = time.time()
        (self.rank, self.world), self.path = dist_info, os.path.join(cfg.out_dir, f"{name}.pt")
        self.multiple = 1 if name == "ar" else cfg.B  # stage 2, the control: B's multiples
        self.seqs = data.tokenize(splits["train"], tok, cfg.max_seq_len, self.multiple)
        self.val_seqs = data.tokenize(splits["val"], tok, cfg.max_seq_len, self.multiple)
        self.val_seqs = self.val_seqs[:VAL_SEQS]
        self.val_examples = splits["val"][:cfg.summary_limit]
        if not self.seqs:
            raise UserError(f"no training example fits --max_seq_len {cfg.max_seq_len}")
        self.batch_size, self.iters, self.peak_lr = schedule_of(cfg, name)
        self.buckets = data.length_buckets(self.seqs, cfg.buckets, self.multiple,
                                           min_seqs=8 * self.batch_size)
        self.micro = cfg.micro_batch or self.batch_size // self.world
        if self.micro < 1 or self.batch_size % (self.micro * self.world):
            raise UserError(f"--batch_size {self.batch_size} is not a multiple of --micro_batch "
                            f"{self.micro} x {self.world} processes")
        self.accum = self.batch_size // (self.micro * self.world)
        groups = [{"params": [p for p in model.parameters() if p.dim() == d], "weight_decay": wd}
                  for d, wd in ((2, cfg.weight_decay), (1, 0.0))]  # decay matrices only
        # fused: 7-15% faster a step on the CPU too (docs/train_cpu.json: fused_optimizer_ab)
        self.optimizer = torch.optim.AdamW(groups, self.peak_lr, tuple(cfg.betas), fused=True)
        self.order = torch.Generator().manual_seed(cfg.seed + (name != "ar"))  # mars = control
        self.first_step, self.history = (state["iter"], state["history"]) if state else (0, [])
        self.seconds_before = self.history[-1]["elapsed_s"] if self.history else 0.0
        if state:
            self.optimizer.load_state_dict(state["optimizer"])
            self.order.set_state(state["order_rng"])
        self.beyond = beyond_the_paper(name, cfg, model, tok, state)  # None: the paper's loss
        compiled = torch.compile(model) if cfg.compile else model
        self.model = DDP(compiled) if self.world > 1 else compiled  # raw_model: the plain GPT
        self.amp = functools.partial(autocast, cfg.device, cfg.precision, cfg.max_seq_len)

    def next_batch(self):
        """A step's global batch (every process draws the same, then takes its share) and the
        random draws of the options beyond the paper, from a generator the batch order seeds (a
        resumed run draws them again)."""
        seqs = [self.seqs[i] for i in data.draw_batch(self.buckets, self.batch_size, self.order)]
        seed = int(torch.randint(2**62, (1,), generator=self.order))
        step_rng = torch.Generator().manual_seed(seed)
        return seqs, self.beyond and self.beyond.draws(step_rng, len(seqs))

    def my_micro_batches(self, seqs):
        """This process's share of the global batch: micro-batches (x, y, their rows of the batch)
        on the device. Under DDP, the gradients are averaged across processes after the last one
        only."""
        for a in range(self.accum):
            if self.world > 1:
                self.model.require_backward_grad_sync = a == self.accum - 1
            first = (self.rank * self.accum + a) * self.micro
            x, y = self.batch(seqs[first:first + self.micro])
            yield x, y, slice(first, first + self.micro)

    def batch(self, seqs):
        return (t.to(self.cfg.device) for t in data.make_batch(seqs, self.tok.eot, self.multiple))

    def loss(self, model, x, y, draws=None, rows=None):
        """The stage's loss and what to log. The control is MARS without its noisy stream: the
        clean term alone, with the same per-sequence mean, padding, batches and schedule."""
        if self.beyond is not None:  # the options beyond the paper, or a real model
            return self.beyond.loss(model, x, y, draws, rows)
        if self.name != "mars":
            loss = mars.ar_loss(model, x, y, per_sequence=self.name == "control")
            return loss, {"loss": loss}
        B, ar_weight = self.cfg.B, self.cfg.ar_weight
        loss, noisy, clean = mars.mars_loss(model, x, y, self.tok.mask, B, ar_weight)
        return loss, {"loss": loss, "noisy": noisy, "clean": clean}

    @torch.no_grad()
    def val_losses(self):
        """The training loss on the validation sequences (any random draws from a fixed seed)."""
        self.raw_model.eval()
        sums, rng = {}, torch.Generator().manual_seed(VAL_SEED)
        for i in range(0, len(self.val_seqs), self.micro):
            with self.amp():
                x, y = self.batch(self.val_seqs[i:i + self.micro])
                draws = self.beyond and self.beyond.draws(rng, 1, validation=True)
                _, parts = self.loss(self.raw_model, x, y, draws)
            for k, v in parts.items():
                sums[k] = sums.get(k, 0.0) + v.item()
        self.raw_model.train()
        n = math.ceil(len(self.val_seqs) / self.micro)
        return {f"val_{k}": v / n for k, v in sums.items()}

    def save(self, step, done):
        """An atomic checkpoint of plain types, loadable with weights_only=True."""
        m = self.raw_model
        ckpt = {"model": m.state_dict(), "model_config": asdict(m.config),
                "tokenizer": self.tok.state(), "train_config": dict(vars(self.cfg)),
                "stage": self.name, "iter": step, "done": done,
                "optimizer": self.optimizer.state_dict(), "order_rng": self.order.get_state(),
                "history": self.history}
        if self.hf is not None:
            ckpt["hf"] = self.hf
        if self.name == "mars":
            ckpt["mars"] = stage2_flags(self.cfg)
        elif self.name == "control":
            ckpt["control"] = {"B": self.cfg.B}
        common.save(ckpt, self.path)


# ---------------------------------------------------------------------------
# The loop of every stage

def train(stage, later=0.0):
    """The loop of every stage, top to bottom; only the loss differs (Stage.loss). Ctrl-C stops it
    at the end of a step, with a checkpoint. later: what the run does after this stage, in stage-1
    steps (ETA)."""
    cfg, progress = stage.cfg, Progress(stage, later)
    with ctrl_c(stage) as stop_now:
        for it in range(stage.first_step, stage.iters):
            lr = lr_at(it, stage.peak_lr, cfg.warmup, stage.iters)
            for group in stage.optimizer.param_groups:
                group["lr"] = lr
            seqs, draws = stage.next_batch()
            logged = {}
            for x, y, rows in stage.my_micro_batches(seqs):  # the gradients add up
                with stage.amp():
                    loss, parts = stage.loss(stage.model, x, y, draws, rows)
                (loss / stage.accum).backward()
                for k, v in parts.items():
                    logged[k] = logged.get(k, 0.0) + v.item() / stage.accum
            norm = torch.nn.utils.clip_grad_norm_(stage.raw_model.parameters(), cfg.grad_clip)
            if not torch.isfinite(norm):  # the same on every process: the gradients were averaged
                raise UserError(not_finite(stage, it, logged["loss"]))
            stage.optimizer.step()
            stage.optimizer.zero_grad(set_to_none=True)
            last = it + 1 == stage.iters
            record = {"iter": it + 1, "lr": lr, **logged, "elapsed_s": progress.elapsed()}
            if (it + 1) % cfg.eval_every == 0 or last:
                record.update(stage.val_losses())
            stage.history.append(record)
            progress.report(record, sum(len(ids) - 1 for ids, _ in seqs))
            stop = stop_now()
            if stage.rank == 0 and (stop or last or (it + 1) % cfg.save_every == 0):
                stage.save(it + 1, last)
            if stop and not last:
                raise KeyboardInterrupt
    finish(stage)


def not_finite(stage, it, loss):
    kept = stage.path if os.path.exists(stage.path) else f"{stage.path} (none was written yet)"
    return (f"non-finite loss or gradient at {stage.name} step {it} (loss {loss:.4g}); stopped "
            f"without updating; the last good checkpoint is {kept}")


@contextlib.contextmanager
def ctrl_c(stage):
    """Ctrl-C ends the loop at the end of a step, with a checkpoint: yields stop_now(), whether it
    was pressed on any process; the loop then raises KeyboardInterrupt, which exits with how to
    --resume."""
    pressed, handler = [], signal.signal(signal.SIGINT, lambda *_: pressed.append(1))

    def stop_now():
        stop = torch.tensor(float(bool(pressed)), device=stage.cfg.device)  # NCCL: device tensors
        if stage.world > 1:  # every process stops at the same step
            dist.all_reduce(stop)
        return bool(stop.item())
    try:
        yield stop_now
    except KeyboardInterrupt:
        if stage.rank == 0:
            again = [] if "--resume" in sys.argv else ["--resume"]
            cmd = " ".join(["python"] + sys.argv + again)
            print(f"\ninterrupted: {stage.path} holds step {stage.history[-1]['iter']} of "
                  f"{stage.iters}; resume with:\n  {cmd}")
        raise SystemExit(130)
    finally:
        signal.signal(signal.SIGINT, handler)


class Progress:
    """A stage's clock and progress lines: tokens per second since the last line, the time left in
    the stage and in the whole run (later: what the run does after the stage, in stage-1 steps)."""

    def __init__(self, stage, later):
        self.stage, self.later, self.tokens = stage, later, 0
        self.t0 = self.t_line = time.time()

    def elapsed(self):
        return round(self.stage.seconds_before + time.time() - self.t0, 2)  # --resume: time before

    def report(self, record, tokens):
        """A line on rank 0 every 2% of the stage (at most every 10 steps), at each validation, and
        30 s after the last line (a slow machine learns its ETA within the first minute)."""
        stage, step = self.stage, record["iter"]
        self.tokens += tokens
        due = step % max(10, stage.iters // 50) == 0 or step == stage.iters or "val_loss" in record
        if stage.rank != 0 or not (due or time.time() - self.t_line >= 30):
            return
        per_step = (time.time() - self.t0) / (step - stage.first_step)
        eta = per_step * (stage.iters - step)
        eta_run = eta + per_step / STEP_TIME[stage.name] * self.later
        shown = {k: v for k, v in record.items() if k not in ("iter", "lr", "elapsed_s")}
        parts = " ".join(f"{k} {v:.3f}" for k, v in shown.items())
        speed = self.tokens / (time.time() - self.t_line)
        print(f"{stage.name} {step}/{stage.iters} | {parts} | lr {record['lr']:.2e} | "
              f"{speed:,.0f} tok/s | ETA stage {eta / 60:.1f} min, run {eta_run / 60:.1f} min",
              flush=True)
        self.t_line, self.tokens = time.time(), 0


# ---------------------------------------------------------------------------
# Scoring, the log and the summary

def finish(stage):
    """The stage's last record gets its validation accuracy (what a recipe is chosen on; the test
    split only reports), MARS at tau = 1.0, and its wall time; then the log and its plot are
    written."""
    if stage.rank != 0:
        return
    record, B = stage.history[-1], stage.cfg.B if stage.name == "mars" else 1
    if stage.val_examples:
        r = evaluate(stage.raw_model, stage.tok, stage.val_examples, B=B)
        print(f"validation accuracy {100 * r['accuracy']:.1f}% on {r['n']} prompts: "
              + ", ".join(f"{k} {100 * v:.0f}" for k, v in r["per_task"].items()), flush=True)
        record.update(val_accuracy=r["accuracy"], val_per_task=r["per_task"])
    record.update(stage_seconds=round(stage.seconds_before + time.time() - stage.t_created, 2),
                  precision=stage.cfg.precision_why)  # the autocast dtype, and why
    write_log_and_plot(stage.name, stage.history, stage.cfg.out_dir)


def evaluate(model, tok, examples, B=1, tau=1.0):
    """Greedy exact-answer accuracy, overall and per family, and tokens per forward (output
    tokens over forwards), the prompts decoded EVAL_BATCH at a time by sample.generate."""
    model.eval()
    done = []
    for i in range(0, len(examples), EVAL_BATCH):  # n_vocab: never an id past the tokenizer's
        prompts = [tok.prompt_ids(e["prompt"]) for e in examples[i:i + EVAL_BATCH]]
        done += sample.generate(model, prompts, tok.eot, tok.mask, B, tau, n_vocab=tok.n_vocab)
    model.train()
    right = [int(data.check(e, tok.answer(out))) for e, (out, _) in zip(examples, done)]
    tokens, forwards = sum(len(out) for out, _ in done), sum(len(chunks) for _, chunks in done)
    per_task = {}
    for e, r in zip(examples, right):
        per_task.setdefault(e["task"], []).append(r)
    return {"n": len(right), "accuracy": sum(right) / len(right),
            "tokens_per_forward": tokens / max(forwards, 1),
            "per_task": {f: round(sum(r) / len(r), 4) for f, r in sorted(per_task.items())}}


def summary(out_dir, test, device):
    """The closing check: held-out accuracy of stage 1 and of MARS at tau = 1.0 and 0.9 ->
    summary.json (the paper's tables in full, with intervals: python -m extras.bench.eval)."""
    if not test:
        return print("no held-out test examples in this data: skipping the summary")
    print(f"\nheld-out test set ({len(test)} prompts)\n"
          "| model | accuracy | tokens/forward |\n|---|---|---|")
    table = []
    rows = [("stage 1 (AR SFT)", "ar", None), ("MARS tau=1.0", "mars", 1.0),
            ("MARS tau=0.9", "mars", 0.9)]
    for label, name, tau in rows:
        ckpt = load_checkpoint(os.path.join(out_dir, f"{name}.pt"), device)
        B = ckpt.get("mars", {}).get("B", 1)
        r = evaluate(*model_from_checkpoint(ckpt, device), test, B=B, tau=tau or 1.0)
        table.append({"model": label, "threshold": tau, **r})
        print(f"| {label} | {100 * r['accuracy']:.1f}% | {r['tokens_per_forward']:.2f} |")
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(table, f, indent=1)


def write_log_and_plot(name, history, out_dir):
    with open(os.path.join(out_dir, f"{name}_log.json"), "w") as f:
        json.dump(history, f)
    from matplotlib.figure import Figure  # no pyplot: leaves the caller's backend alone
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    for key in [k for k in ("loss", "noisy", "clean", "val_loss") if k in history[-1]]:
        points = [(h["iter"], h[key]) for h in history if key in h]
        ax.plot(*zip(*points), "o-" if key == "val_loss" else "-", label=key, lw=0.8)
    ax.set(xlabel="step", ylabel="cross-entropy", yscale="log", title=f"stage {name}")
    ax.legend()
    fig.savefig(os.path.join(out_dir, f"{name}_loss.png"), dpi=100, bbox_inches="tight")


# ---------------------------------------------------------------------------
# The command line: the preset's numbers where no flag gives one

OVERRIDES = [
    ("n_layer", int, "layers"), ("n_head", int, "attention heads"), ("n_embd", int, "model width"),
    ("max_seq_len", int, "context in tokens; longer examples are dropped"),
    ("vocab_size", int, "the tokenizer's vocabulary (at most; the model's rows follow it)"),
    ("n_train", int, "built-in training examples"),
    ("batch_size", int, "global batch in sequences, whatever the number of processes"),
    ("micro_batch", int, "sequences per forward per process (default the preset's: "
                         "batch_size / processes for the toy presets, 4 for hf)"),
    ("ar_iters", int, "steps of stage 1"), ("mars_iters", int, "steps of stage 2 and the control"),
    ("lr", float, "peak learning rate of stage 1 (linear warmup, then cosine to zero)"),
    ("mars_lr", float, "peak learning rate of stage 2 and the control"),
    ("warmup", float, "warmup, a fraction of the stage's steps"),
    ("weight_decay", float, "on matrices"),
    ("eval_every", int, "steps between validation losses"),
    ("save_every", int, "steps between checkpoints"),
    ("summary_limit", int, "validation and test prompts decoded at the end (default the "
                           "preset's: 40 for tiny, 300 for course, 200 for hf, all for cpu "
                           "and gpu)"),
    ("seed", int, "seed for data, initialisation and batch order (default 0)"),
    ("buckets", int, "length buckets; a batch comes from one, so it has little padding "
                     "(default 16; 1: uniform batches)"),
    ("grad_clip", float, "clip the gradient norm to this (default 1.0)"),
    ("tasks", lambda s: s.split(","), "the built-in task families to train and score, "
                                      f"comma-separated (default all: {','.join(data.TASKS)})")]


class Config(SimpleNamespace):
    """The run's settings, resolved once (resolve, then derive) and read-only after: what a run
    prints at its start and saves in every checkpoint (train_config)."""

    def __setattr__(self, name, value):
        raise AttributeError(f"the config is read-only once resolved ({name}): use replace")

    def replace(self, **changes):
        return Config(**{**vars(self), **changes})


def get_args(argv=None):
    """The command line, resolved (resolve) into a Config."""
    p = Parser(__doc__)
    p.add_argument("--preset", choices=[*PRESETS, "hf"], help="tiny (seconds), course (a few "
                   "minutes), cpu, gpu, or hf (the paper's recipe for a real model, the default "
                   "when --init_from is one or was trained from one)")
    p.add_argument("--stage", choices=["ar", "mars", "all", "control"], default="all",
                   help="ar: stage 1 (AR SFT); mars: stage 2; all: both, then the summary "
                   "(default); control: stage 2 without its noisy stream")
    p.add_argument("--init_from", help="what stage 2 or the control starts from (default "
                   "<out_dir>/ar.pt), or a Hugging Face model directory, where every stage starts")
    p.add_argument("--out_dir", default="out", help="where checkpoints, logs and plots go "
                   "(default out)")
    p.add_argument("--data", help="your own instruction data: JSONL of {prompt, response} or "
                   "{messages}")
    p.add_argument("--resume", action="store_true", help="continue an interrupted run from its "
                   "--out_dir")
    add_device(p)
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--precision", choices=["auto", "float32", "bfloat16"], help="autocast "
                   "precision of training; auto (the default, unless the preset sets one): on a "
                   "CPU, times both on the model's shapes at start and takes bf16 where it is "
                   "clearly faster; on a GPU, bf16 where it is native (not timed); weights, "
                   "optimizer and decoding stay float32")
    g = p.add_argument_group("MARS (stage 2)")
    g.add_argument("--B", type=int, help="the paper's block size B: the noisy stream's blocks, "
                   "positions predicted together (default 4)")
    g.add_argument("--ar_weight", type=float, help="alpha, weight of the clean-stream (AR) loss "
                   "(default 1.0; 0 is not the paper's 'w/o SFT loss' ablation: that is --no_sft)")
    add_beyond_flags(p.add_argument_group("beyond the paper (extras/real/options.py)"))
    g = p.add_argument_group("preset overrides (default: the preset's value)")
    for name, kind, text in OVERRIDES:
        g.add_argument(f"--{name}", type=kind, help=text)
    return resolve(p, p.parse_args(argv))


def add_beyond_flags(g):
    """The ablations and options beyond the paper; a MARS checkpoint records them."""
    g.add_argument("--no_sft", action="store_true", help="the paper's 'w/o SFT loss' ablation: "
                   "no clean-stream loss, each sequence's noisy loss weighted 1/t, "
                   "t ~ U[0.001, 1)")
    g.add_argument("--block_offset", choices=["fixed", "random"], default="fixed",
                   help="fixed: the paper's blocks, at multiples of B (default); random: shifted "
                   "by a random offset every step")
    g.add_argument("--targets", choices=["hard", "soft"], default="hard", help="hard: the "
                   "data's tokens (default, the paper's); soft: the distribution of the model "
                   "stage 2 starts from, frozen, at every response position of both streams")
    g.add_argument("--clean_padding", choices=["keep", "drop"], default="keep", help="the "
                   "end-of-turn padding to B's multiple as clean-stream targets: keep (default, "
                   "the paper's) or drop")
    g.add_argument("--mask_row", choices=["own", "mean"], default="own", help="a real model "
                   "only: its <|mask|> embedding row at the start of stage 2: own (the reused "
                   "token's) or mean (the mean of the rows)")


def resolve(p, args):
    """The Config of a command line: the preset's numbers where no flag gives one; refuses what
    cannot run."""
    stage2 = args.stage in ("mars", "control")  # they start from --init_from, or <out_dir>/ar.pt
    start = args.init_from or (os.path.join(args.out_dir, "ar.pt") if stage2 else None)
    from_hf = common.starts_from_hf(start)
    check_device(args.device)
    toy = "gpu" if args.device.startswith("cuda") else "cpu"
    preset = args.preset or ("hf" if from_hf else toy)
    if preset == "hf" and not from_hf:
        p.error("--preset hf fine-tunes a real model: give --init_from DIR (a model directory)")
    if args.mask_row != "own" and not from_hf:
        p.error("--mask_row is for a real model (--init_from DIR): the toy learns its row")
    numbers = dict(COMMON, **real_model().HF_PRESET) if preset == "hf" else PRESETS[preset]
    given = [name for name, _, _ in OVERRIDES if getattr(args, name) is not None]  # beat hf's
    flags = {k: v for k, v in vars(args).items() if v is not None}
    c = {**vars(args), **numbers, **flags, "preset": preset, "from_hf": from_hf, "given": given,
         "schedule": {}}
    c["precision_why"] = None if c["precision"] == "auto" else {  # derive fills it for auto
        "dtype": c["precision"],
        "reason": f"--precision {args.precision}" if args.precision else f"the {preset} preset's"}
    c["data"] = args.data and os.path.abspath(args.data)  # the checkpoint finds it from anywhere
    if int(os.environ.get("WORLD_SIZE", 1)) > 1 and args.device.startswith("cuda"):  # torchrun
        c["device"] = f"cuda:{int(os.environ['LOCAL_RANK'])}"
    refuse(p, c, args, from_hf)
    c["ar_weight"] = 0.0 if args.no_sft else 1.0 if args.ar_weight is None else args.ar_weight
    return Config(**c)


def refuse(p, c, args, from_hf):
    """A one-line error for settings that cannot run."""
    counts = ("B", "ar_iters", "mars_iters", "eval_every", "save_every", "batch_size", "buckets")
    if any(c.get(k) is not None and c[k] < 1 for k in counts):
        p.error(f"--{', --'.join(counts)} must be >= 1")
    if c["tasks"] and set(c["tasks"]) - set(data.TASKS):
        p.error(f"--tasks: unknown families {sorted(set(c['tasks']) - set(data.TASKS))}; they are "
                f"{','.join(data.TASKS)}")
    if not from_hf and (c["n_embd"] % c["n_head"] or (c["n_embd"] // c["n_head"]) % 2):
        p.error("--n_embd must split into --n_head heads of an even width (rotary pairs)")
    if (args.ar_weight or 0) < 0 or (args.no_sft and args.ar_weight is not None):
        p.error("--ar_weight must be >= 0, and --no_sft has no clean-stream loss to weight")


def stage2_flags(cfg):
    """What a MARS checkpoint records of its stage-2 flags (and --resume checks)."""
    keys = ("B", "ar_weight", "no_sft", "block_offset", "targets", "clean_padding")
    return {k: getattr(cfg, k) for k in keys}


def schedule_of(cfg, name):
    """(batch, steps, peak lr) of stage `name`: the hf preset's as derive fitted them to the data,
    else the preset's and the flags'."""
    if name in cfg.schedule:
        s = cfg.schedule[name]
        return s["batch_size"], s["steps"], s["lr"]
    if name == "ar":
        return cfg.batch_size, cfg.ar_iters, cfg.lr
    return cfg.batch_size, cfg.mars_iters, cfg.mars_lr


def config_text(cfg):
    """The config as the run prints it at its start: one name=value per setting, wrapped."""
    shown = sorted((k, v) for k, v in vars(cfg).items() if k not in ("given", "precision_why"))
    words = [f"{k}={v}" for k, v in shown]
    return "config:\n" + textwrap.indent(textwrap.fill(" ".join(words), 96), "  ")


MATH_ATTENTION_MAX = 128  # [noisy | clean] positions where bf16 math attention is faster on a CPU


def autocast(device, dtype, max_seq_len):
    """What a training forward and its loss run under: bf16 autocast, unless dtype is float32. On
    the CPU, bf16 attention over at most MATH_ATTENTION_MAX positions takes the math path: there
    the flash kernel's bf16 backward made a cpu-preset step 17-30% slower (docs/train_cpu.json:
    attention_backend)."""
    device, stack = torch.device(device).type, contextlib.ExitStack()
    if dtype != "float32":
        stack.enter_context(torch.autocast(device, getattr(torch, dtype)))
        if device == "cpu" and 2 * max_seq_len <= MATH_ATTENTION_MAX:
            stack.enter_context(sdpa_kernel(SDPBackend.MATH))
    return stack


# ---------------------------------------------------------------------------
# The seams: where a flag reaches a tool in extras/ (docs/architecture.md lists them)

def beyond_the_paper(name, cfg, model, tok, state):
    """The loop's one hook: None for the paper's loss; extras/real/options.py's Options for a real
    model (--init_from DIR) or any option beyond the paper (--no_sft, --block_offset random,
    --targets soft, --clean_padding drop)."""
    paper = {"no_sft": False, "block_offset": "fixed", "targets": "hard", "clean_padding": "keep"}
    if not cfg.from_hf and (name == "ar" or all(getattr(cfg, k) == v for k, v in paper.items())):
        return None
    from extras.real import options
    return options.start(name, cfg, model, tok, state)


def real_model():
    """--init_from a real model (or a checkpoint trained from one): extras/checkpoints/hf_train.py,
    its start of a stage, the hf preset and its schedule."""
    from extras.checkpoints import hf_train
    return hf_train


def measured_precision(cfg, model, world):
    """--precision auto: extras/bench/precision.py's choice (a CPU: timed; a GPU: bf16 where
    native)."""
    from extras.bench.precision import choose_dtype
    return choose_dtype(cfg, model, world, autocast)


# ---------------------------------------------------------------------------
# A run: its stages, where each starts, the config derived once, then each stage's loop

def plan_stages(cfg, say):
    """The names of the stages to run, and the checkpoint of a stage interrupted earlier
    (--resume)."""
    names = ["ar", "mars"] if cfg.stage == "all" else [cfg.stage]
    for name in reversed(names if cfg.resume else []):
        path = os.path.join(cfg.out_dir, f"{name}.pt")
        if not os.path.exists(path):
            continue
        ckpt = load_checkpoint(path)
        if ckpt.get("done"):
            names = names[names.index(name) + 1:]
            rest = "" if names else "; nothing to do"
            say(f"resuming: stage {name} is complete in {path}{rest}")
            return names, {}
        saved, now = ckpt.get("mars") or ckpt.get("control") or {}, stage2_flags(cfg)
        changed = [f"{k} {saved[k]} -> {now[k]}" for k in saved if saved[k] != now[k]]
        if changed:
            raise UserError(f"--resume with changed stage-2 flags ({', '.join(changed)}); rerun "
                            f"with the flags of {path}, or start a new --out_dir")
        say(f"resuming stage {name} at step {ckpt['iter']} from {path}")
        return names[names.index(name):], {name: ckpt}
    if cfg.resume:
        say(f"resuming: no checkpoint in {cfg.out_dir}; starting from scratch")
    return names, {}


def start_stage(name, state, cfg, splits, say):
    """The model, tokenizer and splits a stage starts from, its Hugging Face record (None for the
    toy), and the settings the checkpoint it starts from fixes (its architecture and data: derive
    puts them in the config)."""
    if cfg.from_hf:
        return real_model().start_real_stage(name, state, cfg, splits, MODEL_KEYS)
    if name == "ar" and state is None:  # the toy, from scratch
        splits = data.load_splits(cfg.data, cfg.seed, cfg.n_train, cfg.tasks)
        text = (data.plain_text(e) for e in splits["train"])
        tok = tokenizer.Tokenizer.train(text, cfg.vocab_size)
        shape = {k: getattr(cfg, k) for k in MODEL_KEYS}
        model = GPT(GPTConfig(vocab_size=tok.n_vocab, **shape)).to(cfg.device)
        sizes = ", ".join(f"{k} {len(v)}" for k, v in splits.items())
        n = sum(p.numel() for p in model.parameters())
        say(f"instruction set: {sizes}; tokenizer: {tok.n_vocab} tokens; model: {n / 1e6:.2f}M "
            "parameters")
        return model, tok, splits, None, {}
    source = state or load_checkpoint(cfg.init_from or os.path.join(cfg.out_dir, "ar.pt"))
    if state is None and source.get("stage") != "ar":
        raise UserError("--init_from must be a stage-1 (ar) checkpoint or a Hugging Face model "
                        "directory")
    model, tok = model_from_checkpoint(source, cfg.device)
    prev = source["train_config"]
    fixed = {k: source["model_config"][k] for k in MODEL_KEYS}
    fixed.update(data=cfg.data or prev["data"], tasks=prev.get("tasks"))
    if splits is None:
        splits = data.load_splits(fixed["data"], prev["seed"], prev["n_train"], fixed["tasks"])
    return model, tok, splits, None, fixed


def derive(cfg, names, start, world, say):
    """The config the run trains with, computed once before its first step: cfg with what the first
    stage's start fixes (start: its model, tokenizer, splits, the settings its source fixes, and
    the resumed stage's checkpoint), the hf preset's schedule fitted to the rows that fit, and the
    precision (--precision auto: measured_precision, or the resumed stage's)."""
    model, tok, splits, fixed, resumed = start
    cfg = cfg.replace(**fixed)
    if cfg.preset == "hf":  # the batch, steps and lr follow the rows that fit
        cfg = cfg.replace(schedule=real_model().fit_schedules(cfg, names, splits, tok, world, say))
    why = resumed and resumed["train_config"].get("precision_why")
    if cfg.precision == "auto" and isinstance(why, dict):  # a resumed stage keeps its precision
        cfg = cfg.replace(precision=why["dtype"], precision_why=why)
    elif cfg.precision == "auto":
        why = measured_precision(cfg, model, world)
        cfg = cfg.replace(precision=why["dtype"], precision_why=why)
        say(f"precision: {why['dtype']}: {why['reason']} (--precision forces either)")
    return cfg


def work_after(name, names, cfg, splits):
    """What the run does after this stage, in stage-1 steps: the later stages, the validation
    accuracies and the summary (decoding a prompt takes about as long as training on a sequence).
    """
    rest = names[names.index(name) + 1:]
    steps = sum(STEP_TIME[n] * schedule_of(cfg, n)[1] for n in rest)
    prompts = (1 + len(rest)) * len(splits["val"][:cfg.summary_limit])
    prompts += 3 * len(splits["test"][:cfg.summary_limit]) if cfg.stage == "all" else 0
    return steps + prompts / schedule_of(cfg, name)[0]


def out_of_memory(stage):
    """What running out of memory in a stage says: the flag that fixes it."""
    return (f"out of memory on {stage.cfg.device} in stage {stage.name}, with micro-batches of "
            f"{stage.micro} rows of up to {stage.cfg.max_seq_len} tokens: lower --micro_batch "
            f"(the batch of {stage.batch_size} rows stays, accumulated over more micro-batches)")


def main(argv=None):
    cfg, t0 = get_args(argv), time.time()
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    if world > 1:  # torchrun: one process per device (resolve gave each its GPU)
        dist.init_process_group("nccl" if cfg.device.startswith("cuda") else "gloo")
        if cfg.device.startswith("cuda"):
            torch.cuda.set_device(cfg.device)
    say = print if rank == 0 else lambda *_: None
    os.makedirs(cfg.out_dir, exist_ok=True)
    torch.manual_seed(cfg.seed)
    names, resume_state = plan_stages(cfg, say)
    splits = None
    for name in names:
        state = resume_state.get(name)
        model, tok, splits, hf, fixed = start_stage(name, state, cfg, splits, say)
        # the first stage's start completes the config: derived once, then read-only
        if name == names[0]:
            cfg = derive(cfg, names, (model, tok, splits, fixed, state), world, say)
            say(config_text(cfg))
        stage = Stage(name, model, tok, splits, cfg, (rank, world), state, hf)
        try:
            train(stage, work_after(name, names, cfg, splits))
        except torch.OutOfMemoryError:  # one line naming the knob, not the allocator's traceback
            raise UserError(out_of_memory(stage)) from None
        if world > 1:  # the next stage reads the checkpoint rank 0 has just written
            dist.barrier()
    if rank == 0 and cfg.stage == "all" and names:
        summary(cfg.out_dir, splits["test"][:cfg.summary_limit], cfg.device)
    if names:
        say(f"done in {(time.time() - t0) / 60:.1f} min")
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    run_cli(main)
