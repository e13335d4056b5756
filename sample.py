"""Generate with a MARS checkpoint: several tokens per forward, one threshold.

    python sample.py --threshold 0.9          # held-out prompts, MARS with KV cache
    python sample.py --ar                     # plain AR decoding, for comparison
    python sample.py --prompt "Write 42 in words." --threshold 0.8
    python sample.py --chat                   # type prompts; "/tau 0.7" turns the knob

Every decoder is the same loop (`generate`): feed the window [uncached real
tokens | drafts | B-1 masks] against the KV cache, read B predictions (the
last real token's, which is the AR prediction, then one per mask), commit a
prefix of them, roll the cache back to the committed tokens. AR decoding is
the case B = 1. (B masks give B+1 predictions; like the paper's sampler we
use the first B, so the B-th mask would only be computed to be ignored: under
causal attention it cannot change the others, and we leave it out.)
"""
import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field

import torch

import data
import mars
from model import GPT, GPTConfig

# ---------------------------------------------------------------------------
# Checkpoints and command-line conventions, shared by every CLI (train, eval, serve sit above)


class UserError(Exception):
    """A problem the user can fix: reported as one line, exit code 1."""


def run_cli(main):
    """Run a command-line main: a user's mistake becomes one line on stderr and exit 1."""
    try:
        main()
    except (UserError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line, for every CLI of the project."""

    def __init__(self, doc):
        super().__init__(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)

    def error(self, message):
        self.exit(2, f"error: {message} (see --help)\n")


def load_checkpoint(path, device="cpu"):
    """The checkpoint dict, or UserError with a one-line reason."""
    if not os.path.isfile(path):
        raise UserError(f"checkpoint not found: {path} (train one with: python train.py)")
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
        assert isinstance(ckpt, dict) and {"model", "model_config", "tokenizer"} <= ckpt.keys()
        return ckpt
    except Exception:
        raise UserError(f"not a readable checkpoint of this project: {path}") from None


def model_from_checkpoint(ckpt, device="cpu"):
    model = GPT(GPTConfig(**ckpt["model_config"]))
    model.load_state_dict(ckpt["model"])
    return model.to(device), data.Tokenizer.from_state(ckpt["tokenizer"])


# ---------------------------------------------------------------------------
# Decoding

CACHE_MODES = ("none", "sliding", "block")


@dataclass
class Generation:
    tokens: list  # generated ids, <|endoftext|> included when reached
    chunks: list = field(default_factory=list)  # what each forward committed
    forwards: int = 0  # forwards that committed something for this row
    seconds: float = 0.0  # wall clock of the whole batch


@torch.inference_mode()
def generate(model, prompts, eot_id, mask_id, *, B=1, tau=1.0, cache="sliding", cache_block=16,
             lossless=False, metric="prob", temperature=0.0, max_accept=None, max_new_tokens=64):
    """Decode a batch of prompts (lists of ids). Returns one Generation per prompt.

    B: predictions per forward (1 = plain AR decoding).
    tau: threshold, a number or one per prompt (mars.accept).
    cache: none (full forward each step; the reference), sliding (cache the
        committed prefix, roll the mask entries back after each step) or block
        (the paper's block-level cache for batches: the prefix is cached once
        per `cache_block` committed tokens, when every row has filled its
        block; rows that have filled it wait). All three commit the same tokens.
    lossless: commit only tokens equal to the AR argmax (see `lossless_commit`).
    """
    if cache not in CACHE_MODES:
        raise ValueError(f"cache must be one of {CACHE_MODES}")
    if lossless and (cache == "block" or temperature > 0):
        raise ValueError("lossless decoding is greedy, with cache none or sliding")
    if not prompts:
        return []
    device = model.wte.weight.device
    max_seq = model.config.max_seq_len
    for p in prompts:
        if len(p) >= max_seq:
            raise ValueError(f"prompt of {len(p)} tokens does not fit the model's context of {max_seq}")
    seqs = [list(p) for p in prompts]
    out = [Generation(tokens=[]) for _ in prompts]
    n_read = 2 * B - 1 if lossless else B  # lossless reads up to B-1 drafts, then B predictions
    drafts = [[] for _ in prompts]
    active = list(range(len(prompts)))
    taus = torch.as_tensor(tau, dtype=torch.float32, device=device).expand(len(prompts))
    kv = None if cache == "none" else model.new_cache(len(prompts), max_seq + max(map(len, prompts)) + cache_block + 2 * B)
    cached = [0] * len(prompts)  # tokens of each row in the KV cache
    step, t0 = 0, time.time()
    while active:
        pre = [len(seqs[r]) for r in active]
        # block cache: extend only when every row has filled its block (and at the prefill);
        # until then a row that has filled it waits (commits nothing), so every row commits
        # exactly what the sliding cache would, only the caching differs
        filled = [n - cached[r] >= cache_block for n, r in zip(pre, active)]
        extend = cache != "block" or step == 0 or all(filled)
        budget = [0 if f and not extend else min(max_new_tokens - len(out[r].tokens), max_seq - n)
                  for f, n, r in zip(filled, pre, active)]

        # the window: [uncached real tokens | drafts | masks], right-padded with masks
        start = [0 if kv is None else cached[r] for r in active]
        uncached = [seqs[r][s:] + drafts[r] for r, s in zip(active, start)]
        u = torch.tensor([n - s for n, s in zip(pre, start)], device=device)[:, None]
        width = max(len(w) - len(drafts[r]) for w, r in zip(uncached, active)) + n_read - 1
        ids = torch.tensor([w + [mask_id] * (width - len(w)) for w in uncached], device=device)
        cols = torch.arange(width, device=device)
        positions = (torch.tensor(start, device=device)[:, None] + cols).clamp(max=max_seq - 1)
        read = (cols >= u - 1) & (cols < u - 1 + n_read)
        if kv is not None:
            kv.rollback(start)
        logits = model(ids, positions=positions, cache=kv, logits_at=read).view(len(active), n_read, -1)
        step += 1

        tokens, conf = mars.choose(logits, temperature, metric)
        if lossless:
            proposals, drafts_next = lossless_commit(tokens.tolist(), [drafts[r] for r in active], B)
        else:
            n = mars.accept(conf, taus[active], max_accept)
            rows = torch.cat([n[:, None], tokens], dim=1).tolist()  # one host transfer per step
            proposals, drafts_next = [row[1:1 + row[0]] for row in rows], [[] for _ in active]

        still = []
        for i, r in enumerate(active):
            new = proposals[i][:max(budget[i], 0)]
            if eot_id in new:
                new = new[:new.index(eot_id) + 1]
            if new:
                seqs[r] += new
                out[r].tokens += new
                out[r].chunks.append(new)
                out[r].forwards += 1
            drafts[r] = drafts_next[i] if new == proposals[i] else []
            if extend:  # keep the committed part of the window: real tokens and accepted drafts
                cached[r] = pre[i] + (max(len(new) - 1, 0) if lossless else 0)
            finished = eot_id in new or len(out[r].tokens) >= max_new_tokens or len(seqs[r]) >= max_seq
            if not finished:
                still.append(i)
        if kv is not None and len(still) < len(active):
            kv.keep_rows(still)
        active = [active[i] for i in still]
    seconds = time.time() - t0
    for g in out:
        g.seconds = seconds
    return out


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
                   help="KV cache: sliding (default, fastest), block (the paper's, for batches), none (reference)")
    p.add_argument("--cache_block", type=int, default=16, help="tokens per block of the block cache (default 16)")
    p.add_argument("--batch_size", type=int, default=1, help="prompts decoded together (default 1)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples (Gumbel-max)")
    p.add_argument("--max_new_tokens", type=int, default=64, help="stop after this many tokens (default 64)")
    p.add_argument("--seed", type=int, default=0, help="random seed for sampling")
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default cuda when available)")
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
    return args


def show(tok, text_prompt, g, as_json, colour):
    n = len(g.tokens)
    stats = dict(tokens=n, forwards=g.forwards, tokens_per_forward=n / max(g.forwards, 1),
                 seconds=g.seconds, tokens_per_second=n / max(g.seconds, 1e-9))
    if as_json:
        text = tok.decode([t for t in g.tokens if t != tok.eot])
        print(json.dumps({"prompt": text_prompt, "text": text, **stats, "chunks": [tok.decode(c) for c in g.chunks]}))
        return
    pieces = [tok.decode(c).replace("<|endoftext|>", "") for c in g.chunks]
    if colour:  # alternate two colours, one per forward
        body = "".join(f"\033[{33 if i % 2 else 36}m{p}\033[0m" for i, p in enumerate(pieces))
    else:
        body = "|".join(pieces)
    print(f"> {text_prompt}\n{body}\n  [{n} tokens, {g.forwards} forwards, "
          f"{stats['tokens_per_forward']:.2f} tokens/forward, {stats['tokens_per_second']:.0f} tokens/s]\n", flush=True)


def main(argv=None):
    args = get_args(argv)
    torch.manual_seed(args.seed)
    ckpt = load_checkpoint(args.ckpt, args.device)
    model, tok = model_from_checkpoint(ckpt, args.device)
    model.eval()
    if args.ar:
        B = 1
    elif "mars" not in ckpt:
        raise UserError(f"{args.ckpt} is a stage-1 (AR) checkpoint: use --ar, or a MARS checkpoint (mars.pt)")
    else:
        B = args.block_size or ckpt["mars"]["B"]
    decode = dict(B=B, tau=args.tau, cache=args.cache, cache_block=args.cache_block, lossless=args.lossless,
                  metric=args.metric, temperature=args.temperature, max_accept=args.max_accept,
                  max_new_tokens=args.max_new_tokens)
    colour = sys.stdout.isatty()

    def answer(prompts, tau):
        for i in range(0, len(prompts), args.batch_size):
            batch = prompts[i:i + args.batch_size]
            gens = generate(model, [tok.prompt_ids(p) for p in batch], tok.eot, tok.mask, **{**decode, "tau": tau})
            for p, g in zip(batch, gens):
                show(tok, p, g, args.json, colour)

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
                        answer([line], tau)
                    except ValueError as e:  # e.g. a prompt longer than the context: say so, go on
                        print(f"error: {e}", file=sys.stderr)
        except KeyboardInterrupt:
            print(file=sys.stderr)
        return
    if args.prompt:
        prompts = args.prompt
    else:
        cfg = ckpt["train_config"]
        prompts = [e["prompt"] for e in data.load_splits(cfg["data"], cfg["seed"], cfg["n_train"])["test"][:args.num_prompts]]
    answer(prompts, args.tau)


if __name__ == "__main__":
    run_cli(main)
