"""Train stage 1 (AR SFT) and stage 2 (MARS) on the instruction set.

    python train.py                       # both stages with the default preset
    python train.py --preset tiny         # seconds, for tests
    python train.py --stage mars --init_from out/ar.pt
    python train.py --stage control       # the control: stage 2 without its noisy stream
    python train.py --stage mars --init_from Qwen2.5-0.5B-Instruct/ --data my.jsonl   # a real model
    torchrun --standalone --nproc_per_node=2 train.py --preset tiny   # data parallel

Writes <out_dir>/ar.pt and mars.pt (control.pt with --stage control; self-contained: weights, model config,
tokenizer, training config, optimizer state for --resume), a JSON log and a
loss plot per stage, and a short held-out evaluation (summary.json).
"""
import json
import math
import os
import signal
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import data
import tokenizer
import mars
from model import GPT, GPTConfig
from cli import Parser, UserError, check_device, run_cli
from sample import load_checkpoint, model_from_checkpoint

# One source of truth for every number: flags override single entries.
TOY = dict(warmup=0.05, weight_decay=0.1, betas=[0.9, 0.95])
PRESETS = {
    "tiny": dict(n_layer=2, n_head=2, n_embd=64, max_seq_len=64, vocab_size=512, n_train=4000, summary_limit=40,
                 batch_size=16, ar_iters=60, mars_iters=60, lr=3e-3, mars_lr=3e-3, eval_every=30, save_every=30, **TOY),
    "cpu": dict(n_layer=4, n_head=4, n_embd=256, max_seq_len=64, vocab_size=2048, n_train=40000, summary_limit=None,
                batch_size=32, ar_iters=3000, mars_iters=2400, lr=2e-3, mars_lr=2e-3, eval_every=200, save_every=200,
                **TOY),
    "gpu": dict(n_layer=8, n_head=8, n_embd=512, max_seq_len=64, vocab_size=2048, n_train=200000, summary_limit=None,
                batch_size=128, ar_iters=6000, mars_iters=6000, lr=1e-3, mars_lr=1e-3, eval_every=500, save_every=500,
                **TOY),
    # The paper's recipe for a real instruct model (the default when --init_from is a Hugging Face directory;
    # the model's shape comes from its config.json): lr 5e-6 in both stages, linear warmup 3% then cosine to
    # zero, AdamW with weight decay 0 and transformers' default betas (0.9, 0.999), rows of at most 512
    # tokens, bf16, 5 epochs per stage (the iterations follow from the data), effective batch 384 (the
    # authors': 48 per GPU x 8 GPUs; here 4 per forward, the rest accumulated: 96 forwards per step on one GPU).
    "hf": dict(max_seq_len=512, batch_size=384, micro_batch=4, epochs=5, lr=5e-6, mars_lr=5e-6, warmup=0.03,
               weight_decay=0.0, betas=[0.9, 0.999], dtype="bfloat16", eval_every=500, save_every=500,
               summary_limit=200),
}
MODEL_KEYS = ("n_layer", "n_head", "n_embd", "max_seq_len")


def get_args(argv=None):
    p = Parser(__doc__)
    p.add_argument("--preset", choices=PRESETS, help="size of model and run: tiny (seconds), cpu (laptop; 46 "
                                                      "minutes on two cores), gpu (one GPU), hf (the paper's recipe "
                                                      "for a real model); default hf when --init_from is a Hugging Face "
                                                      "directory (or was trained from one), else gpu with CUDA, "
                                                      "else cpu")
    p.add_argument("--stage", choices=["ar", "mars", "all", "control"], default="all",
                   help="ar: stage 1 (AR SFT); mars: stage 2 from --init_from; all: both (default); control: "
                        "stage 2 without its noisy stream: --init_from trained on the clean (AR) term alone, "
                        "same per-sequence mean, padding, batches and schedule (control.pt)")
    p.add_argument("--init_from", help="stage-1 checkpoint for stage 2 or the control (default <out_dir>/ar.pt); "
                                       "or a Hugging Face model directory (Qwen2, Llama), where every stage starts "
                                       "(--stage all: AR SFT on it, then MARS)")
    p.add_argument("--out_dir", default="out", help="where checkpoints, logs and plots go (default out)")
    p.add_argument("--data", help="your own instruction data: JSONL of {prompt, response} or {messages}")
    p.add_argument("--resume", action="store_true", help="continue an interrupted run from the checkpoints in --out_dir")
    p.add_argument("--device", help="cpu, cuda, cuda:1, ... (default cuda when available)")
    p.add_argument("--seed", type=int, default=0, help="seed for data, initialisation and batch order")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="autocast precision of the forward passes "
                                                                    "(default bfloat16 on CUDA, float32 elsewhere)")
    g = p.add_argument_group("MARS (stage 2)")
    g.add_argument("--block_size", type=int, default=4, help="B, the MARS block: masks predicted together (default 4)")
    g.add_argument("--ar_weight", type=float,
                   help="alpha, weight of the clean-stream (AR) loss (default 1.0). 0 drops it and changes nothing "
                        "else: that is not quite the paper's 'w/o SFT loss' ablation, which is --no_sft")
    g.add_argument("--no_sft", action="store_true", help="the paper's 'w/o SFT loss' ablation: no clean-stream loss, "
                                                         "each sequence's noisy loss weighted 1/t, t ~ U[0.001, 1)")
    g.add_argument("--block_offset", choices=["fixed", "random"], default="fixed",
                   help="fixed: the paper's blocks, at multiples of B from the sequence start (default); "
                        "random: every step shifts the boundaries by a random offset (an ablation)")
    g = p.add_argument_group("preset overrides (default: the preset's value)")
    g.add_argument("--n_layer", type=int, help="transformer layers")
    g.add_argument("--n_head", type=int, help="attention heads")
    g.add_argument("--n_embd", type=int, help="model width")
    g.add_argument("--max_seq_len", type=int, help="context length in tokens; longer examples are dropped")
    g.add_argument("--vocab_size", type=int, help="tokenizer vocabulary including special tokens (at most)")
    g.add_argument("--n_train", type=int, help="training examples generated for the built-in instruction set")
    g.add_argument("--batch_size", type=int, help="global batch in sequences, whatever the number of processes")
    g.add_argument("--micro_batch", type=int, help="sequences per forward per process, the rest accumulated "
                                                   "(default batch_size / processes)")
    g.add_argument("--ar_iters", type=int, help="optimizer steps of stage 1")
    g.add_argument("--mars_iters", type=int, help="optimizer steps of stage 2")
    g.add_argument("--lr", type=float, help="peak learning rate of stage 1 (linear warmup, then cosine to zero)")
    g.add_argument("--mars_lr", type=float, help="peak learning rate of stage 2 and the control (the paper: as stage 1)")
    g.add_argument("--warmup", type=float, help="warmup as a fraction of the stage's steps")
    g.add_argument("--weight_decay", type=float, help="AdamW weight decay on matrices")
    g.add_argument("--grad_clip", type=float, default=1.0, help="clip the gradient norm to this (default 1.0)")
    g.add_argument("--eval_every", type=int, help="steps between validation losses")
    g.add_argument("--save_every", type=int, help="steps between checkpoints")
    g.add_argument("--summary_limit", type=int, help="held-out prompts in the final summary (default all)")
    args = p.parse_args(argv)
    hf = args.init_from is not None and trained_from_hf(args.init_from)
    args.preset = args.preset or ("hf" if hf else "gpu" if torch.cuda.is_available() else "cpu")
    if args.preset == "hf" and not hf:
        p.error("--preset hf fine-tunes a real model: give --init_from DIR (a Hugging Face model directory)")
    for k, v in PRESETS[args.preset].items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    for k in ("ar_iters", "mars_iters", "epochs"):  # the hf preset counts epochs; the others, steps
        setattr(args, k, getattr(args, k, None))
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    args.data = args.data and os.path.abspath(args.data)  # the checkpoint must find it from anywhere
    counts = (args.block_size, args.ar_iters, args.mars_iters, args.eval_every, args.save_every, args.batch_size)
    if min(n for n in counts if n is not None) < 1:
        p.error("--block_size, --ar_iters, --mars_iters, --eval_every, --save_every, --batch_size must be >= 1")
    if not hf and (args.n_embd % args.n_head or (args.n_embd // args.n_head) % 2):
        p.error("--n_embd must split into --n_head heads of an even width (rotary positions rotate pairs)")
    if (args.ar_weight or 0) < 0 or (args.no_sft and args.ar_weight is not None):
        p.error("--ar_weight must be >= 0, and --no_sft has no clean-stream loss to weight")
    args.ar_weight = 0.0 if args.no_sft else 1.0 if args.ar_weight is None else args.ar_weight
    check_device(args.device)
    return args


def prompt_text(prompt):
    """A prompt as plain text (a conversation's turns, one per line), to train the toy's tokenizer on."""
    return prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)


def trained_from_hf(path):
    """True for a Hugging Face model directory, or one of our checkpoints whose training started from one
    (it carries "hf"; read with mmap, so its tensors are not loaded)."""
    if os.path.isdir(path):
        return True
    try:
        return "hf" in torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception:
        return False  # load_checkpoint reports an unreadable file later


# ---------------------------------------------------------------------------
# Checkpoints: atomic (temp file + rename), plain types, weights_only loadable

def stage2_flags(args):
    """What a MARS checkpoint records of its stage-2 flags (and --resume checks)."""
    return {"B": args.block_size, "ar_weight": args.ar_weight, "no_sft": args.no_sft, "block_offset": args.block_offset}


def save_checkpoint(path, ckpt):
    torch.save(ckpt, path + ".tmp")
    os.replace(path + ".tmp", path)


# ---------------------------------------------------------------------------
# The loop, shared by every stage: only the loss function differs

@contextmanager
def ctrl_c_requests():
    """Within the block, Ctrl-C appends to the yielded list instead of raising,
    so the loop can stop at the next step boundary with a checkpoint."""
    requests = []
    previous = signal.signal(signal.SIGINT, lambda *_: requests.append(1))
    try:
        yield requests
    finally:
        signal.signal(signal.SIGINT, previous)


def lr_at(it, peak, warmup_frac, iters):
    warmup = max(1, int(warmup_frac * iters))
    if it < warmup:
        return peak * (it + 1) / warmup
    progress = (it - warmup) / max(1, iters - warmup)
    return peak * 0.5 * (1 + math.cos(math.pi * progress))


def train_stage(stage, model, tok, splits, args, dist_info, state=None, hf=None):
    """Runs one stage to the end (or to Ctrl-C) and writes <out_dir>/<stage>.pt.
    hf: what the checkpoint records of the Hugging Face model it started from (None for the toy)."""
    (rank, world), device = dist_info, args.device
    master = rank == 0
    is_mars = stage == "mars"
    # stage 2 and the control pad every sequence with <|endoftext|> to a multiple of B, as the paper does
    multiple = 1 if stage == "ar" else args.block_size
    path = os.path.join(args.out_dir, f"{stage}.pt")
    train_rows = data.tokenize(splits["train"], tok, args.max_seq_len, multiple)
    val_rows = data.tokenize(splits["val"], tok, args.max_seq_len, multiple)[:256]
    if not train_rows:
        raise UserError(f"no training example fits --max_seq_len {args.max_seq_len}")
    key = "ar_iters" if stage == "ar" else "mars_iters"
    if getattr(args, key) is None:  # the hf preset: epochs over the rows that fit
        setattr(args, key, math.ceil(args.epochs * len(train_rows) / args.batch_size))
    iters, peak_lr = (args.ar_iters, args.lr) if stage == "ar" else (args.mars_iters, args.mars_lr)

    micro = args.micro_batch or args.batch_size // world
    if micro < 1 or args.batch_size % (micro * world):
        raise UserError(f"--batch_size {args.batch_size} is not a multiple of --micro_batch {micro} x {world} processes")
    accum = args.batch_size // (micro * world)

    def draws(rng, n):
        """A step's random draws, for its n sequences: the MARS block offset, and the --no_sft
        weights (1/t per sequence: drawn for the global batch, so each process takes its own)."""
        offset = int(torch.randint(args.block_size, (1,), generator=rng)) if args.block_offset == "random" else 0
        return offset, mars.no_sft_weights(n, rng, device) if args.no_sft else None

    def loss_fn(m, x, y, offset=0, weight=None):
        """The stage's loss and what to log. The control is MARS without its noisy stream: the
        clean term alone, with the same per-sequence mean, padding, batches and schedule."""
        if not is_mars:
            loss = mars.ar_loss(m, x, y, per_sequence=stage == "control")
            return loss, {"loss": loss}
        loss, noisy, clean = mars.mars_loss(m, x, y, tok.mask, args.block_size, args.ar_weight, offset, weight)
        return loss, {"loss": loss, "noisy": noisy, "clean": clean}

    def batch(rows):
        x, y = data.make_batch(rows, tok.eot, multiple)
        return x.to(device), y.to(device)

    groups = [{"params": [p for p in model.parameters() if p.dim() == d], "weight_decay": wd}  # decay matrices only
              for d, wd in ((2, args.weight_decay), (1, 0.0))]
    optimizer = torch.optim.AdamW(groups, lr=peak_lr, betas=tuple(args.betas), fused=device.startswith("cuda"))
    order = torch.Generator().manual_seed(args.seed + (0 if stage == "ar" else 1))  # control and mars: same batches
    start, history = 0, []
    if state is not None:  # --resume
        optimizer.load_state_dict(state["optimizer"])
        order.set_state(state["order_rng"])
        start, history = state["iter"], state["history"]

    run = torch.compile(model) if args.compile else model
    run = DDP(run) if world > 1 else run
    amp = torch.autocast(torch.device(device).type, dtype=getattr(torch, args.dtype), enabled=args.dtype != "float32")

    def checkpoint(it, done):
        ckpt = {"model": model.state_dict(), "model_config": asdict(model.config), "tokenizer": tok.state(),
                "train_config": vars(args), "stage": stage, "iter": it, "done": done,
                "optimizer": optimizer.state_dict(), "order_rng": order.get_state(), "history": history}
        if hf is not None:
            ckpt["hf"] = hf
        if is_mars:
            ckpt["mars"] = stage2_flags(args)
        elif stage == "control":
            ckpt["control"] = {"B": args.block_size}
        if master:
            save_checkpoint(path, ckpt)

    @torch.no_grad()
    def val_losses():  # the same loss as training, with its random draws from a fixed seed
        model.eval()
        sums, rng = {}, torch.Generator().manual_seed(1234)
        for i in range(0, len(val_rows), micro):
            with amp:  # --no_sft: validation reports the plain (unweighted) noisy loss
                _, parts = loss_fn(model, *batch(val_rows[i:i + micro]), draws(rng, 1)[0])
            for k, v in parts.items():
                sums[k] = sums.get(k, 0.0) + v.item()
        model.train()
        n = math.ceil(len(val_rows) / micro)
        return {f"val_{k}": v / n for k, v in sums.items()}

    with ctrl_c_requests() as interrupt:
        model.train()
        t0, tokens_seen, t_last = time.time(), 0, time.time()
        for it in range(start, iters):
            lr = lr_at(it, peak_lr, args.warmup, iters)
            for group in optimizer.param_groups:
                group["lr"] = lr
            # every process draws the same global batch, then takes its own share
            drawn = torch.randint(len(train_rows), (args.batch_size,), generator=order).tolist()
            step_rng = torch.Generator().manual_seed(int(torch.randint(2**62, (1,), generator=order)))
            offset, weights = draws(step_rng, args.batch_size)
            first = rank * micro * accum
            mine = drawn[first:first + micro * accum]
            logged = {}
            for a in range(accum):
                x, y = batch([train_rows[i] for i in mine[a * micro:(a + 1) * micro]])
                weight = None if weights is None else weights[first + a * micro:first + (a + 1) * micro]
                tokens_seen += x.numel() * world
                if world > 1:
                    run.require_backward_grad_sync = a == accum - 1
                with amp:
                    loss, parts = loss_fn(run, x, y, offset, weight)
                (loss / accum).backward()
                for k, v in parts.items():
                    logged[k] = logged.get(k, 0.0) + v.item() / accum
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            if not torch.isfinite(norm):  # identical on every process after the all-reduce
                raise UserError(f"non-finite loss or gradient at {stage} step {it} (loss {logged['loss']:.4g}); "
                                    f"stopped without updating; the last good checkpoint is {path}"
                                    + (" (none was written yet)" if not os.path.exists(path) else ""))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

            record = {"iter": it + 1, "lr": lr, **logged, "elapsed_s": round(time.time() - t0, 2)}
            last = it + 1 == iters
            if (it + 1) % args.eval_every == 0 or last:
                record.update(val_losses())
            history.append(record)
            if master and ((it + 1) % max(10, iters // 50) == 0 or last or "val_loss" in record):
                elapsed = time.time() - t0
                eta = elapsed / (it + 1 - start) * (iters - it - 1)
                parts = " ".join(f"{k} {v:.3f}" for k, v in record.items() if k not in ("iter", "lr", "elapsed_s"))
                print(f"{stage} {it + 1}/{iters} | {parts} | lr {lr:.2e} | "
                      f"{tokens_seen / (time.time() - t_last):,.0f} tok/s | ETA {eta / 60:.1f} min", flush=True)
                tokens_seen, t_last = 0, time.time()
            stop = torch.tensor(float(bool(interrupt)))
            if world > 1:  # every process stops at the same step
                dist.all_reduce(stop)
            if stop.item() or last or (it + 1) % args.save_every == 0:
                checkpoint(it + 1, last)
            if stop.item() and not last:
                if master:
                    cmd = " ".join(["python"] + sys.argv + ([] if "--resume" in sys.argv else ["--resume"]))
                    print(f"\ninterrupted: {path} holds step {it + 1} of {iters}; resume with:\n  {cmd}", flush=True)
                raise SystemExit(130)
    if master:
        if splits["val"] and history:
            history[-1].update(validation_accuracy(model, tok, splits["val"][:args.summary_limit],
                                                   args.block_size if is_mars else 1))
        write_log_and_plot(stage, history, args.out_dir)
    return model


def validation_accuracy(model, tok, examples, B):
    """Greedy accuracy on the validation prompts, overall and per family: what a recipe or data mix is
    chosen on (the test split only reports). A MARS stage decodes with its B at tau = 1.0."""
    from eval import score  # a top module may use another; nothing imports train.py
    model.eval()
    r = score(model, tok, examples, B=B, tau=1.0)
    model.train()
    per_task = {k: round(v["accuracy"], 4) for k, v in r["per_task"].items()}
    print(f"validation accuracy {100 * r['accuracy']:.1f}% on {len(examples)} prompts: "
          + ", ".join(f"{k} {100 * v:.0f}" for k, v in per_task.items()), flush=True)
    return {"val_accuracy": r["accuracy"], "val_per_task": per_task}


def write_log_and_plot(stage, history, out_dir):
    with open(os.path.join(out_dir, f"{stage}_log.json"), "w") as f:
        json.dump(history, f)
    from matplotlib.figure import Figure  # no pyplot: leaves the caller's backend alone
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    for key in ("loss", "noisy", "clean"):
        if key in history[-1]:
            ax.plot([h["iter"] for h in history], [h[key] for h in history], label=f"train {key}", lw=0.8)
    val = [h for h in history if "val_loss" in h]
    ax.plot([h["iter"] for h in val], [h["val_loss"] for h in val], "o-", label="val loss")
    ax.set(xlabel="step", ylabel="cross-entropy", yscale="log", title=f"stage {stage}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, f"{stage}_loss.png"), dpi=100)


def main(argv=None):
    args = get_args(argv)
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    if world > 1:
        backend = "nccl" if args.device.startswith("cuda") else "gloo"
        dist.init_process_group(backend)
        if args.device.startswith("cuda"):
            args.device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
            torch.cuda.set_device(args.device)
    say = print if rank == 0 else lambda *_: None
    os.makedirs(args.out_dir, exist_ok=True)
    torch.manual_seed(args.seed)

    stages = ["ar", "mars"] if args.stage == "all" else [args.stage]
    resume_state = {}
    if args.resume:
        for stage in ("control", "mars", "ar"):
            path = os.path.join(args.out_dir, f"{stage}.pt")
            if stage in stages and os.path.exists(path):
                ckpt = load_checkpoint(path)
                if ckpt.get("done"):
                    stages = stages[stages.index(stage) + 1:]
                    say(f"resuming: stage {stage} is complete in {path}" + ("" if stages else "; nothing to do"))
                else:
                    saved = ckpt.get("mars") or ckpt.get("control") or {}
                    now = stage2_flags(args)
                    changed = [f"{k} {saved[k]} -> {now[k]}" for k in saved if saved[k] != now[k]]
                    if changed:
                        raise UserError(f"--resume with changed stage-2 flags ({', '.join(changed)}); rerun with the "
                                        f"flags of {path}, or start a new --out_dir")
                    stages = stages[stages.index(stage):]
                    resume_state[stage] = ckpt
                    say(f"resuming stage {stage} at step {ckpt['iter']} from {path}")
                break
        else:
            say(f"resuming: no checkpoint in {args.out_dir}; starting from scratch")

    hf_dir = args.init_from is not None and os.path.isdir(args.init_from)  # a Hugging Face model directory
    splits, tok = None, None
    for stage in stages:
        state = resume_state.get(stage)
        source = None
        if stage == "ar" and state is None and not hf_dir:  # the toy, from scratch
            splits = data.load_splits(args.data, args.seed, args.n_train)
            texts = (prompt_text(e["prompt"]) + "\n" + e["response"] for e in splits["train"])
            tok = tokenizer.Tokenizer.train(texts, args.vocab_size)
            config = GPTConfig(vocab_size=tok.n_vocab, **{k: getattr(args, k) for k in MODEL_KEYS})
            model = GPT(config).to(args.device)
            say(f"instruction set: {', '.join(f'{k} {len(v)}' for k, v in splits.items())}; tokenizer: "
                f"{tok.n_vocab} tokens; model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
        else:
            # --init_from starts the stage (a Hugging Face directory: any stage), except that --stage all
            # on a Hugging Face directory runs its MARS stage from the AR SFT it has just trained
            after_ar = args.init_from is None or (hf_dir and stage != "ar" and args.stage == "all")
            source = state or load_checkpoint(os.path.join(args.out_dir, "ar.pt") if after_ar else args.init_from)
            if state is None and source.get("stage") not in ("ar", "hf"):
                raise UserError("--init_from must be a stage-1 (ar) checkpoint or a Hugging Face model directory")
            model, tok = model_from_checkpoint(source, args.device)
            limit = args.max_seq_len
            for k in MODEL_KEYS:  # the architecture comes from the checkpoint
                setattr(args, k, source["model_config"][k])
            if "hf" in source:  # a real model: --max_seq_len limits the rows (the recipe: 512), within its context
                args.max_seq_len = min(limit, args.max_seq_len)
            if splits is None:
                prev = source.get("train_config")  # none in a Hugging Face directory
                if prev is None and args.data is None:
                    raise UserError("--init_from a Hugging Face directory needs --data (your JSONL of "
                                    "{prompt, response} or {messages})")
                args.data = args.data or prev["data"]
                splits = data.load_splits(args.data, args.seed if prev is None else prev["seed"],
                                          args.n_train if prev is None else prev["n_train"])
        train_stage(stage, model, tok, splits, args, (rank, world), state, hf=source and source.get("hf"))
        if world > 1:  # the next stage reads the checkpoint rank 0 has just written
            dist.barrier()
    if rank == 0 and args.stage == "all" and stages:
        from eval import summary
        summary(args.out_dir, splits["test"][:args.summary_limit], args.device)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    run_cli(main)
