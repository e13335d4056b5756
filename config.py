"""The command lines: what all of them share (one-line errors, --device, tau), then train.py's presets and flags
and the precision context it trains in (--precision auto measures which is faster: precision.py).

    python train.py                       # both stages with the default preset, then a held-out summary
    python train.py --preset tiny         # seconds, for tests
    python train.py --stage mars --init_from out/ar.pt
    python train.py --stage control       # the control: stage 2 without its noisy stream
    python train.py --stage mars --init_from Qwen2.5-0.5B-Instruct/ --data my.jsonl   # a real model
    torchrun --standalone --nproc_per_node=2 train.py --preset tiny   # data parallel

Writes <out_dir>/ar.pt and mars.pt (control.pt with --stage control; self-contained: weights, model config,
tokenizer, training config, optimizer state for --resume), a JSON log and a loss plot per stage, summary.json.
"""
import argparse
import contextlib
import math
import os
import sys
import textwrap
from types import SimpleNamespace

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from checkpoint import UserError, check_device, starts_from_hf
from data import TASKS


def run_cli(main):
    """Run a command-line main: a user's mistake becomes one line on stderr and exit 1, Ctrl-C one line and
    exit 130."""
    try:
        main()
    except BrokenPipeError:  # the reader left (e.g. `| head`): nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    except (UserError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt as e:  # Ctrl-C: one line, with what was kept where a command says (its args)
        print(f"\ninterrupted{': ' + str(e) if e.args else ''}", file=sys.stderr)
        sys.exit(130)


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line, for every CLI of the project."""

    def __init__(self, doc):
        super().__init__(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)

    def error(self, message):
        self.exit(2, f"error: {message} (see --help)\n")


def threshold(text):
    """tau, as a command line or a chat command gives it."""
    try:
        tau = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < tau <= 1 or torch.tensor(tau, dtype=torch.float32) == 0:  # decoding compares in float32
        raise argparse.ArgumentTypeError(f"must be in (0, 1] (and above 0 in float32), got {tau}")
    return tau


def default_device():
    """cuda where torch finds a GPU, else cpu: what every tool's --device is when the flag is not given."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def add_device(parser):
    """The --device flag of every command line that loads a model; checkpoint.load_checkpoint checks it."""
    parser.add_argument("--device", default=default_device(), help="cpu, cuda, cuda:1, ... (default cuda where a "
                        "GPU is present, else cpu)")


# ---------------------------------------------------------------------------
# train.py's presets and flags

# One source of truth for every number: every preset takes COMMON, and a flag overrides a single entry.
# precision: of the autocast a training forward runs in; "auto" (train.derive) measures which is faster on the device.
COMMON = dict(B=4, buckets=16, grad_clip=1.0, seed=0, precision="auto", micro_batch=None, epochs=None, tasks=None)
TOY = dict(COMMON, warmup=0.05, weight_decay=0.1, betas=[0.9, 0.95])
PRESETS = {
    "tiny": dict(TOY, n_layer=2, n_head=2, n_embd=64, max_seq_len=64, vocab_size=512, n_train=4000, summary_limit=40,
                 batch_size=16, ar_iters=60, mars_iters=60, lr=3e-3, mars_lr=3e-3, eval_every=30, save_every=30,
                 precision="float32"),  # float32: the same losses on every machine
    # cpu: 5,000 stage-1 steps, chosen on validation (docs/recipe_search_cpu.json)
    "cpu": dict(TOY, n_layer=4, n_head=4, n_embd=256, max_seq_len=64, vocab_size=2048, n_train=40000,
                summary_limit=None, batch_size=32, ar_iters=5000, mars_iters=2400, lr=2e-3, mars_lr=2e-3,
                eval_every=200, save_every=200),
    # course: a class sees MARS work in a few minutes on a laptop CPU: six of the ten families (the templated
    # ones, whose answers MARS can commit several tokens at a time), a narrower model, fewer steps; chosen on
    # validation prompts (docs/course_search_cpu.json). The default run teaches the quality, this the mechanism.
    "course": dict(TOY, n_layer=4, n_head=4, n_embd=128, max_seq_len=64, vocab_size=2048, n_train=40000,
                   tasks=["spell", "reverse", "copy", "words", "convert", "facts"], summary_limit=300,
                   batch_size=32, ar_iters=2000, mars_iters=1000, lr=3e-3, mars_lr=3e-3, eval_every=500,
                   save_every=500),
    "gpu": dict(TOY, n_layer=8, n_head=8, n_embd=512, max_seq_len=64, vocab_size=2048, n_train=200000,
                summary_limit=None, batch_size=128, ar_iters=6000, mars_iters=6000, lr=1e-3, mars_lr=1e-3,
                eval_every=500, save_every=500),
    # hf: the paper's recipe for a real instruct model (the default when --init_from is one; its shape comes from
    # its config.json): lr 5e-6 in both stages, linear warmup 3% then cosine to zero, AdamW with weight decay 0
    # and transformers' default betas (0.9, 0.999), rows of at most 512 tokens, bf16 autocast where the device
    # runs it faster (precision auto), 5 epochs per stage (the steps follow from the data), effective batch 384
    # (the authors': 48 per GPU x 8 GPUs; here 4 per forward, the rest accumulated: 96 forwards per step on one GPU).
    # batch_size and lr are the paper's, the reference hf_schedule scales from: on a few thousand rows, 384 a step
    # leaves a few dozen steps, which train almost nothing, so unless the flags say otherwise the batch follows
    # the data (rows // 50, within [16, 384]: at least ~50 steps an epoch), the steps have a floor of 200, and
    # the lr is 5e-6 x sqrt(batch / 384): square-root scaling, the usual rule for Adam (a batch k times smaller
    # has gradients sqrt(k) times noisier, and the lr falls with them).
    "hf": dict(COMMON, max_seq_len=512, batch_size=384, micro_batch=4, epochs=5, lr=5e-6, mars_lr=5e-6, warmup=0.03,
               weight_decay=0.0, betas=[0.9, 0.999], eval_every=500, save_every=500, summary_limit=200),
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
             ("summary_limit", int, "validation and test prompts decoded at the end (default all)"),
             ("seed", int, "seed for data, initialisation and batch order (default 0)"),
             ("buckets", int, "length buckets; a batch comes from one, so it has little padding (default 16; 1: "
                              "uniform batches)"),
             ("grad_clip", float, "clip the gradient norm to this (default 1.0)"),
             ("tasks", lambda s: s.split(","), "the built-in task families to train and score, comma-separated "
                                               "(default all: add,multiples,spell,reverse,sort,count,copy,words,"
                                               "convert,facts)")]


class Config(SimpleNamespace):
    """The run's settings, resolved once (resolve, then train.derive) and read-only after: what a run prints at its
    start and saves in every checkpoint (train_config)."""

    def __setattr__(self, name, value):
        raise AttributeError(f"the config is read-only once resolved ({name}): derive a new one with replace")

    def replace(self, **changes):
        return Config(**{**vars(self), **changes})


def get_args(argv=None):
    """The command line, resolved (resolve) into a Config."""
    p = Parser(__doc__)
    p.add_argument("--preset", choices=PRESETS, help="tiny (seconds), course (a few minutes), cpu, gpu, or hf (the paper's recipe "
                   "for a real model, the default when --init_from is one or was trained from one)")
    p.add_argument("--stage", choices=["ar", "mars", "all", "control"], default="all", help="ar: stage 1 (AR SFT); "
                   "mars: stage 2; all: both, then the summary (default); control: stage 2 without its noisy stream")
    p.add_argument("--init_from", help="what stage 2 or the control starts from (default <out_dir>/ar.pt), or a "
                                       "Hugging Face model directory, where every stage starts")
    p.add_argument("--out_dir", default="out", help="where checkpoints, logs and plots go (default out)")
    p.add_argument("--data", help="your own instruction data: JSONL of {prompt, response} or {messages}")
    p.add_argument("--resume", action="store_true", help="continue an interrupted run from its --out_dir")
    add_device(p)
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--precision", choices=["auto", "float32", "bfloat16"], help="autocast precision of training; "
                   "auto (the default, unless the preset sets one) times both on the model's shapes at start and "
                   "takes bf16 where it is clearly faster; weights, optimizer and decoding stay float32")
    add_stage2_flags(p.add_argument_group("MARS (stage 2)"))
    g = p.add_argument_group("preset overrides (default: the preset's value)")
    for name, kind, text in OVERRIDES:
        g.add_argument(f"--{name}", type=kind, help=text)
    return resolve(p, p.parse_args(argv))


def add_stage2_flags(g):
    """Stage 2's flags: B, the loss, the ablations and the options beyond the paper (stage2_flags records them)."""
    g.add_argument("--B", type=int, help="the paper's block size B: the noisy stream's blocks, positions predicted "
                                         "together (default 4)")
    g.add_argument("--ar_weight", type=float, help="alpha, weight of the clean-stream (AR) loss (default 1.0; 0 is "
                                                   "not the paper's 'w/o SFT loss' ablation: that is --no_sft)")
    g.add_argument("--no_sft", action="store_true", help="the paper's 'w/o SFT loss' ablation: no clean-stream loss, "
                                                         "each sequence's noisy loss weighted 1/t, t ~ U[0.001, 1)")
    g.add_argument("--mask_row", choices=["own", "mean"], default="own", help="a real model's <|mask|> embedding "
                   "row at the start of stage 2: own (the reused token's row, e.g. SmolLM2's <empty_output>) or mean "
                   "(the mean of the embedding rows); the toy learns its row from scratch either way")
    g.add_argument("--block_offset", choices=["fixed", "random"], default="fixed", help="fixed: the paper's blocks, "
                   "at multiples of B (default); random: shifted by a random offset every step (an ablation)")
    g.add_argument("--targets", choices=["hard", "soft"], default="hard", help="hard: the data's tokens (default, "
                   "the paper's); soft: the distribution of the model stage 2 starts from, frozen, at every response "
                   "position of both streams (self-distillation, beyond the paper: extras/real/teacher.py)")
    g.add_argument("--clean_padding", choices=["keep", "drop"], default="keep", help="the end-of-turn padding to B's "
                   "multiple as clean-stream targets: keep (default, the paper's) or drop (decoding never reaches "
                   "it; the noisy stream keeps it either way: masks past the end learn to predict the end)")


def resolve(p, args):
    """The Config of a command line: the preset's numbers where no flag gives one; refuses what cannot run."""
    stage2 = args.stage in ("mars", "control")  # they start from --init_from, by default <out_dir>/ar.pt
    from_hf = starts_from_hf(args.init_from or (os.path.join(args.out_dir, "ar.pt") if stage2 else None))
    check_device(args.device)
    preset = args.preset or ("hf" if from_hf else "gpu" if args.device.startswith("cuda") else "cpu")
    if preset == "hf" and not from_hf:
        p.error("--preset hf fine-tunes a real model: give --init_from DIR (a Hugging Face model directory)")
    given = [name for name, _, _ in OVERRIDES if getattr(args, name) is not None]  # they win over hf_schedule
    flags = {k: v for k, v in vars(args).items() if v is not None}
    c = {**vars(args), **PRESETS[preset], **flags, "preset": preset, "from_hf": from_hf, "given": given,
         "schedule": {}}
    c["precision_why"] = None if c["precision"] == "auto" else {  # train.derive fills it for auto
        "dtype": c["precision"], "reason": f"--precision {args.precision}" if args.precision else f"the {preset} preset's"}
    c["data"] = args.data and os.path.abspath(args.data)  # the checkpoint must find it from anywhere
    if int(os.environ.get("WORLD_SIZE", 1)) > 1 and args.device.startswith("cuda"):  # torchrun: a GPU per process
        c["device"] = f"cuda:{int(os.environ['LOCAL_RANK'])}"
    counts = ("B", "ar_iters", "mars_iters", "eval_every", "save_every", "batch_size", "buckets")
    if any(c.get(k) is not None and c[k] < 1 for k in counts):
        p.error(f"--{', --'.join(counts)} must be >= 1")
    if c["tasks"] and set(c["tasks"]) - set(TASKS):
        p.error(f"--tasks: unknown families {sorted(set(c['tasks']) - set(TASKS))}; they are {','.join(TASKS)}")
    if not from_hf and (c["n_embd"] % c["n_head"] or (c["n_embd"] // c["n_head"]) % 2):
        p.error("--n_embd must split into --n_head heads of an even width (rotary positions rotate pairs)")
    if (args.ar_weight or 0) < 0 or (args.no_sft and args.ar_weight is not None):
        p.error("--ar_weight must be >= 0, and --no_sft has no clean-stream loss to weight")
    c["ar_weight"] = 0.0 if args.no_sft else 1.0 if args.ar_weight is None else args.ar_weight
    return Config(**c)


def stage2_flags(cfg):
    """What a MARS checkpoint records of its stage-2 flags (and --resume checks)."""
    return {"B": cfg.B, "ar_weight": cfg.ar_weight, "no_sft": cfg.no_sft, "block_offset": cfg.block_offset,
            "targets": cfg.targets, "clean_padding": cfg.clean_padding}


def schedule_of(cfg, name):
    """(batch, steps, peak lr) of stage `name`: the hf preset's as train.derive fitted them to the data, else the preset's
    and the flags'."""
    if name in cfg.schedule:
        s = cfg.schedule[name]
        return s["batch_size"], s["steps"], s["lr"]
    return (cfg.batch_size, cfg.ar_iters, cfg.lr) if name == "ar" else (cfg.batch_size, cfg.mars_iters, cfg.mars_lr)


def show(cfg):
    """The config as the run prints it at its start: one name=value per setting, wrapped."""
    words = [f"{k}={v}" for k, v in sorted(vars(cfg).items()) if k not in ("given", "precision_why")]
    return "config:\n" + textwrap.fill(" ".join(words), 118, initial_indent="  ", subsequent_indent="  ")


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


def fit_hf_schedule(cfg, name, rows, world):
    """Stage `name`'s batch, steps and peak lr by hf_schedule on `rows` training rows (the flags the command line
    gave win), as the checkpoint's train_config records them (schedule)."""
    steps_key, lr_key = ("ar_iters", "lr") if name == "ar" else ("mars_iters", "mars_lr")
    flags = {"batch_size": "batch_size", "steps": steps_key, "lr": lr_key}
    given = {k: getattr(cfg, flag) for k, flag in flags.items() if flag in cfg.given}
    batch, steps, lr, why = hf_schedule(rows, cfg.epochs, given, (cfg.micro_batch or 1) * world)
    return {"rows": rows, "batch_size": batch, "steps": steps, "lr": lr, "why": why}


# ---------------------------------------------------------------------------
# The precision a training forward runs in (--precision auto measures which is faster: precision.py)

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
