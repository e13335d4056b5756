"""Generate with a MARS checkpoint: several tokens per forward, one threshold.

    python sample.py --threshold 0.9          # held-out prompts, MARS with KV cache
    python sample.py --ar                     # plain AR decoding, for comparison
    python sample.py --prompt "Write 42 in words." --threshold 0.8
    python sample.py --chat                   # type prompts; "/tau 0.7" turns the knob
    python sample.py --ckpt DIR --chat        # a Hugging Face directory, e.g. MARS-Qwen2.5-0.5B-blk4

Every decoder is a short loop around one step (`decode_step`): feed each row's
window [uncached real tokens | drafts | masks] against the KV cache, read the
predictions (the last real token's, which is the AR prediction, then one per
draft and per mask) with their confidences. The loops differ only in what they
commit and what the cache keeps:
  slide        AR (B = 1), threshold (mars.accept) or lossless (lossless_commit),
               uncached or with the sliding cache (masks rolled back every step);
  fill_blocks  the paper's block-level cache for batches (--cache block).
With B-1 masks a window gives B predictions. (B masks give B+1; like the
paper's sampler we use the first B, so the B-th mask would only be computed to
be ignored: under causal attention it cannot change the others.)
"""
import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field

import torch

import data
import hf
import mars
import tokenizer
from cli import Parser, UserError, check_device, run_cli
from model import GPT, GPTConfig

# ---------------------------------------------------------------------------
# Checkpoints


def load_checkpoint(path, device="cpu", dtype=None):
    """The checkpoint dict, or UserError with a one-line reason. `path` is one of our .pt files or a
    Hugging Face model directory (hf.read_checkpoint: weights in dtype, default float32)."""
    check_device(device)
    if os.path.isdir(path):
        try:
            return hf.read_checkpoint(path, device, dtype)
        except (ValueError, OSError, KeyError) as e:
            raise UserError(f"{path}: {e}") from None
    if not os.path.isfile(path):
        raise UserError(f"checkpoint not found: {path} (train one with: python train.py)")
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
        assert isinstance(ckpt, dict) and {"model", "model_config", "tokenizer"} <= ckpt.keys()
        return ckpt
    except Exception:
        raise UserError(f"not a readable checkpoint of this project: {path}") from None


def model_from_checkpoint(ckpt, device="cpu", dtype=None):
    """(model, tokenizer). The model takes the checkpoint's tensors (built on the meta device, so a
    7B model is never initialised at random first), then moves to device and dtype."""
    try:
        with torch.device("meta"):
            model = GPT(GPTConfig(**ckpt["model_config"]))
        model.load_state_dict(ckpt["model"], assign=True)
    except (TypeError, RuntimeError):  # e.g. a checkpoint of the earlier GPT with learned positions
        raise UserError("this checkpoint's weights do not fit this version's GPT (rotary positions): retrain it "
                        "with python train.py") from None
    if model.config.tie_embeddings:  # assign replaced the shared parameter by two
        model.lm_head.weight = model.wte.weight
    return model.to(device=device, dtype=dtype), tokenizer.Tokenizer.from_state(ckpt["tokenizer"])


# ---------------------------------------------------------------------------
# Decoding

CACHE_MODES = ("none", "sliding", "block")


@dataclass
class Generation:
    tokens: list  # generated ids, <|endoftext|> included when reached
    chunks: list = field(default_factory=list)  # what each forward committed (to the output)
    forwards: int = 0  # forwards that committed something for this row
    steps: int = 0  # forwards of the batch while this row was in it, waits and cache writes included
    #                 (our tokens per forward: len(tokens) / steps, summed over rows)
    accepted: int = 0  # tokens the decoding rule accepted for this row, before the cut after <|endoftext|> and
    #                    the budget: the numerator of the official samplers' counter (see `official_tpf`)
    batch_forwards: int = 0  # forwards of the whole batch (one value for all its rows): that counter's denominator
    seconds: float = 0.0  # wall clock of the whole batch


@dataclass
class Row:
    """One sequence being decoded."""
    ids: list  # the real tokens: prompt + everything committed so far
    cached: int = 0  # leading tokens of ids whose keys/values this row's KV cache holds
    drafts: list = field(default_factory=list)  # lossless decoding only: unverified tokens fed after ids
    n_masks: int = 0  # <|mask|> tokens fed after the drafts (B - 1 for MARS; 0 for AR or a tau = 1.0 row)


def window(row, mask_id, cached):
    """What one forward feeds for a row: its uncached real tokens, its drafts, its masks."""
    return row.ids[cached:] + row.drafts + [mask_id] * row.n_masks


@torch.inference_mode()
def decode_step(model, rows, kv, mask_id, *, temperature=0.0, metric="prob", generator=None, n_vocab=None):
    """One decoding forward for a batch of rows.

    kv: a model.KVCache whose row i belongs to rows[i], or None (no cache: the window starts at position 0).
    Row i's window is ids[cached:] + drafts + [mask_id] * n_masks, right-padded; its positions continue from
    `cached`. The cache is rolled back to each row's `cached` before the forward; after it, the cache holds the
    whole window, and the caller rolls back (kv.rollback) to what it keeps.
    Returns (tokens, conf), (len(rows), n_read) tensors, n_read = max over rows of 1 + len(drafts) + n_masks:
    column 0 is the prediction after the last real token (the AR prediction), then one after each draft, then
    one after each mask; a row's conf is 0 beyond its own reads, so mars.accept stops there.
    n_vocab: ids >= n_vocab have no token (a real checkpoint's padding rows) and are never chosen."""
    device = model.wte.weight.device
    start = [0 if kv is None else r.cached for r in rows]
    windows = [window(r, mask_id, s) for r, s in zip(rows, start)]
    width = max(map(len, windows))
    ids = torch.tensor([w + [mask_id] * (width - len(w)) for w in windows], device=device)
    cols = torch.arange(width, device=device)
    positions = torch.tensor(start, device=device)[:, None] + cols
    # reads: from the last real token (column u - 1) to the end of the row's own window
    n_reads = [1 + len(r.drafts) + r.n_masks for r in rows]
    u = torch.tensor([len(r.ids) - s for r, s in zip(rows, start)], device=device)[:, None]
    reads = torch.tensor(n_reads, device=device)[:, None]
    if kv is not None:
        kv.rollback(start)
    flat = model(ids, positions=positions, cache=kv, logits_at=(cols >= u - 1) & (cols < u - 1 + reads))
    own = torch.arange(max(n_reads), device=device) < reads  # (rows, n_read): the row's reads, then padding
    logits = flat.new_zeros(len(rows), max(n_reads), flat.shape[-1])
    logits[own] = flat  # row-major order on both sides
    logits[..., mask_id] = float("-inf")  # a placeholder is never an output
    if n_vocab is not None:
        logits[..., n_vocab:] = float("-inf")  # nor an embedding row past the tokenizer
    tokens, conf = mars.choose(logits, temperature, metric, generator)
    return tokens, conf * own


@torch.inference_mode()
def generate(model, prompts, eot_id, mask_id, *, B=1, tau=1.0, cache="sliding", cache_block=16, lossless=False,
             metric="prob", temperature=0.0, max_accept=None, max_new_tokens=64, trace=None, n_vocab=None):
    """Decode a batch of prompts (lists of ids). Returns one Generation per prompt.
    n_vocab: the tokenizer's size (tok.n_vocab); ids from there on are never emitted (decode_step).

    B: predictions per forward (1 = plain AR decoding).
    tau: threshold, a number or one per prompt (mars.accept).
    cache: none (full forward each step; the reference), sliding (cache the committed
        prefix, roll the masks back after each step) or block (the paper's block-level
        cache, `cache_block` positions per block: see `fill_blocks`).
    lossless: commit only tokens equal to the AR argmax (see `lossless_commit`).
    trace: a list; every forward appends one dict per row: step, row (prompt index),
        fed (the window's ids), tokens and conf (the row's predictions), committed,
        cache_before and cache_after (tokens in the row's cache around the step)."""
    if cache not in CACHE_MODES:
        raise ValueError(f"cache must be one of {CACHE_MODES}")
    if lossless and (cache == "block" or temperature > 0):
        raise ValueError("lossless decoding is greedy, with cache none or sliding")
    max_seq = model.config.max_seq_len
    for p in prompts:
        if len(p) >= max_seq:
            raise ValueError(f"prompt of {len(p)} tokens does not fit the model's context of {max_seq}")
    if not prompts:
        return []
    t0 = clock(model)
    kv = None if cache == "none" else model.new_cache(len(prompts), kv_slots(prompts, max_seq, max_new_tokens, B,
                                                                             cache, cache_block))
    batch = Batch(model, prompts, eot_id, mask_id, kv, max_new_tokens, trace, temperature, metric, n_vocab)
    taus = torch.as_tensor(tau, dtype=torch.float32, device=model.wte.weight.device).expand(len(prompts))
    if cache == "block":
        fill_blocks(batch, B, taus, cache_block, max_accept)
    else:
        slide(batch, B, taus, lossless, max_accept)
    seconds = clock(model) - t0
    for g in batch.out:
        g.seconds, g.batch_forwards = seconds, batch.n_forwards
    return batch.out


def official_tpf(batches):
    """Tokens per forward as the official samplers count it (MARSCachedSampler and MARSBlockCachedSampler,
    global stats): over every batch, the tokens accepted by all its rows, those past <|endoftext|> in the same
    forward or block included, divided by the batch's forwards, each forward counted once whatever the batch
    size. `batches`: one list of Generations per generate call. At batch 1 it differs from ours
    (len(tokens) / steps) only past <|endoftext|>; at batch b it is about b times ours."""
    accepted = sum(g.accepted for gens in batches for g in gens)
    return accepted / max(sum(gens[0].batch_forwards for gens in batches if gens), 1)


def clock(model):
    """time.perf_counter() once the model's device has finished its queued work (CUDA runs asynchronously)."""
    device = model.wte.weight.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def kv_slots(prompts, max_seq, max_new_tokens, B, cache, cache_block):
    """KV-cache slots a batch can need, from its prompts (a 32k context needs no 32k cache for short
    prompts): a forward writes its window, padded to the widest row's, after the longest row's cached
    tokens. A row caches at most its final length - 1; the widest window is 2B - 1 when sliding (the
    last step's tokens or drafts, then B - 1 masks) and cache_block + 1 with the block cache."""
    longest = max(min(len(p) + max_new_tokens, max_seq) for p in prompts)
    widest = cache_block + 1 if cache == "block" else 2 * B - 1
    return longest - 1 + widest


def slide(batch, B, taus, lossless, max_accept):
    """AR (B = 1), threshold and lossless decoding, uncached or with the sliding cache: each
    forward feeds [uncached real tokens | drafts | B-1 masks] and commits what the rule accepts;
    the cache then keeps the real tokens it was fed and drops the rest."""
    for r in batch.rows:
        r.n_masks = B - 1
    while batch.rows:
        tokens, conf = batch.forward()
        if lossless:
            new, drafts = lossless_commit(tokens.tolist(), [r.drafts for r in batch.rows], B)
        else:
            n = mars.accept(conf, taus[batch.index], max_accept)
            new = accepted(n, tokens)
            drafts = [[] for _ in new]
        for k, r in enumerate(batch.rows):
            kept = batch.commit(k, new[k])
            r.drafts = drafts[k] if kept == new[k] else []
            r.cached = len(r.ids) - (1 if lossless else len(kept))  # lossless fed its accepted drafts too
        batch.settle(drop=True)


def fill_blocks(batch, B, taus, cache_block, max_accept):
    """The paper's block-level KV cache (the official MARSBlockCachedSampler).

    Per block of `cache_block` positions: the cache holds the prefix, frozen; each inner
    forward feeds the whole block (its tokens committed so far, then masks up to the block's
    end) and commits left to right among the masks with the threshold, never past the block's
    end. A filled row waits for the others (it is fed, commits nothing). Then one more forward
    writes the block into the cache, and it counts, as does the first, which writes the prompt.
    A block is filled to its end even past <|endoftext|> (the output stops there), and the last
    block is written too. B = 1 (AR) feeds no masks."""
    while True:
        # write every committed token but the last, which opens the next block's windows
        for r in batch.rows:
            r.n_masks = 0
        batch.forward()
        for r in batch.rows:
            r.cached = len(r.ids) - 1
        batch.settle(drop=True)
        if not batch.rows:
            return
        ends = [len(r.ids) + min(cache_block, batch.left[i]) for r, i in zip(batch.rows, batch.index)]
        while any(len(r.ids) < e for r, e in zip(batch.rows, ends)):
            for r, e in zip(batch.rows, ends):
                r.n_masks = max(e - len(r.ids) - 1, 0) if B > 1 else 0
            tokens, conf = batch.forward()
            n = mars.accept(conf, taus[batch.index], max_accept)
            for k, new in enumerate(accepted(n, tokens)):
                if len(batch.rows[k].ids) < ends[k]:
                    batch.commit(k, new, past_eot=True)
            batch.settle(drop=False)


class Batch:
    """The rows decoded together. Row k (of `rows` and of the KV cache) decodes prompt
    index[k]; finished rows leave (kv.keep_rows). Holds the outputs and the trace."""

    def __init__(self, model, prompts, eot_id, mask_id, kv, max_new_tokens, trace, temperature, metric, n_vocab=None):
        self.model, self.eot_id, self.mask_id, self.kv, self.trace = model, eot_id, mask_id, kv, trace
        self.choose = dict(temperature=temperature, metric=metric, n_vocab=n_vocab)
        self.rows = [Row(list(p)) for p in prompts]
        self.index = list(range(len(prompts)))
        self.out = [Generation(tokens=[]) for _ in prompts]
        # tokens each row may still commit: its share of max_new_tokens and of the context
        self.left = [min(max_new_tokens, model.config.max_seq_len - len(p)) for p in prompts]
        self.n_forwards, self.log = 0, []

    def forward(self):
        """decode_step for every row; it counts in every row's steps, and once in the batch's forwards."""
        if self.trace is not None:
            before = [r.cached if self.kv is not None else 0 for r in self.rows]
            self.log = [dict(step=self.n_forwards, row=i, fed=window(r, self.mask_id, c), committed=[],
                             cache_before=c) for i, r, c in zip(self.index, self.rows, before)]
        tokens, conf = decode_step(self.model, self.rows, self.kv, self.mask_id, **self.choose)
        self.n_forwards += 1
        for i in self.index:
            self.out[i].steps += 1
        if self.log:  # only when tracing: the lists cost a transfer from the device
            for e, r, t, c in zip(self.log, self.rows, tokens.tolist(), conf.tolist()):
                n = 1 + len(r.drafts) + r.n_masks
                e.update(tokens=t[:n], conf=c[:n])
        return tokens, conf

    def commit(self, k, new, past_eot=False):
        """Append new tokens to row k, at most what its budget leaves, cut after <|endoftext|>
        unless past_eot (the block cache fills its block). The output stops at <|endoftext|>."""
        i, r, g = self.index[k], self.rows[k], self.out[self.index[k]]
        g.accepted += len(new)
        new = new[:self.left[i]] if past_eot else through_eot(new[:self.left[i]], self.eot_id)
        self.left[i] -= len(new)
        r.ids += new
        shown = [] if g.tokens[-1:] == [self.eot_id] else through_eot(new, self.eot_id)
        if shown:
            g.tokens += shown
            g.chunks.append(shown)
            g.forwards += 1
        if self.log:
            self.log[k]["committed"] = new
        return new

    def settle(self, drop):
        """Roll the cache back to what each row keeps; with drop, finished rows leave."""
        if self.kv is not None:
            self.kv.rollback([r.cached for r in self.rows])
        for e, r in zip(self.log, self.rows):
            e["cache_after"] = r.cached if self.kv is not None else 0
            self.trace.append(e)
        self.log = []
        if not drop:
            return
        still = [k for k, i in enumerate(self.index) if self.left[i] > 0 and self.out[i].tokens[-1:] != [self.eot_id]]
        if len(still) < len(self.rows):
            if self.kv is not None:
                self.kv.keep_rows(still)
            self.rows, self.index = [self.rows[k] for k in still], [self.index[k] for k in still]


def accepted(n, tokens):
    """Each row's first n[i] predictions, the ones mars.accept commits (one host transfer)."""
    return [t[1:1 + t[0]] for t in torch.cat([n[:, None], tokens], dim=1).tolist()]


def through_eot(tokens, eot_id):
    """tokens up to and including the first <|endoftext|>: a sequence ends there."""
    return tokens[:tokens.index(eot_id) + 1] if eot_id in tokens else tokens


def lossless_commit(tokens, drafts, B):
    """Self-speculative verification (beyond the paper).

    For a row with k drafts the window held [last token, k drafts, B-1 masks];
    tokens[0..k] are the AR argmax after the last token and after each draft.
    Accept drafts left to right while each equals the AR token at its place,
    then commit the AR token at the first mismatch (or after the last draft).
    If every draft survived, the masks' predictions become the next drafts;
    otherwise they were made behind a rejected token and are dropped."""
    commits, next_drafts = [], []
    for row, d in zip(tokens, drafts):
        m = 0
        while m < len(d) and d[m] == row[m]:
            m += 1
        commits.append(d[:m] + [row[m]])
        next_drafts.append(row[len(d) + 1:len(d) + B] if m == len(d) else [])
    return commits, next_drafts


# ---------------------------------------------------------------------------
# The command line

def threshold(text):
    try:
        tau = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < tau <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {tau}")
    return tau


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def get_args(argv=None):
    p = Parser(__doc__)
    p.add_argument("--ckpt", default="out/mars.pt", help="checkpoint to sample from (default out/mars.pt)")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable); default: held-out test prompts")
    p.add_argument("--num_prompts", type=int, default=5, help="held-out prompts to answer without --prompt (default 5)")
    p.add_argument("--chat", action="store_true", help="interactive: one prompt per line; '/tau 0.8' sets the threshold")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt instead of text")
    p.add_argument("--ar", action="store_true", help="plain AR decoding with KV cache (works with any checkpoint)")
    p.add_argument("--lossless", action="store_true",
                   help="self-speculative: several tokens per forward, output identical to --ar (greedy)")
    p.add_argument("--threshold", "--tau", dest="tau", type=threshold, default=0.9,
                   help="tau in (0, 1]: commit predictions while their confidence >= tau; 1.0 = one token per forward")
    p.add_argument("--metric", choices=mars.METRICS, default="prob",
                   help="confidence: prob of the token (default), margin top1-top2, or 1 - normalised entropy")
    p.add_argument("--block_size", type=int, default=None, help="B, predictions per forward (default: the checkpoint's)")
    p.add_argument("--max_accept", type=int, default=None, help="commit at most this many tokens per forward")
    p.add_argument("--cache", choices=CACHE_MODES, default="sliding",
                   help="KV cache: sliding (default, fastest), block (the paper's block-level cache), none (reference)")
    p.add_argument("--cache_block", type=int, default=16, help="the paper's B_cache: positions per block of --cache block (default 16)")
    p.add_argument("--batch_size", type=int, default=1, help="prompts decoded together (default 1)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples (Gumbel-max)")
    p.add_argument("--max_new_tokens", type=int, default=64, help="stop after this many tokens (default 64)")
    p.add_argument("--seed", type=int, default=0, help="random seed for sampling")
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default cuda when available)")
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="weights and activations: float32 (default), bfloat16 (to serve a real model on a GPU)")
    args = p.parse_args(argv)
    for name in ("block_size", "cache_block", "batch_size", "max_new_tokens", "num_prompts", "max_accept"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    if args.temperature < 0:
        p.error("--temperature must be >= 0")
    if args.ar and args.lossless:
        p.error("--ar and --lossless are different decoders; choose one")
    if args.lossless and args.temperature > 0:
        p.error("--lossless is greedy: it reproduces --ar exactly, so --temperature does not apply")
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = DTYPES[args.dtype]
    return args


def show(tok, example, g, as_json, colour):
    """One answer: the text, split into what each forward committed, and the statistics;
    for a held-out prompt (its answer known) whether it is right, and if not, what was expected."""
    n, text = len(g.tokens), tok.decode([t for t in g.tokens if t != tok.eot])
    correct = data.check(example, text) if "answer" in example else None
    # our count: every forward the row took part in (the block cache's waits and writes too); see official_tpf
    stats = dict(tokens=n, forwards=g.steps, tokens_per_forward=n / max(g.steps, 1),
                 seconds=g.seconds, tokens_per_second=n / max(g.seconds, 1e-9))
    if as_json:
        known = {} if correct is None else {"correct": correct}
        print(json.dumps({"prompt": example["prompt"], "text": text, **stats, **known,
                          "chunks": [tok.decode(c) for c in g.chunks], "ids": g.tokens}))
        return correct
    pieces = [tok.decode([t for t in c if t != tok.eot]) for c in g.chunks]
    if colour:  # alternate two colours, one per forward
        body = "".join(f"\033[{33 if i % 2 else 36}m{p}\033[0m" for i, p in enumerate(pieces))
    else:
        body = "|".join(pieces)
    verdict = "" if correct is None else "  right" if correct else f"  wrong, expected: {example['answer']}"
    print(f"> {example['prompt']}\n{body}\n  [{n} tokens, {g.steps} forwards, {stats['tokens_per_forward']:.2f} "
          f"tokens/forward, {stats['tokens_per_second']:.0f} tokens/s]{verdict}\n", flush=True)
    return correct


def main(argv=None):
    args = get_args(argv)
    torch.manual_seed(args.seed)
    ckpt = load_checkpoint(args.ckpt, args.device, args.dtype)
    if not (args.chat or args.prompt or "train_config" in ckpt):
        raise UserError(f"{args.ckpt} has no held-out prompts of its own (not trained here): give --prompt or --chat")
    model, tok = model_from_checkpoint(ckpt, args.device, args.dtype)
    model.eval()
    if args.ar:
        B = 1
    elif "mars" not in ckpt:
        raise UserError(f"{args.ckpt} is an AR checkpoint (no MARS block size): use --ar, or a MARS checkpoint")
    else:
        B = args.block_size or ckpt["mars"]["B"]
    decode = dict(B=B, tau=args.tau, cache=args.cache, cache_block=args.cache_block, lossless=args.lossless,
                  metric=args.metric, temperature=args.temperature, max_accept=args.max_accept,
                  max_new_tokens=args.max_new_tokens, n_vocab=tok.n_vocab)
    colour = sys.stdout.isatty()

    def answer(examples, tau):
        """Decode and show each example ({"prompt"}, with "answer" when known); returns how many came out right."""
        right = 0
        for i in range(0, len(examples), args.batch_size):
            batch = examples[i:i + args.batch_size]
            gens = generate(model, [tok.prompt_ids(e["prompt"]) for e in batch], tok.eot, tok.mask, **{**decode, "tau": tau})
            right += sum(bool(show(tok, e, g, args.json, colour)) for e, g in zip(batch, gens))
        return right

    if args.chat:
        tau = args.tau
        print(f"chat with {args.ckpt} (B={B}, tau={tau}); '/tau X' changes the threshold, Ctrl-D ends", file=sys.stderr)
        try:
            for line in sys.stdin:
                line = line.strip()
                if line.startswith("/tau"):
                    try:
                        tau = threshold(line[4:].strip())
                        print(f"tau = {tau}", file=sys.stderr)
                    except argparse.ArgumentTypeError as e:
                        print(f"error: /tau {e}", file=sys.stderr)
                elif line:
                    try:
                        answer([{"prompt": line}], tau)
                    except ValueError as e:  # e.g. a prompt longer than the context: say so, go on
                        print(f"error: {e}", file=sys.stderr)
        except KeyboardInterrupt:
            print(file=sys.stderr)
        return
    if args.prompt:
        answer([{"prompt": p} for p in args.prompt], args.tau)
        return
    cfg = ckpt["train_config"]
    test = data.load_splits(cfg["data"], cfg["seed"], cfg["n_train"])["test"][:args.num_prompts]
    right = answer(test, args.tau)
    print(f"{right}/{len(test)} right", file=sys.stderr if args.json else sys.stdout)  # stdout stays JSON lines


if __name__ == "__main__":
    run_cli(main)
