"""Sample from a MARS checkpoint: several tokens per forward, one threshold.

    python sample.py --threshold 0.9    # held-out prompts; --ar: plain AR decoding
    python sample.py --chat             # type prompts; "/tau 0.7" turns the knob

Batches, other rules and real models: python -m extras.engine.
"""
import argparse
import json
import sys
import time

import torch

import data
import mars
from common import UserError, load_checkpoint, model_from_checkpoint
from common import Parser, add_device, run_cli, threshold


def generate(model, prompts, eot_id, mask_id, B, tau=0.9, max_new_tokens=64, n_vocab=None):
    """The paper's inference loop, greedy, for a batch of prompts (lists of ids). Each row feeds
    the tokens its KV cache lacks, then B - 1 masks: B predictions, the AR one and one per mask.
    Commit the first, then the next ones while their probability is >= tau; the cache drops the
    masks, and the committed tokens lead the next window. n_vocab: ids from there on never
    come out. Returns [(ids, what each forward committed)] per prompt."""
    budgets = [min(max_new_tokens, model.config.max_seq_len - len(p)) for p in prompts]
    results = [([], []) for _ in prompts]
    rows = [i for i, n in enumerate(budgets) if n > 0]  # the prompts still answering
    longest = max([len(prompts[i]) + budgets[i] for i in rows], default=1)
    cache = model.new_cache(len(rows), mars.cache_slots(longest, B))
    fresh = [list(prompts[i]) for i in rows]  # each row's real tokens not yet in the cache
    while rows:
        tokens, conf = mars.choose(predictions(model, cache, fresh, mask_id, B, tau, n_vocab))
        n = mars.accept(conf, tau).tolist()  # the AR token, then left to right while conf >= tau
        for j, i in enumerate(rows):
            out, chunks = results[i]
            fresh[j] = tokens[j, :n[j]].tolist()[:budgets[i] - len(out)]
            fresh[j] = mars.through_eot(fresh[j], eot_id)
            out += fresh[j]
            chunks.append(fresh[j])
        alive = [j for j, i in enumerate(rows)
                 if len(results[i][0]) < budgets[i] and fresh[j][-1] != eot_id]
        cache.keep_rows(alive)
        rows, fresh = [rows[j] for j in alive], [fresh[j] for j in alive]
    return results


def predictions(model, cache, fresh, mask_id, B, tau, n_vocab):
    """One forward of each row's fresh tokens and masks, right-padded with masks that no real
    position sees: the logits of its predictions (rows, 1 + masks, vocab)."""
    device, n_masks = model.wte.weight.device, mars.masks_to_feed(B, tau)
    t, cached = max(map(len, fresh)) + n_masks, list(cache.lengths)
    window = torch.tensor([f + [mask_id] * (t - len(f)) for f in fresh], device=device)
    positions = torch.tensor(cached, device=device)[:, None] + torch.arange(t, device=device)
    with torch.no_grad():  # decoding keeps no graph
        logits = model(window, positions=positions, cache=cache)
    last = torch.tensor([len(f) - 1 for f in fresh], device=device)  # each row's last real token
    at = last[:, None] + torch.arange(n_masks + 1, device=device)
    cache.rollback([c + len(f) for c, f in zip(cached, fresh)])
    rows = torch.arange(len(fresh), device=device)[:, None]
    return mars.banned(logits[rows, at], mask_id, n_vocab)


def check_room(prompt, max_seq):
    if len(prompt) >= max_seq:
        raise ValueError(f"a {len(prompt)}-token prompt fills the {max_seq}-token context")


# ---------------------------------------------------------------------------
# The command line

ENGINE_FLAGS = ("--B --B_cache --batch_size --cache --dtype --lossless --masks --max_accept "
                "--metric --seed --temperature").split()


def add_flags(p):  # shared with python -m extras.engine
    a = p.add_argument
    a("--ckpt", default="out/mars.pt", help="default out/mars.pt")
    a("--threshold", "--tau", dest="tau", type=threshold, default=0.9, help="tau in (0, 1] "
      "(default 0.9): commit while confidence >= tau; 1.0 = AR")
    a("--prompt", action="append", help="repeatable; default: held-out prompts")
    a("--num_prompts", type=int, default=5, help="held-out prompts (default 5)")
    a("--ar", action="store_true", help="plain AR decoding (any checkpoint)")
    a("--max_new_tokens", type=int, default=64, help="stop after this many (default 64)")
    add_device(p)
    a("--json", action="store_true", help="one JSON object per answer")
    a("--chat", action="store_true", help="one prompt per line; '/tau 0.8' sets tau")


def get_args(argv=None):
    p = Parser(__doc__)
    add_flags(p)
    for flag in p.parse_known_args(argv)[1]:
        if flag.split("=")[0] in ENGINE_FLAGS:
            p.exit(2, f"error: {flag} is the engine's flag: python -m extras.engine {flag} ...\n")
    return p.parse_args(argv)


def print_answer(tok, example, g, correct, as_json, route):
    """One answer g, "|" between forwards; correct is None where unknown."""
    n, s, f = len(g.tokens), g.seconds, g.forwards
    r = dict(prompt=example["prompt"], text=tok.answer(g.tokens), tokens=n, forwards=f,
             tokens_per_forward=n / max(f, 1), seconds=s, tokens_per_second=n / max(s, 1e-9),
             correct=correct, chunks=[tok.decode(c) for c in g.chunks], ids=g.tokens)
    if as_json:
        print(json.dumps({**r, **route}))
        return correct
    verdict = ("" if correct is None else "  right" if correct
               else f"  wrong, expected: {example['answer']}")
    print(f"> {r['prompt']}\n{'|'.join(map(tok.answer, g.chunks))}\n  [{n} tokens, {f} forwards, "
          f"{n / max(f, 1):.2f} tokens/forward, {n / max(s, 1e-9):.0f} tokens/s]{verdict}\n")
    return correct


def respond(args, ckpt, tok, decode, route=None, read=data.read_record):
    """Print decode(examples, tau)'s answers in a chat, to the prompts or the held-out ones."""
    def answer(examples, tau):  # how many are right
        return sum(bool(print_answer(tok, e, g, ok, args.json, route or {}))
                   for e, g, ok in decode(examples, tau))

    tau = args.tau
    if args.chat:
        for line in map(str.strip, sys.stdin):
            try:
                if line.startswith("/tau"):
                    tau = threshold(line[4:])
                    print(f"tau = {tau}", file=sys.stderr)
                elif line:
                    answer([{"prompt": line}], tau)
            except (argparse.ArgumentTypeError, ValueError) as e:  # say so, go on
                print(f"error: {e}", file=sys.stderr)
    elif args.prompt:
        answer([{"prompt": p} for p in args.prompt], tau)
    else:
        test = data.splits_of(ckpt["train_config"], read=read)["test"][:args.num_prompts]
        right = answer(test, tau)
        print(f"{right}/{len(test)} right", file=sys.stderr if args.json else sys.stdout)


def main(argv=None):
    args = get_args(argv)
    ckpt = load_checkpoint(args.ckpt, args.device)
    if not (args.chat or args.prompt or "train_config" in ckpt):
        raise UserError(f"{args.ckpt} has no held-out prompts: give --prompt or --chat")
    if not (args.ar or "mars" in ckpt):
        raise UserError(f"{args.ckpt} is an AR checkpoint: use --ar")
    model, tok = model_from_checkpoint(ckpt, args.device, torch.float32)
    B = 1 if args.ar else ckpt["mars"]["B"]

    def decode(examples, tau):
        for e in examples:
            prompt = tok.prompt_ids(e["prompt"])
            check_room(prompt, model.config.max_seq_len)
            t0 = time.perf_counter()  # generate read the tokens back: the device is done
            (out, chunks), = generate(model, [prompt], tok.eot, tok.mask, B, tau,
                                      args.max_new_tokens, tok.n_vocab)
            g = argparse.Namespace(tokens=out, chunks=chunks, forwards=len(chunks),
                                   seconds=time.perf_counter() - t0)
            yield e, g, data.check(e, tok.answer(out)) if "answer" in e else None
    respond(args, ckpt, tok, decode)


if __name__ == "__main__":
    run_cli(main)
