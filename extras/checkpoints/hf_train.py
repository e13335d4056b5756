"""MARS fine-tuning of a real (Hugging Face) model: the start of a stage from a Hugging Face directory or a
GGUF file, or from one of our checkpoints trained from one; the hf preset (the paper's recipe) and its schedule.
train.py reaches it through one seam, train.real_model, only when --init_from names a real model:

    python train.py --stage mars --init_from Qwen2.5-0.5B-Instruct/ --data my.jsonl
    python train.py --init_from Qwen2.5-0.5B-Instruct/ --data my.jsonl      # AR SFT on it, then MARS
    python train.py --stage mars --init_from smollm2 --data my.jsonl         # a GGUF file (extras/checkpoints/gguf_file.py)
"""
import math
import os

import torch

import data
from common import load_checkpoint, model_from_checkpoint
from extras.checkpoints.foreign import names_model

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
# train.py's COMMON under these (train.real_model, the seam, joins them).
HF_PRESET = dict(max_seq_len=512, batch_size=384, micro_batch=4, epochs=5, lr=5e-6, mars_lr=5e-6, warmup=0.03,
                 weight_decay=0.0, betas=[0.9, 0.999], eval_every=500, save_every=500, summary_limit=200)


def start_real_stage(name, state, cfg, splits, model_keys):
    """(model, tokenizer, splits, the source's "hf" record, the settings the source fixes) for a stage, or ValueError.
    The directory starts every stage, except that --stage all runs its MARS stage from the AR SFT it has just
    trained (<out_dir>/ar.pt). The settings: the architecture (the recipe's rows within the model's context) and the
    data, which train.derive puts in the run's config."""
    after_ar = cfg.init_from is None or (names_model(cfg.init_from) and name != "ar" and cfg.stage == "all")
    source = state or load_checkpoint(os.path.join(cfg.out_dir, "ar.pt") if after_ar else cfg.init_from)
    if state is None and source.get("stage") not in ("ar", "hf"):
        raise ValueError("--init_from must be a stage-1 (ar) checkpoint, a Hugging Face model directory or a GGUF file")
    model, tok = model_from_checkpoint(source, cfg.device)
    if name == "mars" and source.get("stage") == "hf" and cfg.mask_row == "mean":  # --mask_row, on the real model
        with torch.no_grad():  # tied embeddings: the output row follows, and decoding never emits <|mask|>
            model.wte.weight[tok.mask] = model.wte.weight[:tok.n_vocab].mean(0)
    fixed = {k: source["model_config"][k] for k in model_keys}  # the architecture comes from the checkpoint
    fixed["max_seq_len"] = min(cfg.max_seq_len, fixed["max_seq_len"])  # the recipe's rows, within the context
    prev = source.get("train_config")  # none in a Hugging Face directory
    if prev is None and cfg.data is None:
        raise ValueError("--init_from a real model (a Hugging Face directory or a GGUF file) needs --data (your "
                         "JSONL of {prompt, response} or {messages})")
    fixed["data"] = cfg.data or prev["data"]
    if splits is None:
        splits = data.load_splits(fixed["data"], cfg.seed if prev is None else prev["seed"],
                                  cfg.n_train if prev is None else prev["n_train"])
    return model, tok, splits, source.get("hf"), fixed


def hf_schedule(rows, epochs, given, multiple=1):
    """(batch, steps, peak lr, why) of one stage of the hf preset on `rows` training rows. given: what the command
    line set of "batch_size", "steps" and "lr"; it wins. The rest follows the data: a batch of rows // 50 within
    [16, 384] (at least ~50 steps an epoch), rounded down to a multiple of `multiple` (micro-batch x processes);
    the epochs' steps, at least 200; the paper's lr at its batch of 384 times sqrt(batch / 384)."""
    paper, top = HF_PRESET, HF_PRESET["batch_size"]
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


def fit_schedules(cfg, names, splits, tok, world, say):
    """The schedule of each stage the run trains (its batch, steps and lr follow the rows that fit), for the
    config's `schedule`."""
    schedule = {}
    for name in names:
        rows = len(data.tokenize(splits["train"], tok, cfg.max_seq_len, 1 if name == "ar" else cfg.B))
        s = schedule[name] = fit_hf_schedule(cfg, name, rows, world)
        say(f"schedule ({name}): batch {s['batch_size']}, {s['steps']} steps, peak lr {s['lr']:.3g} on {rows} "
            f"rows ({s['why']})")
    return schedule
