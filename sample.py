"""Generate with a MARS checkpoint: several tokens per forward, one threshold.

    python sample.py --threshold 0.9          # held-out prompts, MARS with KV cache
    python sample.py --ar                     # plain AR decoding, for comparison
    python sample.py --prompt "Write 42 in words." --threshold 0.8
    python sample.py --chat                   # type prompts; "/tau 0.7" turns the knob
    python sample.py --ckpt DIR --chat        # a Hugging Face directory (MARS-Qwen2.5-0.5B-blk4)

`generate` below is the paper's loop; read it first. The command line runs it whenever it can,
else the engine (extras/engine: the same loop with rows joining and leaving, other caches and
rules; tests check that both commit the same tokens in the same forwards), and says which ran
and why (`route`).
"""
import argparse
import json
import sys
import time
from types import SimpleNamespace

import torch

import data
import mars
from common import UserError, load_checkpoint, model_from_checkpoint
from common import Parser, add_device, run_cli, threshold
from model import check_room


@torch.inference_mode()
def generate(model, prompts, eot_id, mask_id, B, tau=0.9, max_new_tokens=64, n_vocab=None):
    """The paper's inference loop (section "Inference"), greedy, with a sliding KV cache, for
    a batch of prompts (lists of ids; one prompt is a batch of one). Each row feeds the tokens
    its cache has not seen, then B - 1 masks: one forward gives B predictions, the last real
    token's (the AR one) and one per mask. Commit the first always, then the next ones left to
    right while their probability is >= tau. The cache keeps the real tokens and drops the
    masks; the committed tokens lead the next window. A row leaves when its answer ends.
    n_vocab: the tokenizer's size; ids from there on (a real checkpoint's padding) never come out.
    Returns, per prompt, the generated ids and what each forward committed: [(out, chunks)]."""
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
    """One forward: each row feeds its fresh tokens and the masks, right-padded with masks that
    no real position sees (attention is causal). Returns each row's predictions' logits (rows,
    1 + masks, vocab), banned; the cache keeps the real tokens and drops the masks."""
    device, n_masks = model.wte.weight.device, mars.masks_to_feed(B, tau)
    t, cached = max(map(len, fresh)) + n_masks, list(cache.lengths)
    window = torch.tensor([f + [mask_id] * (t - len(f)) for f in fresh], device=device)
    positions = torch.tensor(cached, device=device)[:, None] + torch.arange(t, device=device)
    logits = model(window, positions=positions, cache=cache)
    last = torch.tensor([len(f) - 1 for f in fresh], device=device)  # each row's last real token
    at = last[:, None] + torch.arange(n_masks + 1, device=device)
    cache.rollback([c + len(f) for c, f in zip(cached, fresh)])
    rows = torch.arange(len(fresh), device=device)[:, None]
    return mars.banned(logits[rows, at], mask_id, n_vocab)


# ---------------------------------------------------------------------------
# The command line

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# generate takes none of these: given one, the engine decodes (extras/engine; its flags in --help)
ENGINE_FLAGS = ("batch_size", "cache", "lossless", "temperature", "metric", "max_accept", "masks")


def get_args(argv=None):
    p = Parser(__doc__)
    a = p.add_argument
    a("--ckpt", default="out/mars.pt", help="checkpoint to sample from (default out/mars.pt)")
    a("--prompt", action="append", help="a prompt (repeatable); default: held-out test prompts")
    a("--num_prompts", type=int, default=5, help="held-out prompts to answer without --prompt "
      "(default 5)")
    a("--chat", action="store_true", help="interactive: one prompt per line; '/tau 0.8' sets tau")
    a("--json", action="store_true", help="print one JSON object per prompt instead of text")
    a("--ar", action="store_true", help="plain AR decoding with KV cache (any checkpoint)")
    a("--threshold", "--tau", dest="tau", type=threshold, default=0.9, help="tau in (0, 1]: "
      "commit predictions while their confidence >= tau; 1.0 = one token per forward")
    a("--B", type=int, default=None, help="the paper's block size B: predictions per forward, "
      "B - 1 from masks (default: the checkpoint's; an AR checkpoint's are untrained: exact at "
      "tau 1.0, lossless)")
    a("--max_new_tokens", type=int, default=64, help="stop after this many tokens (default 64)")
    add_device(p)
    a("--dtype", choices=DTYPES, default="float32", help="weights and activations: float32 "
      "(default), bfloat16 or float16 (to serve a real model on a GPU)")
    add_engine_flags(p)
    args = p.parse_args(argv)
    for name in ("B", "B_cache", "batch_size", "max_new_tokens", "num_prompts", "max_accept"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    given = [n for n in ENGINE_FLAGS if getattr(args, n) != p.get_default(n)]
    args.engine_flags = [f"--{n}" + ("" if n == "lossless" else f" {getattr(args, n)}")
                         for n in given]
    args.dtype = DTYPES[args.dtype]
    return args


def add_engine_flags(p):
    e = p.add_argument_group("the engine's flags", "generate takes none: given one, the engine "
                             "(extras/engine) decodes, the same loop batched, with these tools")
    a = e.add_argument
    a("--batch_size", type=int, default=1, help="prompts decoded together (default 1)")
    a("--cache", choices=("none", "sliding", "block"), default="sliding", help="KV cache: "
      "sliding (default, fastest), block (the paper's block-level cache), none (reference)")
    a("--B_cache", type=int, default=16, help="the paper's B_cache, with --cache block: "
      "positions filled between two cache writes (default 16)")
    a("--lossless", action="store_true", help="self-speculative: several tokens per forward, "
      "output identical to --ar (greedy)")
    a("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples "
      "(Gumbel-max)")
    a("--seed", type=int, default=0, help="the random seed of --temperature's draws (default 0)")
    a("--metric", default="prob", help="confidence: prob of the token (default), margin "
      "(top1 - top2), or entropy (1 - normalised entropy)")
    a("--max_accept", type=int, default=None, help="commit at most this many tokens a forward")
    a("--masks", choices=("fixed", "auto"), default="fixed", help="masks per forward: fixed "
      "(default, the paper's) B - 1; auto: as many as pay for their cost here "
      "(extras/engine/cost.py), so outputs vary; under --cache block, auto writes at every "
      "forward")


def engine_decode(args, model, tok, B):
    """The seam to extras/engine, taken only for its flags (ENGINE_FLAGS): which route decodes
    and why, and decode(examples, tau) as generate_examples; it refuses flags that cannot run
    together."""
    from extras.engine import engine
    return engine.route(args, model, tok, B)


def generate_examples(model, tok, examples, B, tau, max_new_tokens):
    """Yields (example, its output, whether it is right: None without an "answer"), from
    `generate`, one prompt at a time; the output has what print_answer reads of the engine's
    Request (tokens, chunks, forwards, seconds)."""
    for e in examples:
        prompt = tok.prompt_ids(e["prompt"])
        check_room(prompt, model.config.max_seq_len)
        t0 = time.perf_counter()  # generate reads every forward's tokens back: the device is done
        (out, chunks), = generate(model, [prompt], tok.eot, tok.mask, B, tau, max_new_tokens,
                                  tok.n_vocab)
        g = SimpleNamespace(tokens=out, chunks=chunks, forwards=len(chunks),
                            seconds=time.perf_counter() - t0)
        yield e, g, data.check(e, tok.answer(out)) if "answer" in e else None


def print_answer(tok, example, g, correct, as_json, colour, route):
    """One answer: the text, split into what each forward committed, and the statistics; for a
    held-out prompt (its answer known) whether it is right, and if not, what was expected; in
    JSON, which route ran. Returns correct."""
    n, text = len(g.tokens), tok.answer(g.tokens)
    # every forward the request took part in (the block cache's waits and writes too)
    stats = dict(tokens=n, forwards=g.forwards, tokens_per_forward=n / max(g.forwards, 1),
                 seconds=g.seconds, tokens_per_second=n / max(g.seconds, 1e-9))
    if as_json:
        known = {} if correct is None else {"correct": correct}
        print(json.dumps({"prompt": example["prompt"], "text": text, **stats, **known,
                          "chunks": [tok.decode(c) for c in g.chunks], "ids": g.tokens, **route}))
        return correct
    pieces = [tok.answer(c) for c in g.chunks]
    # two alternating colours on a terminal, else "|": one piece per forward
    body = "|".join(pieces) if not colour else "".join(
        f"\033[{36 - 3 * (i % 2)}m{p}\033[0m" for i, p in enumerate(pieces))
    verdict = ("" if correct is None else "  right" if correct
               else f"  wrong, expected: {example['answer']}")
    print(f"> {example['prompt']}\n{body}\n  [{n} tokens, {g.forwards} forwards, "
          f"{stats['tokens_per_forward']:.2f} tokens/forward, "
          f"{stats['tokens_per_second']:.0f} tokens/s]{verdict}\n", flush=True)
    return correct


def chat(answer, tau, name):
    """One prompt per line from stdin; '/tau X' turns the knob between prompts."""
    print(f"chat with {name} (tau={tau}); '/tau X' changes the threshold, Ctrl-D ends",
          file=sys.stderr)
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


def main(argv=None):
    args = get_args(argv)
    torch.manual_seed(args.seed)  # --temperature's draws
    ckpt = load_checkpoint(args.ckpt, args.device, args.dtype)
    if not (args.chat or args.prompt or "train_config" in ckpt):
        raise UserError(f"{args.ckpt} has no held-out prompts of its own (not trained here): "
                        "give --prompt or --chat")
    model, tok = model_from_checkpoint(ckpt, args.device, args.dtype)
    model.eval()
    if not (args.ar or args.B or "mars" in ckpt):  # --B: untrained masks, exact at tau 1.0
        raise UserError(f"{args.ckpt} is an AR checkpoint (no MARS block size): use --ar, --B, "
                        "or a MARS checkpoint")
    B = 1 if args.ar else args.B or ckpt["mars"]["B"]
    if args.engine_flags:
        route, decode = engine_decode(args, model, tok, B)
    else:
        route = {"route": "paper loop",
                 "why": "one prompt, greedy, sliding cache, prob rule, fixed masks"}

        def decode(examples, tau):
            return generate_examples(model, tok, examples, B, tau, args.max_new_tokens)
    colour = sys.stdout.isatty()
    if not args.json:  # a JSON object names it itself
        print(f"route: {route['route']} ({route['why']})\n")

    def answer(examples, tau):
        """Decode and print each example ({"prompt"}, and "answer" when known); returns how
        many came out right."""
        return sum(bool(print_answer(tok, e, g, ok, args.json, colour, route))
                   for e, g, ok in decode(examples, tau))

    if args.chat:
        return chat(answer, args.tau, f"{args.ckpt} (B={B})")
    if args.prompt:
        return answer([{"prompt": p} for p in args.prompt], args.tau)
    cfg = ckpt["train_config"]
    test = data.splits_of(cfg)["test"]
    right = answer(test[:args.num_prompts], args.tau)
    print(f"{right}/{len(test[:args.num_prompts])} right",
          file=sys.stderr if args.json else sys.stdout)  # stdout stays JSON lines


if __name__ == "__main__":
    run_cli(main)
