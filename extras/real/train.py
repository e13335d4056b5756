"""MARS on a real model, and the options beyond the paper: train.py's loop with every flag
of train.py, and --init_from a real model (a Hugging Face directory, a GGUF file, an
installed one's short name such as smollm2, or one of our checkpoints trained from one), its
recipe (--preset hf, the default there) and the options of extras/real/options.py.

    python -m extras.real.train --init_from Qwen2.5-0.5B-Instruct/ --data my.jsonl
    python -m extras.real.train --stage mars --init_from smollm2 --data my.jsonl
    python -m extras.real.train --stage mars --init_from out/ar.pt --no_sft  # the toy
    torchrun --standalone --nproc_per_node=2 -m extras.real.train --init_from DIR --data my.jsonl

--data reads {"messages": [...]} (rendered by the model's chat template; the last assistant
turn is trained) and {"prompt", "response"} (extras/real/records.py). A real model starts
every stage, except that --stage all runs stage 2 from the stage 1 it has just trained. A
checkpoint records where a real model's run started ("hf"), and a MARS checkpoint its
stage-2 flags ("mars"), which --resume holds a run to.
"""
import argparse
import math
import os
import sys

import torch

import data
import train
from common import Parser, UserError, build_model, run_cli
from extras.checkpoints import foreign
from extras.checkpoints.hf_tokenizer import tokenizer_from_state
from extras.real import options, records

# hf: the paper's recipe for a real instruct model (its shape comes from its config.json):
# lr 5e-6 in both stages, linear warmup 3% then cosine to zero, AdamW with weight decay 0
# and transformers' default betas, rows of at most 512 tokens, EPOCHS per stage, effective
# batch 384 (the authors': 48 per GPU x 8 GPUs; here 4 per forward, the rest accumulated).
# On a few thousand rows, 384 a step leaves a few dozen steps, which train almost nothing:
# unless the flags say otherwise, hf_schedule fits the batch, steps and lr to the data.
EPOCHS = 5
HF_PRESET = dict(train.PRESETS["gpu"], max_seq_len=512, batch_size=384, micro_batch=4,
                 lr=5e-6, mars_lr=5e-6, warmup=0.03, weight_decay=0.0, betas=[0.9, 0.999],
                 optimizer="adamw", schedule="cosine", eval_every=500, save_every=500,
                 summary_limit=200)
PRESETS = {**train.PRESETS, "hf": HF_PRESET}
FITTED = ("batch_size", "ar_iters", "mars_iters", "lr", "mars_lr")  # a flag beats the fit


def add_flags(p):
    """The options beyond the paper (extras/real/options.py)."""
    p.prog, p.description = "python -m extras.real.train", __doc__
    g = p.add_argument_group("beyond the paper").add_argument
    g("--no_sft", action="store_true", help="the paper's 'w/o SFT loss' ablation: no "
      "clean-stream loss, each sequence's noisy loss weighted 1/t, t ~ U[0.001, 1)")
    g("--block_offset", choices=["fixed", "random"], default="fixed", help="fixed: the "
      "paper's blocks, at multiples of B (default); random: shifted by a random offset every "
      "step")
    g("--targets", choices=["hard", "soft"], default="hard", help="hard: the data's tokens "
      "(default, the paper's); soft: the distribution of the model stage 2 starts from, "
      "frozen, at every response position of both streams")
    g("--clean_padding", choices=["keep", "drop"], default="keep", help="the end-of-turn "
      "padding to B's multiple as clean-stream targets: keep (default, the paper's) or drop")
    g("--mask_row", choices=["own", "mean"], default="own", help="a real model only: its "
      "<|mask|> embedding row at the start of stage 2: own (the reused token's) or mean (the "
      "mean of the rows)")


def set_by(argv, keys):
    """Which of keys the command line sets (read as the root's parser reads flags)."""
    p = argparse.ArgumentParser(add_help=False)
    for k in keys:
        p.add_argument(f"--{k}")
    known = vars(p.parse_known_args(argv)[0])
    return [k for k in keys if known[k] is not None]


def starts_from_real(path):
    """Whether a run starts from a real model: one named by path, or our checkpoint trained
    from one (it records "hf"; read with mmap, so its tensors stay on disk)."""
    if path is None or foreign.names_model(path):
        return path is not None
    try:
        return "hf" in torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception:  # a missing or unreadable file: its stage says so when it loads it
        return False


def get_config(argv=None):
    """train.get_config over these presets and flags; the hf preset by default for a real
    model (a --preset given on the command line wins)."""
    argv = [str(a) for a in (sys.argv[1:] if argv is None else argv)]
    cfg = train.get_config(argv, PRESETS, add_flags)
    stage2 = cfg.stage in ("mars", "control")  # by default from <out_dir>/ar.pt
    default = os.path.join(cfg.out_dir, "ar.pt") if stage2 else None
    real = starts_from_real(cfg.init_from or default)
    if real:
        cfg = train.get_config(["--preset", "hf", *argv], PRESETS, add_flags)
    error = Parser(__doc__).error
    if cfg.preset == "hf" and not real:
        error("--preset hf fine-tunes a real model: --init_from a Hugging Face directory, "
              "a .gguf file or an installed one's short name (smollm2)")
    if cfg.mask_row != "own" and not real:
        error("--mask_row is for a real model: the toy learns its <|mask|> row")
    flags = set_by(argv, [*FITTED, "ar_weight"])
    if cfg.no_sft and "ar_weight" in flags:
        error("--no_sft has no clean-stream loss to weight: leave out --ar_weight")
    return cfg.replace(from_hf=real, hf=None, hf_schedule={}, given=flags,
                       ar_weight=0.0 if cfg.no_sft else cfg.ar_weight)


# ---------------------------------------------------------------------------
# Where a stage starts

def start(name, state, cfg, splits, say):
    """train.start_stage for the toy. A real model: (model, tokenizer, splits, the settings
    its source fixes: the shape, the data and where the run started)."""
    if not cfg.from_hf:
        return train.start_stage(name, state, cfg, splits, say)
    first = cfg.init_from and not (foreign.names_model(cfg.init_from) and name != "ar"
                                   and cfg.stage == "all")
    path = cfg.init_from if first else os.path.join(cfg.out_dir, "ar.pt")
    source = state or foreign.read_checkpoint(path, cfg.device)
    if state is None and source.get("stage") not in ("ar", "hf"):
        raise UserError(f"--init_from {path}: a real model, or a stage-1 (ar) checkpoint "
                        "trained from one")
    model = build_model(source, cfg.device)
    tok = tokenizer_from_state(source["tokenizer"])
    if name == "mars" and source.get("stage") == "hf" and cfg.mask_row == "mean":
        with torch.no_grad():  # tied embeddings: the output row follows; decoding bans it
            model.wte.weight[tok.mask] = model.wte.weight[:tok.n_vocab].mean(0)
    prev = source.get("train_config")  # none in a real model's own files
    if prev is None and cfg.data is None:
        raise UserError(f"--init_from {path} needs --data: your JSONL of {{messages}} or "
                        "{prompt, response}")
    fixed = {k: source["model_config"][k] for k in train.MODEL_KEYS}
    fixed.update(max_seq_len=min(cfg.max_seq_len, fixed["max_seq_len"]),  # the context's
                 data=cfg.data or prev["data"], hf=source.get("hf"))
    if splits is None:
        seed, n = (cfg.seed, cfg.n_train) if prev is None else (prev["seed"], prev["n_train"])
        splits = data.load_splits(fixed["data"], seed, n, read=records.read_record)
    return model, tok, splits, fixed


# ---------------------------------------------------------------------------
# The hf preset's schedule, fitted to the data

def hf_schedule(rows, epochs, given, multiple=1):
    """(batch, steps, peak lr, why) of one stage of the hf preset on `rows` training rows.
    given: what the command line set of "batch_size", "steps" and "lr"; it wins. The rest
    follows the data: a batch of rows // 50 within [16, 384] (at least ~50 steps an
    epoch), rounded down to a multiple of `multiple` (micro-batch x processes); the epochs'
    steps, at least 200; the paper's lr at its batch of 384 times sqrt(batch / 384):
    square-root scaling, the usual rule for Adam (a batch k times smaller has gradients
    sqrt(k) times noisier)."""
    paper, top = HF_PRESET["lr"], HF_PRESET["batch_size"]
    fit = max(multiple, min(max(rows // 50, 16), top) // multiple * multiple)
    batch = given.get("batch_size") or fit
    steps = given.get("steps") or max(200, math.ceil(epochs * rows / batch))
    lr = given["lr"] if "lr" in given else paper * math.sqrt(batch / top)
    of = f", a multiple of {multiple}" if multiple > 1 else ""
    why = ["batch given" if "batch_size" in given else
           f"batch: rows // 50 = {rows // 50}, within [16, {top}]{of}",
           "steps given" if "steps" in given else
           f"steps: {epochs} epochs of {rows} rows, at least 200",
           "lr given" if "lr" in given else f"lr: {paper:g} x sqrt({batch} / {top})"]
    return batch, steps, lr, "; ".join(why)


def stage_keys(name):
    """The config's steps and peak lr of a stage (the control's are stage 2's)."""
    return ("ar_iters", "lr") if name == "ar" else ("mars_iters", "mars_lr")


def fit_hf_schedule(cfg, name, rows, world):
    """Stage `name`'s batch, steps and peak lr by hf_schedule on `rows` training rows (the
    flags the command line gave win), as the checkpoint records them (hf_schedule)."""
    steps_key, lr_key = stage_keys(name)
    flags = {"batch_size": "batch_size", "steps": steps_key, "lr": lr_key}
    given = {k: getattr(cfg, flag) for k, flag in flags.items() if flag in cfg.given}
    multiple = (cfg.micro_batch or 1) * world
    batch, steps, lr, why = hf_schedule(rows, EPOCHS, given, multiple)
    return {"rows": rows, "batch_size": batch, "steps": steps, "lr": lr, "why": why}


def make_stage(name, model, tok, splits, cfg, rank=0, world=1, state=None):
    """options.Stage; under the hf preset, with the batch, steps and peak lr fitted to the
    rows of this stage that fit."""
    if cfg.preset == "hf":
        multiple = 1 if name == "ar" else cfg.B
        rows = len(data.tokenize(splits["train"], tok, cfg.max_seq_len, multiple))
        s = fit_hf_schedule(cfg, name, rows, world)
        if rank == 0:
            print(f"schedule ({name}): batch {s['batch_size']}, {s['steps']} steps, peak "
                  f"lr {s['lr']:.3g} on {rows} rows ({s['why']})", flush=True)
        steps_key, lr_key = stage_keys(name)
        fitted = {"batch_size": s["batch_size"], steps_key: s["steps"], lr_key: s["lr"]}
        cfg = cfg.replace(**fitted, hf_schedule={**cfg.hf_schedule, name: s})
    return options.Stage(name, model, tok, splits, cfg, rank, world, state)


def main(argv=None):
    train.run(get_config(argv), make_stage=make_stage, start=start)


if __name__ == "__main__":
    run_cli(main)
