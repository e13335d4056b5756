"""Train stage 1 (AR SFT) and stage 2 (MARS) on the instruction set: `python train.py` (presets, flags and the
precision probe: config.py, precision.py; what a run writes: python train.py --help). Each stage runs one loop,
`train`; only its loss differs.
"""
import contextlib
import functools
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

import checkpoint
import data
import mars
import sample
import tokenizer
from checkpoint import UserError, foreign, load_checkpoint, model_from_checkpoint
from config import MODEL_KEYS, autocast, fit_hf_schedule, get_args, run_cli, schedule_of, show, stage2_flags
from model import GPT, GPTConfig

STEP_TIME = {"ar": 1.0, "control": 1.0, "mars": 1.9}  # time of a step against stage 1's (docs/profile_cpu.json)
EVAL_BATCH = 64  # prompts decoded at once when scoring: one forward serves them all
VAL_SEED = 1234  # the validation loss's random draws: the same at every evaluation, so that they compare
VAL_SEQS = 256  # validation sequences the validation loss averages over


def lr_at(it, peak, warmup_frac, iters):
    warmup = max(1, int(warmup_frac * iters))
    if it < warmup:
        return peak * (it + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (it - warmup) / max(1, iters - warmup)))


class Stage:
    """What one stage keeps: its training sequences in length buckets, the optimizer, the batch order, the log.
    state: the checkpoint of this stage interrupted earlier (--resume); hf: what the checkpoint records of
    the Hugging Face model the run started from (None for the toy)."""

    def __init__(self, name, model, tok, splits, cfg, dist_info, state=None, hf=None):
        self.name, self.raw_model, self.tok, self.cfg, self.hf = name, model, tok, cfg, hf
        self.t_created = time.time()
        (self.rank, self.world), self.path = dist_info, os.path.join(cfg.out_dir, f"{name}.pt")
        self.multiple = 1 if name == "ar" else cfg.B  # stage 2 and the control pad sequences to B's multiples
        self.seqs = data.tokenize(splits["train"], tok, cfg.max_seq_len, self.multiple)
        self.val_seqs = data.tokenize(splits["val"], tok, cfg.max_seq_len, self.multiple)[:VAL_SEQS]
        self.val_examples = splits["val"][:cfg.summary_limit]
        if not self.seqs:
            raise UserError(f"no training example fits --max_seq_len {cfg.max_seq_len}")
        self.batch_size, self.iters, self.peak_lr = schedule_of(cfg, name)
        self.buckets = data.length_buckets(self.seqs, cfg.buckets, self.multiple, min_seqs=8 * self.batch_size)
        self.micro = cfg.micro_batch or self.batch_size // self.world
        if self.micro < 1 or self.batch_size % (self.micro * self.world):
            raise UserError(f"--batch_size {self.batch_size} is not a multiple of --micro_batch {self.micro} x "
                            f"{self.world} processes")
        self.accum = self.batch_size // (self.micro * self.world)
        groups = [{"params": [p for p in model.parameters() if p.dim() == d], "weight_decay": wd}  # decay matrices
                  for d, wd in ((2, cfg.weight_decay), (1, 0.0))]
        self.optimizer = torch.optim.AdamW(groups, self.peak_lr, tuple(cfg.betas), fused=True)  # CPU too: 4x faster
        self.order = torch.Generator().manual_seed(cfg.seed + (name != "ar"))  # control and mars: the same batches
        self.first_step, self.history = (state["iter"], state["history"]) if state else (0, [])
        self.seconds_before = self.history[-1]["elapsed_s"] if self.history else 0.0  # before an interruption
        if state:
            self.optimizer.load_state_dict(state["optimizer"])
            self.order.set_state(state["order_rng"])
        self.teacher = teacher(name, model, tok, state, cfg)  # --targets soft: the base model, frozen
        compiled = torch.compile(model) if cfg.compile else model
        self.model = DDP(compiled) if self.world > 1 else compiled  # what the loop runs; raw_model: the plain GPT
        self.amp = functools.partial(autocast, cfg.device, cfg.precision, cfg.max_seq_len)

    def next_batch(self):
        """A step's global batch (every process draws the same, then takes its share) and its random draws,
        from a generator the batch order seeds, so that a resumed run draws them again."""
        seqs = [self.seqs[i] for i in data.draw_batch(self.buckets, self.batch_size, self.order)]
        step_rng = torch.Generator().manual_seed(int(torch.randint(2**62, (1,), generator=self.order)))
        return (seqs, *self.random_draws(step_rng, len(seqs)))

    def random_draws(self, rng, n):
        """Random draws for n sequences: the MARS block offset, and the --no_sft weights (1/t per sequence)."""
        a = self.cfg
        offset = int(torch.randint(a.B, (1,), generator=rng)) if a.block_offset == "random" else 0
        return offset, mars.no_sft_weights(n, rng, a.device) if a.no_sft else None

    def my_micro_batches(self, seqs, weights):
        """This process's share of the global batch: micro-batches (x, y, --no_sft weights) on the device.
        Under DDP, the gradients are averaged across processes after the last one only."""
        for a in range(self.accum):
            if self.world > 1:
                self.model.require_backward_grad_sync = a == self.accum - 1
            mine = slice((self.rank * self.accum + a) * self.micro, (self.rank * self.accum + a + 1) * self.micro)
            x, y = self.batch(seqs[mine])
            yield x, y, None if weights is None else weights[mine]

    def batch(self, seqs):
        return (t.to(self.cfg.device) for t in data.make_batch(seqs, self.tok.eot, self.multiple))

    def loss(self, model, x, y, offset=0, weight=None, hard=False):
        """The stage's loss and what to log. The control is MARS without its noisy stream: the clean term
        alone, with the same per-sequence mean, padding, batches and schedule. hard: on the data's tokens even
        under --targets soft (validation, so that runs compare)."""
        clean_y = self.clean_targets(y)
        soft = None if hard or not self.teacher else self.teacher.targets(x, y, clean_y, noisy=self.name == "mars")
        if self.name != "mars":
            loss = mars.ar_loss(model, x, clean_y, per_sequence=self.name == "control", soft=soft)
            return loss, {"loss": loss}
        beyond = mars.Beyond(offset, 1.0 if weight is None else weight, clean_y, soft)
        loss, noisy, clean = mars.mars_loss(model, x, y, self.tok.mask, self.cfg.B, self.cfg.ar_weight, beyond)
        return loss, {"loss": loss, "noisy": noisy, "clean": clean}

    def clean_targets(self, y):
        """The clean stream's targets: y, or with --clean_padding drop, y without the end-of-turn padding to B's
        multiple (the targets after a sequence's first end of turn)."""
        if self.name == "ar" or self.cfg.clean_padding == "keep":
            return y
        return y.masked_fill(mars.end_padding(y, self.tok.eot), -1)

    @torch.no_grad()
    def val_losses(self):
        """The training loss on the validation sequences, its random draws from a fixed seed (--no_sft: unweighted;
        --targets soft: on the data's tokens)."""
        self.raw_model.eval()
        sums, rng = {}, torch.Generator().manual_seed(VAL_SEED)
        for i in range(0, len(self.val_seqs), self.micro):
            with self.amp():
                x, y = self.batch(self.val_seqs[i:i + self.micro])
                _, parts = self.loss(self.raw_model, x, y, self.random_draws(rng, 1)[0], hard=True)
            for k, v in parts.items():
                sums[k] = sums.get(k, 0.0) + v.item()
        self.raw_model.train()
        return {f"val_{k}": v / math.ceil(len(self.val_seqs) / self.micro) for k, v in sums.items()}

    def save(self, step, done):
        """An atomic checkpoint (temp file + rename) of plain types, loadable with weights_only=True."""
        ckpt = {"model": self.raw_model.state_dict(), "model_config": asdict(self.raw_model.config), "done": done,
                "tokenizer": self.tok.state(), "train_config": dict(vars(self.cfg)), "stage": self.name, "iter": step,
                "optimizer": self.optimizer.state_dict(), "order_rng": self.order.get_state(), "history": self.history}
        if self.hf is not None:
            ckpt["hf"] = self.hf
        if self.name == "mars":
            ckpt["mars"] = stage2_flags(self.cfg)
        elif self.name == "control":
            ckpt["control"] = {"B": self.cfg.B}
        checkpoint.save(ckpt, self.path)


def teacher(name, model, tok, state, cfg):
    """--targets soft: the frozen model stage 2 starts from (a resumed stage reloads it from where it started)."""
    if cfg.targets == "hard" or name == "ar":
        return None
    if state is not None:
        source = cfg.init_from if cfg.init_from and cfg.stage != "all" else os.path.join(cfg.out_dir, "ar.pt")
        model, tok = model_from_checkpoint(load_checkpoint(source, cfg.device), cfg.device)
    return foreign().Teacher(model, tok)


def train(stage, later=0.0):
    """The loop of every stage, top to bottom; only the loss differs (Stage.loss). Ctrl-C stops it at the end
    of a step, with a checkpoint. later: what the run does after this stage, in stage-1 steps (for the ETA)."""
    cfg, progress = stage.cfg, Progress(stage, later)
    with ctrl_c(stage) as stop_now:
        for it in range(stage.first_step, stage.iters):
            lr = lr_at(it, stage.peak_lr, cfg.warmup, stage.iters)
            for group in stage.optimizer.param_groups:
                group["lr"] = lr
            seqs, offset, weights = stage.next_batch()  # the global batch, its MARS block offset and --no_sft weights
            logged = {}
            for x, y, weight in stage.my_micro_batches(seqs, weights):  # the gradients add up
                with stage.amp():
                    loss, parts = stage.loss(stage.model, x, y, offset, weight)
                (loss / stage.accum).backward()
                for k, v in parts.items():
                    logged[k] = logged.get(k, 0.0) + v.item() / stage.accum
            norm = torch.nn.utils.clip_grad_norm_(stage.raw_model.parameters(), cfg.grad_clip)
            if not torch.isfinite(norm):  # the same on every process: the gradients were averaged
                raise UserError(f"non-finite loss or gradient at {stage.name} step {it} (loss {logged['loss']:.4g}); "
                                f"stopped without updating; the last good checkpoint is {stage.path}"
                                + ("" if os.path.exists(stage.path) else " (none was written yet)"))
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


@contextlib.contextmanager
def ctrl_c(stage):
    """Ctrl-C ends the loop at the end of a step, with a checkpoint: yields stop_now(), whether it was pressed
    on any process; the loop then raises KeyboardInterrupt, which exits with how to --resume."""
    pressed, handler = [], signal.signal(signal.SIGINT, lambda *_: pressed.append(1))

    def stop_now():
        stop = torch.tensor(float(bool(pressed)))
        if stage.world > 1:  # every process stops at the same step
            dist.all_reduce(stop)
        return bool(stop.item())
    try:
        yield stop_now
    except KeyboardInterrupt:
        if stage.rank == 0:
            cmd = " ".join(["python"] + sys.argv + ([] if "--resume" in sys.argv else ["--resume"]))
            print(f"\ninterrupted: {stage.path} holds step {stage.history[-1]['iter']} of {stage.iters}; "
                  f"resume with:\n  {cmd}")
        raise SystemExit(130)
    finally:
        signal.signal(signal.SIGINT, handler)


class Progress:
    """A stage's clock and progress lines: tokens per second since the last line, the time left in the stage
    and in the whole run (later: what the run does after the stage, in stage-1 steps)."""

    def __init__(self, stage, later):
        self.stage, self.later, self.t0, self.t_line, self.tokens = stage, later, time.time(), time.time(), 0

    def elapsed(self):
        return round(self.stage.seconds_before + time.time() - self.t0, 2)  # --resume: the time before included

    def report(self, record, tokens):
        """A line on rank 0 every 2% of the stage (at most every 10 steps), at each validation, and 30 s after
        the last line (a slow machine learns its ETA within the first minute)."""
        stage, step = self.stage, record["iter"]
        self.tokens += tokens
        if stage.rank != 0 or not (step % max(10, stage.iters // 50) == 0 or step == stage.iters
                                   or "val_loss" in record or time.time() - self.t_line >= 30):
            return
        per_step = (time.time() - self.t0) / (step - stage.first_step)
        eta = per_step * (stage.iters - step)
        eta_run = eta + per_step / STEP_TIME[stage.name] * self.later
        parts = " ".join(f"{k} {v:.3f}" for k, v in record.items() if k not in ("iter", "lr", "elapsed_s"))
        print(f"{stage.name} {step}/{stage.iters} | {parts} | lr {record['lr']:.2e} | "
              f"{self.tokens / (time.time() - self.t_line):,.0f} tok/s | ETA stage {eta / 60:.1f} min, "
              f"run {eta_run / 60:.1f} min", flush=True)
        self.t_line, self.tokens = time.time(), 0


def finish(stage):
    """The stage's last record gets its validation accuracy (what a recipe is chosen on; the test split only
    reports), MARS at tau = 1.0, and its wall time; then the log and its plot are written."""
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
    """Greedy exact-answer accuracy, overall and per family, and tokens per forward (output tokens over
    forwards), the prompts decoded EVAL_BATCH at a time by sample.generate (the paper's loop, batched)."""
    model.eval()
    done = []
    for i in range(0, len(examples), EVAL_BATCH):  # n_vocab: never an id past the tokenizer's
        prompts = [tok.prompt_ids(e["prompt"]) for e in examples[i:i + EVAL_BATCH]]
        done += sample.generate(model, prompts, tok.eot, tok.mask, B, tau, n_vocab=tok.n_vocab)
    model.train()
    right = [int(data.check(e, tok.answer(out))) for e, (out, _) in zip(examples, done)]
    tokens, forwards = sum(len(out) for out, _ in done), sum(len(chunks) for _, chunks in done)
    tasks = sorted({e["task"] for e in examples})
    per_task = {f: [r for e, r in zip(examples, right) if e["task"] == f] for f in tasks}
    return {"n": len(right), "accuracy": sum(right) / len(right), "tokens_per_forward": tokens / max(forwards, 1),
            "per_task": {f: round(sum(r) / len(r), 4) for f, r in per_task.items()}}


def summary(out_dir, test, device):
    """The closing check: held-out accuracy of stage 1 and of MARS at tau = 1.0 and 0.9 -> summary.json
    (the paper's tables in full, with intervals: python -m extras.bench.eval)."""
    if not test:
        return print("no held-out test examples in this data: skipping the summary")
    print(f"\nheld-out test set ({len(test)} prompts)\n| model | accuracy | tokens/forward |\n|---|---|---|")
    table = []
    for label, name, tau in [("stage 1 (AR SFT)", "ar", None), ("MARS tau=1.0", "mars", 1.0), ("MARS tau=0.9", "mars", 0.9)]:
        ckpt = load_checkpoint(os.path.join(out_dir, f"{name}.pt"), device)
        r = evaluate(*model_from_checkpoint(ckpt, device), test, B=ckpt.get("mars", {}).get("B", 1), tau=tau or 1.0)
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


def plan_stages(cfg, say):
    """The names of the stages to run, and the checkpoint of a stage interrupted earlier (--resume)."""
    names = ["ar", "mars"] if cfg.stage == "all" else [cfg.stage]
    for name in reversed(names if cfg.resume else []):
        path = os.path.join(cfg.out_dir, f"{name}.pt")
        if not os.path.exists(path):
            continue
        ckpt = load_checkpoint(path)
        if ckpt.get("done"):
            names = names[names.index(name) + 1:]
            say(f"resuming: stage {name} is complete in {path}" + ("" if names else "; nothing to do"))
            return names, {}
        saved, now = ckpt.get("mars") or ckpt.get("control") or {}, stage2_flags(cfg)
        changed = [f"{k} {saved[k]} -> {now[k]}" for k in saved if saved[k] != now[k]]
        if changed:
            raise UserError(f"--resume with changed stage-2 flags ({', '.join(changed)}); rerun with the flags of "
                            f"{path}, or start a new --out_dir")
        say(f"resuming stage {name} at step {ckpt['iter']} from {path}")
        return names[names.index(name):], {name: ckpt}
    if cfg.resume:
        say(f"resuming: no checkpoint in {cfg.out_dir}; starting from scratch")
    return names, {}


def start_stage(name, state, cfg, splits, say):
    """The model, tokenizer and splits a stage starts from, its Hugging Face record (None for the toy), and the
    settings the checkpoint it starts from fixes (its architecture and data: derive puts them in the config)."""
    if cfg.from_hf:  # a real model: extras/checkpoints/hf_train.py, through the root's one seam
        return foreign().start_real_stage(name, state, cfg, splits, MODEL_KEYS, load_checkpoint, model_from_checkpoint)
    if name == "ar" and state is None:  # the toy, from scratch
        splits = data.load_splits(cfg.data, cfg.seed, cfg.n_train, cfg.tasks)
        tok = tokenizer.Tokenizer.train((data.plain_text(e) for e in splits["train"]), cfg.vocab_size)
        model = GPT(GPTConfig(vocab_size=tok.n_vocab, **{k: getattr(cfg, k) for k in MODEL_KEYS})).to(cfg.device)
        say(f"instruction set: {', '.join(f'{k} {len(v)}' for k, v in splits.items())}; tokenizer: "
            f"{tok.n_vocab} tokens; model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
        return model, tok, splits, None, {}
    source = state or load_checkpoint(cfg.init_from or os.path.join(cfg.out_dir, "ar.pt"))
    if state is None and source.get("stage") != "ar":
        raise UserError("--init_from must be a stage-1 (ar) checkpoint or a Hugging Face model directory")
    model, tok = model_from_checkpoint(source, cfg.device)
    prev = source["train_config"]
    fixed = {**{k: source["model_config"][k] for k in MODEL_KEYS}, "data": cfg.data or prev["data"],
             "tasks": prev.get("tasks")}
    splits = splits or data.load_splits(fixed["data"], prev["seed"], prev["n_train"], fixed["tasks"])
    return model, tok, splits, None, fixed


def derive(cfg, names, start, world, say):
    """The config the run trains with, computed once before its first step: cfg with what the first stage's start
    fixes (start: its model and tokenizer, and the settings its source fixes: the architecture and data of the
    checkpoint it starts from), the hf preset's schedule fitted to the rows that fit, and the precision (--precision
    auto: measured on the model, or the resumed stage's)."""
    model, tok, splits, fixed, resumed = start
    cfg = cfg.replace(**fixed)
    if cfg.preset == "hf":  # the batch, steps and lr follow the rows that fit
        schedule = {}
        for name in names:
            rows = len(data.tokenize(splits["train"], tok, cfg.max_seq_len, 1 if name == "ar" else cfg.B))
            s = schedule[name] = fit_hf_schedule(cfg, name, rows, world)
            say(f"schedule ({name}): batch {s['batch_size']}, {s['steps']} steps, peak lr {s['lr']:.3g} on {rows} "
                f"rows ({s['why']})")
        cfg = cfg.replace(schedule=schedule)
    why = resumed and resumed["train_config"].get("precision_why")
    if cfg.precision == "auto" and isinstance(why, dict):  # a resumed stage keeps the precision it started in
        cfg = cfg.replace(precision=why["dtype"], precision_why=why)
    elif cfg.precision == "auto":
        from precision import choose_dtype  # the probe, off the method's path
        why = choose_dtype(cfg, model, world)
        cfg = cfg.replace(precision=why["dtype"], precision_why=why)
        say(f"precision: {why['dtype']}: {why['reason']} (--precision forces either)")
    return cfg


def work_after(name, names, cfg, splits):
    """What the run does after this stage, in stage-1 steps: the later stages, the validation accuracies
    and the summary (decoding a prompt takes about as long as training on a sequence)."""
    rest = names[names.index(name) + 1:]
    steps = sum(STEP_TIME[n] * schedule_of(cfg, n)[1] for n in rest)
    prompts = (1 + len(rest)) * len(splits["val"][:cfg.summary_limit])
    prompts += 3 * len(splits["test"][:cfg.summary_limit]) if cfg.stage == "all" else 0
    return steps + prompts / schedule_of(cfg, name)[0]


def out_of_memory(stage):
    """What running out of memory in a stage says: the flag that fixes it."""
    a = stage.cfg
    return (f"out of memory on {a.device} in stage {stage.name}, with micro-batches of {stage.micro} rows of up to "
            f"{a.max_seq_len} tokens: lower --micro_batch (the batch of {stage.batch_size} rows stays, accumulated over "
            "more micro-batches); memory other processes hold on the device counts too")


def main(argv=None):
    cfg, t0 = get_args(argv), time.time()
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    if world > 1:  # torchrun: one process per device (config.resolve gave each its GPU)
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
        if name == names[0]:  # the first stage's start completes the config: derived once, printed, then read-only
            cfg = derive(cfg, names, (model, tok, splits, fixed, state), world, say)
            say(show(cfg))
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
