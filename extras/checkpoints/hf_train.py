"""MARS fine-tuning of a real (Hugging Face) model: the paper's recipe and the start of a stage from a
Hugging Face directory or a GGUF file, or from one of our checkpoints trained from one. train.py (and
config.py, its command line) import this module on that path only:

    python train.py --stage mars --init_from Qwen2.5-0.5B-Instruct/ --data my.jsonl
    python train.py --init_from Qwen2.5-0.5B-Instruct/ --data my.jsonl      # AR SFT on it, then MARS
    python train.py --stage mars --init_from smollm2 --data my.jsonl         # a GGUF file (extras/checkpoints/gguf_file.py)
"""
import math
import os

import data
from cli import UserError, load_checkpoint, model_from_checkpoint
from extras.checkpoints.gguf_file import SHORT_NAMES

# The paper's recipe for a real instruct model (the default preset when --init_from is a Hugging Face directory;
# the model's shape comes from its config.json): lr 5e-6 in both stages, linear warmup 3% then cosine to zero,
# AdamW with weight decay 0 and transformers' default betas (0.9, 0.999), rows of at most 512 tokens, bf16
# autocast where the device runs it faster (train.py times it: config.choose_dtype),
# 5 epochs per stage (the steps follow from the data), effective batch 384 (the authors': 48 per GPU x 8 GPUs;
# here 4 per forward, the rest accumulated: 96 forwards per step on one GPU).
PRESET = dict(max_seq_len=512, batch_size=384, micro_batch=4, epochs=5, lr=5e-6, mars_lr=5e-6, warmup=0.03,
              weight_decay=0.0, betas=[0.9, 0.999], eval_every=500, save_every=500,
              summary_limit=200)


def is_model(path):
    """Whether --init_from names a real model itself (a Hugging Face directory, a GGUF file or an installed
    one's short name), not one of our checkpoints."""
    return os.path.isdir(path) or path.endswith(".gguf") or path in SHORT_NAMES and not os.path.exists(path)


def start_stage(name, state, args, splits, model_keys):
    """(model, tokenizer, splits, the source's "hf" record) for a stage. The directory starts every stage,
    except that --stage all runs its MARS stage from the AR SFT it has just trained (<out_dir>/ar.pt)."""
    after_ar = args.init_from is None or (is_model(args.init_from) and name != "ar" and args.stage == "all")
    source = state or load_checkpoint(os.path.join(args.out_dir, "ar.pt") if after_ar else args.init_from)
    if state is None and source.get("stage") not in ("ar", "hf"):
        raise UserError("--init_from must be a stage-1 (ar) checkpoint, a Hugging Face model directory or a GGUF file")
    model, tok = model_from_checkpoint(source, args.device)
    limit = args.max_seq_len
    for k in model_keys:  # the architecture comes from the checkpoint
        setattr(args, k, source["model_config"][k])
    args.max_seq_len = min(limit, args.max_seq_len)  # the recipe's rows (512 tokens), within the model's context
    if splits is None:
        prev = source.get("train_config")  # none in a Hugging Face directory
        if prev is None and args.data is None:
            raise UserError("--init_from a real model (a Hugging Face directory or a GGUF file) needs --data (your "
                            "JSONL of {prompt, response} or {messages})")
        args.data = args.data or prev["data"]
        splits = data.load_splits(args.data, args.seed if prev is None else prev["seed"],
                                  args.n_train if prev is None else prev["n_train"])
    key = "ar_iters" if name == "ar" else "mars_iters"
    if getattr(args, key) is None:  # the recipe counts epochs over the rows that fit
        rows = data.tokenize(splits["train"], tok, args.max_seq_len, 1 if name == "ar" else args.block_size)
        setattr(args, key, math.ceil(args.epochs * len(rows) / args.batch_size))
    return model, tok, splits, source.get("hf")
