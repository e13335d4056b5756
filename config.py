"""The command line of train.py: its presets and flags, and the precision it trains in.

    python train.py                       # both stages with the default preset, then a held-out summary
    python train.py --preset tiny         # seconds, for tests
    python train.py --stage mars --init_from out/ar.pt
    python train.py --stage control       # the control: stage 2 without its noisy stream
    python train.py --stage mars --init_from Qwen2.5-0.5B-Instruct/ --data my.jsonl   # a real model
    torchrun --standalone --nproc_per_node=2 train.py --preset tiny   # data parallel

Writes <out_dir>/ar.pt and mars.pt (control.pt with --stage control; self-contained: weights, model config,
tokenizer, training config, optimizer state for --resume), a JSON log and a loss plot per stage, summary.json.
"""
import contextlib
import math
import os
import time

import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend, sdpa_kernel

from cli import Parser, add_device, check_device, foreign

# One source of truth for every number: flags override single entries.
# dtype: the autocast precision; a preset without one measures which is faster on the device (choose_dtype).
TOY = dict(warmup=0.05, weight_decay=0.1, betas=[0.9, 0.95])
PRESETS = {
    "tiny": dict(n_layer=2, n_head=2, n_embd=64, max_seq_len=64, vocab_size=512, n_train=4000, summary_limit=40,
                 batch_size=16, ar_iters=60, mars_iters=60, lr=3e-3, mars_lr=3e-3, eval_every=30, save_every=30,
                 dtype="float32", **TOY),  # float32: the same losses on every machine
    # cpu: 5,000 stage-1 steps, chosen on validation (docs/recipe_search_cpu.json)
    "cpu": dict(n_layer=4, n_head=4, n_embd=256, max_seq_len=64, vocab_size=2048, n_train=40000, summary_limit=None,
                batch_size=32, ar_iters=5000, mars_iters=2400, lr=2e-3, mars_lr=2e-3, eval_every=200, save_every=200,
                **TOY),
    "gpu": dict(n_layer=8, n_head=8, n_embd=512, max_seq_len=64, vocab_size=2048, n_train=200000, summary_limit=None,
                batch_size=128, ar_iters=6000, mars_iters=6000, lr=1e-3, mars_lr=1e-3, eval_every=500, save_every=500,
                **TOY),
    # hf: the paper's recipe for a real instruct model (the default when --init_from is one; its shape comes from
    # its config.json): lr 5e-6 in both stages, linear warmup 3% then cosine to zero, AdamW with weight decay 0
    # and transformers' default betas (0.9, 0.999), rows of at most 512 tokens, bf16 autocast where the device
    # runs it faster (choose_dtype), 5 epochs per stage (the steps follow from the data), effective batch 384
    # (the authors': 48 per GPU x 8 GPUs; here 4 per forward, the rest accumulated: 96 forwards per step on one GPU).
    # batch_size and lr are the paper's, the reference hf_schedule scales from: on a few thousand rows, 384 a step
    # leaves a few dozen steps, which train almost nothing, so unless the flags say otherwise the batch follows
    # the data (rows // 50, within [16, 384]: at least ~50 steps an epoch), the steps have a floor of 200, and
    # the lr is 5e-6 x sqrt(batch / 384): square-root scaling, the usual rule for Adam (a batch k times smaller
    # has gradients sqrt(k) times noisier, and the lr falls with them).
    "hf": dict(max_seq_len=512, batch_size=384, micro_batch=4, epochs=5, lr=5e-6, mars_lr=5e-6, warmup=0.03,
               weight_decay=0.0, betas=[0.9, 0.999], eval_every=500, save_every=500,
               summary_limit=200),
}
MODEL_KEYS = ("n_layer", "n_head", "n_embd", "max_seq_len")
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
PROBE_SECONDS = 2.0  # what the precision probe may spend timing runs
BF16_MARGIN = 0.9  # bf16 autocast only where it takes at most 90% of float32's time: noise alone never tips it


def get_args(argv=None):
    p = Parser(__doc__)
    p.add_argument("--preset", choices=PRESETS, help="tiny (seconds), cpu, gpu, or hf (the paper's recipe "
                   "for a real model, the default when --init_from is one or was trained from one)")
    p.add_argument("--stage", choices=["ar", "mars", "all", "control"], default="all", help="ar: stage 1 (AR SFT); "
                   "mars: stage 2; all: both, then the summary (default); control: stage 2 without its noisy stream")
    p.add_argument("--init_from", help="what stage 2 or the control starts from (default <out_dir>/ar.pt), or a "
                                       "Hugging Face model directory, where every stage starts")
    p.add_argument("--out_dir", default="out", help="where checkpoints, logs and plots go (default out)")
    p.add_argument("--data", help="your own instruction data: JSONL of {prompt, response} or {messages}")
    p.add_argument("--resume", action="store_true", help="continue an interrupted run from its --out_dir")
    add_device(p)
    p.add_argument("--seed", type=int, default=0, help="seed for data, initialisation and batch order")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], help="autocast precision of training; auto "
                   "(the default, unless the preset sets one) times both on the model's shapes at start and takes "
                   "bf16 where it is clearly faster; weights, optimizer and decoding stay float32")
    p.add_argument("--buckets", type=int, default=16, help="length buckets; a batch comes from one, so it has "
                                                           "little padding (default 16; 1: uniform batches)")
    p.add_argument("--grad_clip", type=float, default=1.0, help="clip the gradient norm to this (default 1.0)")
    g = p.add_argument_group("MARS (stage 2)")
    g.add_argument("--B", type=int, default=4, help="the paper's block size B: the noisy stream's blocks, positions "
                   "predicted together (default 4)")
    g.add_argument("--ar_weight", type=float, help="alpha, weight of the clean-stream (AR) loss (default 1.0; 0 is "
                                                   "not the paper's 'w/o SFT loss' ablation: that is --no_sft)")
    g.add_argument("--no_sft", action="store_true", help="the paper's 'w/o SFT loss' ablation: no clean-stream loss, "
                                                         "each sequence's noisy loss weighted 1/t, t ~ U[0.001, 1)")
    g.add_argument("--mask_row", choices=["own", "mean"], default="own", help="a real model's <|mask|> embedding "
                   "row at the start of stage 2: own (the reused token's row, e.g. SmolLM2's <empty_output>) or mean "
                   "(the mean of the embedding rows); the toy learns its row from scratch either way")
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
    check_device(args.device)
    args.preset = args.preset or ("hf" if args.from_hf else "gpu" if args.device.startswith("cuda") else "cpu")
    if args.preset == "hf" and not args.from_hf:
        p.error("--preset hf fine-tunes a real model: give --init_from DIR (a Hugging Face model directory)")
    # what the command line set of the preset's numbers: they win over the hf preset's schedule (fit_hf_schedule)
    args.given, args.schedule = [name for name, _, _ in OVERRIDES if getattr(args, name) is not None], {}
    forced = args.dtype
    for k, v in PRESETS[args.preset].items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    args.dtype = args.dtype or "auto"
    # what the checkpoint records of the choice; choose_dtype fills it for auto
    args.precision = None if args.dtype == "auto" else {
        "dtype": args.dtype, "reason": f"--dtype {forced}" if forced else f"the {args.preset} preset's"}
    args.data = args.data and os.path.abspath(args.data)  # the checkpoint must find it from anywhere
    counts = ("B", "ar_iters", "mars_iters", "eval_every", "save_every", "batch_size", "buckets")
    if any(getattr(args, k) is not None and getattr(args, k) < 1 for k in counts):
        p.error(f"--{', --'.join(counts)} must be >= 1")
    if not args.from_hf and (args.n_embd % args.n_head or (args.n_embd // args.n_head) % 2):
        p.error("--n_embd must split into --n_head heads of an even width (rotary positions rotate pairs)")
    if (args.ar_weight or 0) < 0 or (args.no_sft and args.ar_weight is not None):
        p.error("--ar_weight must be >= 0, and --no_sft has no clean-stream loss to weight")
    args.ar_weight = 0.0 if args.no_sft else 1.0 if args.ar_weight is None else args.ar_weight
    return args


def from_hf(path):
    """Whether a run starts from a real model: a Hugging Face directory, a GGUF file (or an installed one's
    short name, e.g. smollm2), or our checkpoint trained from one (it carries "hf"; read with mmap, so its
    tensors stay on disk)."""
    if path is None or os.path.isdir(path) or path.endswith(".gguf"):
        return path is not None
    if not os.path.exists(path):  # a short name; any other missing path is reported when the stage loads it
        return foreign().names_model(path)
    try:  # an unreadable file is reported when the stage loads it
        return "hf" in torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception:
        return False


def stage2_flags(args):
    """What a MARS checkpoint records of its stage-2 flags (and --resume checks)."""
    return {"B": args.B, "ar_weight": args.ar_weight, "no_sft": args.no_sft, "block_offset": args.block_offset}


# ---------------------------------------------------------------------------
# The hf preset's schedule follows the data (the comment at PRESETS["hf"] says why)

def hf_schedule(rows, epochs, given, multiple=1):
    """(batch, steps, peak lr, why) of one stage of the hf preset on `rows` training rows. given: what the command
    line set of "batch_size", "steps" and "lr"; it wins. The rest follows the data: a batch of rows // 50 within
    [16, 384] (at least ~50 steps an epoch), rounded down to a multiple of `multiple` (micro-batch x processes);
    the epochs' steps, at least 200; the paper's lr at its batch of 384 times sqrt(batch / 384)."""
    paper, top = PRESETS["hf"], PRESETS["hf"]["batch_size"]
    batch = given.get("batch_size") or max(multiple, min(max(rows // 50, 16), top) // multiple * multiple)
    steps = given.get("steps") or max(200, math.ceil(epochs * rows / batch))
    lr = given["lr"] if "lr" in given else paper["lr"] * math.sqrt(batch / top)
    why = ["batch given" if "batch_size" in given else f"batch: rows // 50 = {rows // 50}, within [16, {top}]"
           + (f", a multiple of {multiple}" if multiple > 1 else ""),
           "steps given" if "steps" in given else f"steps: {epochs} epochs of {rows} rows, at least 200",
           "lr given" if "lr" in given else f"lr: {paper['lr']:g} x sqrt({batch} / {top})"]
    return batch, steps, lr, "; ".join(why)


def fit_hf_schedule(args, name, rows, world):
    """Sets stage `name`'s batch, steps and peak lr by hf_schedule (the flags the command line gave win), records
    them in args.schedule (the checkpoint's train_config) and returns the line the run prints."""
    steps_key, lr_key = ("ar_iters", "lr") if name == "ar" else ("mars_iters", "mars_lr")
    flags = {"batch_size": "batch_size", "steps": steps_key, "lr": lr_key}
    given = {k: getattr(args, flag) for k, flag in flags.items() if flag in args.given}
    batch, steps, lr, why = hf_schedule(rows, args.epochs, given, (args.micro_batch or 1) * world)
    args.batch_size, args.schedule[name] = batch, {"rows": rows, "batch_size": batch, "steps": steps, "lr": lr,
                                                   "why": why}
    setattr(args, steps_key, steps)
    setattr(args, lr_key, lr)
    return f"schedule ({name}): batch {batch}, {steps} steps, peak lr {lr:.3g} on {rows} rows ({why})"


# ---------------------------------------------------------------------------
# The precision, measured: bf16 autocast is several times faster than float32 where the CPU or GPU has
# native bf16, and 10-30x slower where it has not (e.g. AVX2 only), so the choice is timed, not assumed.

MATH_ATTENTION_MAX = 128  # [noisy | clean] positions up to which bf16 attention on the CPU is faster on the math path


def autocast(device, dtype, max_seq_len):
    """What a training forward and its loss run under: bf16 autocast, unless dtype is float32. On the CPU, bf16
    attention over at most MATH_ATTENTION_MAX positions ([noisy | clean]: 2 x max_seq_len) takes the math path:
    there the flash kernel's bf16 backward made a cpu-preset step 17-30% slower, and from 256 positions on the
    flash kernel is the faster (docs/train_cpu.json: attention_backend). Decoding is float32, never under this."""
    device, stack = torch.device(device).type, contextlib.ExitStack()
    if dtype != "float32":
        stack.enter_context(torch.autocast(device, getattr(torch, dtype)))
        if device == "cpu" and 2 * max_seq_len <= MATH_ATTENTION_MAX:
            stack.enter_context(sdpa_kernel(SDPBackend.MATH))
    return stack


def step_timer(model, seq_len, device):
    """time_run(rows, bf16): seconds of one forward and backward of the model itself, as a training step runs
    it, on `rows` tokens in sequences of up to seq_len, in float32 or under bf16 autocast. The whole step, not
    one matmul: the gain of bf16 on a matmul can be far larger than on a step (norms, attention, softmax and
    the optimizer stay in float32). The gradients it leaves are dropped; no weight changes."""
    device = torch.device(device)  # zeros as tokens: the values do not change the speed, nor the seeded RNG
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None  # time the work, not its launch

    def time_run(rows, bf16):
        x = torch.zeros(max(1, rows // seq_len), min(rows, seq_len), dtype=torch.long, device=device)
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
    """(float32 seconds, bf16 seconds, rows): each precision's time for a step's `tokens` tokens, predicted as a
    fixed part plus a cost per token from the best of up to 5 alternating rounds of runs on 1 and on `rows`
    tokens, until the runs have taken `budget` seconds. The fixed part (the gradient of every weight, whatever
    the tokens) dominates a big model's short runs and would hide the precisions' difference, which a step of
    many tokens shows. Runs on 1 and 16 tokens warm up and size the rest: `rows` makes the slower precision's
    cost per token a tenth of the budget."""
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
    """bf16 autocast where it takes at most BF16_MARGIN of float32's time."""
    return "bfloat16" if bfloat16_s <= BF16_MARGIN * float32_s else "float32"


def without_bf16(gpu):
    """The precision record of a GPU without native bf16 (e.g. the T4 of free notebook services): float32, not
    probed. Its fast precision is fp16, whose small gradients underflow unless the loss is scaled, and this
    project does not scale the loss."""
    return {"dtype": "float32", "device": gpu, "reason": f"{gpu} has no native bf16 (not probed), and fp16 would "
            "need loss scaling, which this project does not do"}


def with_bf16(gpu):
    """The precision record of a GPU with native bf16: bf16 autocast, not probed. There it is the known answer (its
    tensor cores run bf16 at twice tf32's rate), and a probe's short runs time kernel launches and whatever else the
    GPU runs rather than the precisions: runs started together on one GPU chose differently (docs/gpu.md)."""
    return {"dtype": "bfloat16", "device": gpu, "reason": f"{gpu} has native bf16 (not probed: on a GPU with native "
            "bf16 it is the known answer, and a probe there times launches and other processes)"}


def choose_dtype(args, model, world, say):
    """--dtype auto: on a CPU, predicts both precisions' time for a forward and backward of the model on a step's
    tokens (probe, on one thread) and trains in bf16 autocast only where it is clearly faster; a GPU trains in bf16
    autocast where it has native bf16 (with_bf16), else in float32 (without_bf16), unprobed. Sets args.dtype and
    args.precision (the checkpoint's train_config and the stage log record both) and says why."""
    if args.device.startswith("cuda"):  # emulation counts as support by default: a T4 emulates bf16, slower
        native, gpu = torch.cuda.is_bf16_supported(including_emulation=False), torch.cuda.get_device_name(args.device)
        args.precision = with_bf16(gpu) if native else without_bf16(gpu)
        args.dtype = args.precision["dtype"]
        return say(f"precision: {args.dtype}: {args.precision['reason']} (--dtype forces either)")
    tokens = (args.micro_batch or args.batch_size // world) * args.max_seq_len
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the precisions differ per core; a second thread may wait on a core others hold
    times = torch.tensor(probe(step_timer(model, args.max_seq_len, args.device), tokens), device=args.device)
    torch.set_num_threads(threads)
    if dist.is_initialized():  # every process trains in rank 0's choice
        dist.broadcast(times, 0)
    fp32, bf16, rows = times.tolist()
    args.dtype = decide(fp32, bf16)
    where = (torch.cuda.get_device_name(args.device) if args.device.startswith("cuda")
             else f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    reason = (f"bf16 autocast takes {bf16 / fp32:.2f}x float32's time ({1e3 * bf16:.2f} against {1e3 * fp32:.2f} ms "
              f"for a forward and backward of the model on a step's {tokens} tokens, predicted from runs on 1 and "
              f"{int(rows)}, {where}); bf16 needs {BF16_MARGIN}x or less")
    args.precision = {"dtype": args.dtype, "reason": reason, "float32_ms": round(1e3 * fp32, 3),
                      "bfloat16_ms": round(1e3 * bf16, 3), "tokens": tokens, "rows": int(rows), "device": where}
    say(f"precision: {args.dtype}: {reason} (--dtype forces either)")
