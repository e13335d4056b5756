"""Prompts the model writes itself, in the style of Magpie (Xu et al. 2024): given only its chat template's
opening of a user turn, an aligned chat model writes a user request, which it then answers (extras.real.distill).

    python -m extras.real.self_prompts --ckpt smollm2 --n 2000 --out out/smollm/self_prompts.jsonl \
        --stats docs/self_prompts_smollm2_cpu.json

Template prompts cover what a generator was written for; the model's own requests follow its own distribution
of users, in any number. Each request is sampled at --temperature with nucleus (top-p) sampling, then kept only
if it is a request the model finished (FILTERS, in order) and not a duplicate: exactly (the same text) or
near-exactly (the same words once case, punctuation and spacing are dropped, or the same first PREFIX_WORDS
words). Samples go to <out>.partial as they come, batch by batch from seeds derived from --seed, so an
interrupted run resumes where it stopped (rerun the same command); --out is written at the end, atomically.
"""
import json
import os
import re
import shlex
import sys
import time

import torch

from common import UserError
from common import Parser, add_device, run_cli
from extras.bench.eval import machine
from extras.checkpoints import foreign
from extras.real.distill import write_json, write_jsonl

PREFIX_WORDS = 10  # two requests that open with the same ten words are one request reworded at its end
MAX_WORDS = 60  # a request longer than this is a passage, not a user's message
OPENERS = ("can", "could", "would", "will", "please", "what", "how", "why", "when", "where", "who", "which", "is",
           "are", "do", "does", "should", "write", "explain", "give", "tell", "describe", "list", "help", "suggest",
           "create", "compare", "summarize", "summarise", "provide", "recommend", "name", "i", "i'm", "i've", "my",
           "imagine", "design", "plan", "make", "find", "show", "calculate", "translate", "rewrite", "generate")
ABOUT_ITSELF = re.compile(r"^(the|this|an?) (ai|assistant|chatbot)\b|^as an ai\b|^you are\b|^user:|^assistant:", re.I)


def opening_ids(tok):
    """The ids the chat template writes before a user's words: its system turn and the opening of a user turn."""
    marker = "\x00request\x00"
    text = tok.chat(tok.messages(marker))
    return tok.chat_ids(text[:text.index(marker)])


def top_p_sample(logits, temperature, top_p, generator):
    """One token per row from softmax(logits / temperature), restricted to the smallest set of tokens whose
    probability reaches top_p (nucleus sampling). Drawn where the logits are, with the generator of that device:
    (rows, vocab) probabilities copied to the host at every token would cost a GPU more than the forward."""
    probs = (logits.float() / temperature).softmax(-1)
    sorted_p, order = probs.sort(-1, descending=True)
    sorted_p[(sorted_p.cumsum(-1) - sorted_p) >= top_p] = 0  # the tokens past the nucleus
    pick = torch.multinomial(sorted_p, 1, generator=generator)
    return order.gather(-1, pick)[:, 0]


@torch.inference_mode()
def sample_batch(model, tok, opening, rows, max_tokens, temperature, top_p, seed):
    """`rows` requests sampled after the opening: [(text, finished)], finished = it ended its turn in budget."""
    device = model.wte.weight.device
    generator = torch.Generator(device).manual_seed(seed)  # the device's: the draws stay there
    cache = model.new_cache(rows, len(opening) + max_tokens)
    window = torch.tensor([opening] * rows, device=device)
    out = torch.full((rows, max_tokens), tok.eot, dtype=torch.long)
    done = torch.zeros(rows, dtype=torch.bool)
    for i in range(max_tokens):
        logits = model(window, cache=cache)[:, -1, :tok.n_vocab]
        logits[:, tok.mask] = float("-inf")  # a placeholder is never an output
        token = top_p_sample(logits, temperature, top_p, generator).cpu()
        out[:, i] = torch.where(done, tok.eot, token)
        done |= token == tok.eot
        if done.all():
            break
        window = token[:, None].to(device)
    return [(tok.answer(row.tolist()), bool(d)) for row, d in zip(out, done)]


def rejection(text, finished, specials):
    """Why a sampled request is not kept (None: it is kept), in FILTERS' order."""
    words = text.split()
    if not words:
        return "empty"
    if not finished:
        return "cut off"
    if len(words) > MAX_WORDS:
        return "too long"
    if any(s in text for s in specials) or ABOUT_ITSELF.search(text.strip()):
        return "not a request"
    if "?" not in text and words[0].lower().strip("\"'*,.:") not in OPENERS:
        return "not a request"
    return None


FILTERS = ("empty", "cut off", "too long", "not a request")


def near_keys(text):
    """Keys under which two requests count as one: the normalised text, and its first PREFIX_WORDS words."""
    words = re.sub(r"[^\w\s]", "", text.lower()).split()
    return ["full " + " ".join(words)] + (["prefix " + " ".join(words[:PREFIX_WORDS])]
                                          if len(words) > PREFIX_WORDS else [])


class Deduplicator:
    """Remembers the requests kept so far: exact and near-exact duplicates of one are rejected."""

    def __init__(self):
        self.exact, self.near = set(), set()

    def reason(self, text):
        if text.strip() in self.exact:
            return "duplicate"
        keys = near_keys(text)
        if self.near.intersection(keys):
            return "near duplicate"
        self.exact.add(text.strip())
        self.near.update(keys)
        return None


def read_samples(path):
    """The batches an interrupted run left in path: {batch index: [sample]}; a line the interruption cut is dropped."""
    batches = {}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    continue
                batches.setdefault(r["batch"], []).append(r)
    return batches


def self_prompts(model, tok, n, path, args, say=print):
    """The first n kept requests, [{"prompt", "source": "self"}], sampling batch after batch (resuming from the
    samples path holds) until n are kept; and what became of the samples: how many were read, and why each
    dropped one was (FILTERS, then duplicates)."""
    opening, specials = opening_ids(tok), [s for s in tok.specials if s != "<|endoftext|>"]
    batches = {k: v for k, v in read_samples(path).items() if len(v) == args.batch}  # whole batches only
    if batches:
        say(f"resuming: {len(batches)} batches of samples were already in {path}")
    kept, dropped, dedup, read, t0, t_line = [], {}, Deduplicator(), 0, time.time(), time.time()
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for k in sorted(batches) for r in batches[k])
        for k in range(max(1, 50 * n // args.batch)):  # a bound: a model that never writes a request stops
            if k not in batches:
                samples = sample_batch(model, tok, opening, args.batch, args.max_tokens, args.temperature, args.top_p,
                                       args.seed * 1_000_003 + k)
                batches[k] = [{"batch": k, "text": t, "finished": d} for t, d in samples]
                f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in batches[k])
                f.flush()
            for r in batches[k]:
                read += 1
                why = rejection(r["text"], r["finished"], specials) or dedup.reason(r["text"])
                if why:
                    dropped[why] = dropped.get(why, 0) + 1
                else:
                    kept.append({"prompt": r["text"].strip(), "source": "self"})
                if len(kept) == n:
                    return kept, {"read": read, "kept": n, "dropped": dropped}
            if time.time() - t_line > 30:
                t_line, rate = time.time(), len(kept) / (time.time() - t0)
                say(f"self-written prompts: {len(kept)}/{n} kept of {read} read | "
                    f"ETA {(n - len(kept)) / max(rate, 1e-9) / 60:.1f} min")
    raise UserError(f"only {len(kept)} requests kept of {n} asked for after {read} samples: is this a chat model?")


def add_sampling_flags(p):
    """The flags of the requests' sampling."""
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the requests (default 1.0)")
    p.add_argument("--top_p", type=float, default=0.95, help="nucleus sampling: the smallest set of tokens whose "
                   "probability reaches this (default 0.95)")
    p.add_argument("--max_tokens", type=int, default=48, help="a request's budget in tokens; one that does not end "
                   "its turn within it is dropped as cut off (default 48)")
    p.add_argument("--batch", type=int, default=64, help="requests sampled together (default 64)")


def check_sampling_flags(p, args):
    if not (args.temperature > 0 and 0 < args.top_p <= 1 and args.max_tokens >= 1 and args.batch >= 1):
        p.error("--temperature must be > 0, --top_p in (0, 1], --max_tokens and --batch at least 1")


def get_args(argv=None):
    p = Parser(__doc__)
    p.add_argument("--ckpt", default="smollm2", help="the chat model that writes the requests (default smollm2)")
    p.add_argument("--n", type=int, default=2000, help="requests to keep (default 2000)")
    p.add_argument("--out", required=True, help="the JSONL to write: one {prompt, source} per kept request")
    p.add_argument("--stats", help="a JSON to write what was kept and dropped, 20 examples and the command to")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling (default 0)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the model's weights while "
                   "sampling (default float32; bfloat16 is faster on CPUs and GPUs with native bf16)")
    add_sampling_flags(p)
    add_device(p)
    args = p.parse_args(argv)
    check_sampling_flags(p, args)
    if args.n < 1:
        p.error("--n must be at least 1")
    return args


def statistics(command, kept, counts, args, seconds):
    """What the sampling made, for docs/: the distinct share among the requests that passed the filters."""
    duplicates = counts["dropped"].get("duplicate", 0) + counts["dropped"].get("near duplicate", 0)
    return {"command": command, "machine": machine(), "ckpt": args.ckpt, "n": len(kept), **counts,
            "distinct_share": round(len(kept) / (len(kept) + duplicates), 4),
            "fields": {"read": "samples read until n were kept", "distinct_share": "kept over kept plus duplicates "
                       "(exact and near-exact): the share of the requests that passed the filters that are distinct"},
            "sampling": {k: getattr(args, k) for k in ("temperature", "top_p", "max_tokens", "batch", "seed", "dtype")},
            "examples": [r["prompt"] for r in kept[:20]], "seconds": round(seconds, 1)}


def main(argv=None):
    args, t0 = get_args(argv), time.time()
    command = shlex.join(["python", "-m", "extras.real.self_prompts", *(sys.argv[1:] if argv is None else argv)])
    _, model, tok = foreign.load(args.ckpt, args.device, getattr(torch, args.dtype))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    try:
        kept, counts = self_prompts(model.eval(), tok, args.n, args.out + ".partial", args)
    except KeyboardInterrupt:
        raise KeyboardInterrupt(f"the samples so far are in {args.out}.partial; rerun the same command to resume") \
            from None
    write_jsonl(args.out, kept)
    os.remove(args.out + ".partial")
    print(f"{args.out}: {len(kept)} requests kept of {counts['read']} read; dropped: {counts['dropped']}")
    if args.stats:
        stats = statistics(command, kept, counts, args, time.time() - t0)
        write_json(args.stats, stats)
        print(f"{args.stats}: distinct share {stats['distinct_share']}")


if __name__ == "__main__":
    run_cli(main)
