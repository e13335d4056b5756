"""MARS fine-tuning of a real (Hugging Face) model: the start of a stage from a Hugging Face directory or a
GGUF file, or from one of our checkpoints trained from one. train.py reaches it through checkpoint.foreign() on that
path only; its recipe is config.PRESETS["hf"], its schedule config.hf_schedule:

    python train.py --stage mars --init_from Qwen2.5-0.5B-Instruct/ --data my.jsonl
    python train.py --init_from Qwen2.5-0.5B-Instruct/ --data my.jsonl      # AR SFT on it, then MARS
    python train.py --stage mars --init_from smollm2 --data my.jsonl         # a GGUF file (extras/checkpoints/gguf_file.py)
"""
import os

import torch

import data
from extras.checkpoints.gguf_file import SHORT_NAMES


def names_model(path):
    """Whether a path names a real model itself (a Hugging Face directory, a GGUF file, or an installed GGUF
    file's short name, e.g. smollm2, where no file or directory has that name), not one of our checkpoints."""
    return os.path.isdir(path) or path.endswith(".gguf") or path in SHORT_NAMES and not os.path.exists(path)


def start_real_stage(name, state, cfg, splits, model_keys, load_checkpoint, model_from_checkpoint):
    """(model, tokenizer, splits, the source's "hf" record, the settings the source fixes) for a stage, or ValueError.
    The directory starts every stage, except that --stage all runs its MARS stage from the AR SFT it has just
    trained (<out_dir>/ar.pt). The settings: the architecture (the recipe's rows within the model's context) and the
    data, which train.derive puts in the run's config. load_checkpoint, model_from_checkpoint: checkpoint.py's
    (train.py passes them: nothing in extras/checkpoints imports it)."""
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
