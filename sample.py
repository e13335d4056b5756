"""Generate with a MARS checkpoint: several tokens per forward, one threshold.

    python sample.py --threshold 0.9          # held-out prompts, MARS with KV cache
    python sample.py --ar                     # plain AR decoding, for comparison
    python sample.py --prompt "Write 42 in words." --threshold 0.8
    python sample.py --chat                   # type prompts; "/tau 0.7" turns the knob
    python sample.py --ckpt DIR --chat        # a Hugging Face directory, e.g. MARS-Qwen2.5-0.5B-blk4

`generate` below is the paper's loop for one prompt; read it first. The command line runs it whenever
it can, else engine.py, the same loop for many prompts at once (tests check that both commit the same
tokens in the same forwards), and says which ran and why (`route`).
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
def generate(model, prompt, eot_id, mask_id, B, tau=0.9, max_new_tokens=64, n_vocab=None):
    """The paper's inference loop (section "Inference"), greedy, with a sliding KV cache.

    Feed the tokens the cache has not seen, then B - 1 masks. One forward gives B predictions:
    the last real token's (the AR prediction) and one per mask. Commit the first always, then
    the next ones left to right while their probability is >= tau. The cache keeps the real
    tokens and drops the masks; the committed tokens lead the next window.
    n_vocab: the tokenizer's size; ids from there on (a real checkpoint's padding rows) are never output.
    Returns the generated ids and what each forward committed."""
    device = model.wte.weight.device
    budget = min(max_new_tokens, model.config.max_seq_len - len(prompt))
    cache = model.new_cache(1, len(prompt) + budget + B)
    out, chunks, fresh = [], [], list(prompt)  # fresh: real tokens not yet in the cache
    while len(out) < budget and out[-1:] != [eot_id]:
        masks = [mask_id] * mars.masks_to_feed(B, tau)  # none at tau = 1: only the AR token is committed
        cached = cache.lengths[0]
        window = torch.tensor([fresh + masks], device=device)
        positions = torch.arange(cached, cached + window.shape[1], device=device)
        logits = model(window, positions=positions, cache=cache)[0, len(fresh) - 1:, :n_vocab]  # no padding row
        logits[:, mask_id] = float("-inf")  # a placeholder is never an output
        tokens, conf = mars.choose(logits)  # the argmax and its probability, per position
        n = int(mars.accept(conf[None], tau)[0])  # the AR token, then left to right while conf >= tau
        cache.rollback([cached + len(fresh)])  # keep the real tokens, drop the masks
        fresh = tokens[:n].tolist()[:budget - len(out)]
        if eot_id in fresh:  # the answer ends at <|endoftext|>
            fresh = fresh[:fresh.index(eot_id) + 1]
        out += fresh
        chunks.append(fresh)
    return out, chunks


@torch.inference_mode()
def generate_many(model, prompts, eot_id, mask_id, B, tau=0.9, max_new_tokens=64, n_vocab=None):
    """generate for many prompts at once (training's validation and summary), committing what generate commits
    (a test checks). Each row feeds its own fresh tokens and the masks, right-padded with masks that no real
    position sees (attention is causal), and leaves the batch when its answer ends. Returns [(out, chunks)]."""
    device, n_masks = model.wte.weight.device, mars.masks_to_feed(B, tau)
    budgets = [min(max_new_tokens, model.config.max_seq_len - len(p)) for p in prompts]
    results = [([], []) for _ in prompts]
    rows = [i for i, n in enumerate(budgets) if n > 0]
    cache = model.new_cache(len(rows), max([len(prompts[i]) + budgets[i] for i in rows], default=0) + 2 * B)
    fresh = [list(prompts[i]) for i in rows]
    while rows:
        t, cached = max(map(len, fresh)) + n_masks, cache.lengths
        window = torch.tensor([f + [mask_id] * (t - len(f)) for f in fresh], device=device)
        positions = torch.tensor(cached, device=device)[:, None] + torch.arange(t, device=device)
        logits = model(window, positions=positions, cache=cache)
        last = torch.tensor([len(f) - 1 for f in fresh], device=device)  # each row's last real token
        at = last[:, None] + torch.arange(n_masks + 1, device=device)
        logits = logits[torch.arange(len(rows), device=device)[:, None], at, :n_vocab]  # each row's B predictions
        logits[..., mask_id] = float("-inf")
        tokens, conf = mars.choose(logits)
        n = mars.accept(conf, tau).tolist()
        cache.rollback([c + len(f) for c, f in zip(cached, fresh)])  # keep the real tokens, drop the masks
        for j, i in enumerate(rows):
            out, chunks = results[i]
            fresh[j] = tokens[j, :n[j]].tolist()[:budgets[i] - len(out)]
            if eot_id in fresh[j]:
                fresh[j] = fresh[j][:fresh[j].index(eot_id) + 1]
            out += fresh[j]
            chunks.append(fresh[j])
        alive = [j for j, i in enumerate(rows) if len(results[i][0]) < budgets[i] and results[i][0][-1] != eot_id]
        cache.keep_rows(alive)
        rows, fresh = [rows[j] for j in alive], [fresh[j] for j in alive]
    return results


# ---------------------------------------------------------------------------
# The command line

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# sample.generate takes none of these: given one, engine.py decodes (its flags in --help)
ENGINE_FLAGS = ("batch_size", "cache", "lossless", "temperature", "metric", "max_accept", "masks")


def get_args(argv=None):
    p = Parser(__doc__)
    p.add_argument("--ckpt", default="out/mars.pt", help="checkpoint to sample from (default out/mars.pt)")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable); default: held-out test prompts")
    p.add_argument("--num_prompts", type=int, default=5, help="held-out prompts to answer without --prompt (default 5)")
    p.add_argument("--chat", action="store_true", help="interactive: one prompt per line; '/tau 0.8' sets the threshold")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt instead of text")
    p.add_argument("--ar", action="store_true", help="plain AR decoding with KV cache (works with any checkpoint)")
    p.add_argument("--threshold", "--tau", dest="tau", type=threshold, default=0.9,
                   help="tau in (0, 1]: commit predictions while their confidence >= tau; 1.0 = one token per forward")
    p.add_argument("--B", type=int, default=None, help="the paper's block size B: predictions per forward, B - 1 "
                   "from masks (default: the checkpoint's; an AR checkpoint's are untrained: exact at tau 1.0, lossless)")
    p.add_argument("--max_new_tokens", type=int, default=64, help="stop after this many tokens (default 64)")
    p.add_argument("--seed", type=int, default=0, help="random seed for sampling")
    add_device(p)
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="weights and activations: float32 "
                   "(default), bfloat16 or float16 (to serve a real model on a GPU)")
    e = p.add_argument_group("the engine's flags", "generate takes none: given one, engine.py decodes (the same loop, "
                             "batched, with these tools)")
    e.add_argument("--batch_size", type=int, default=1, help="prompts decoded together (default 1)")
    e.add_argument("--cache", choices=("none", "sliding", "block"), default="sliding",
                   help="KV cache: sliding (default, fastest), block (the paper's block-level cache), none (reference)")
    e.add_argument("--B_cache", type=int, default=16, help="the paper's B_cache, with --cache block: positions filled "
                   "between two cache writes (default 16)")
    e.add_argument("--lossless", action="store_true",
                   help="self-speculative: several tokens per forward, output identical to --ar (greedy)")
    e.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples (Gumbel-max)")
    e.add_argument("--metric", default="prob", help="confidence: prob of the token (default), margin (top1 - top2), "
                   "or entropy (1 - normalised entropy)")
    e.add_argument("--max_accept", type=int, default=None, help="commit at most this many tokens per forward")
    e.add_argument("--masks", choices=("fixed", "auto"), default="fixed", help="masks per forward: fixed (default, "
                   "the paper's) B - 1; auto: as many as pay for their cost here (cost.py), so outputs vary; under "
                   "--cache block, auto writes at every forward")
    return checked(p, p.parse_args(argv))


def checked(p, args):
    """Refuses flags out of range (engine.checked those that cannot run together); notes the engine flags given."""
    for name in ("B", "B_cache", "batch_size", "max_new_tokens", "num_prompts", "max_accept"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    given = [n for n in ENGINE_FLAGS if getattr(args, n) != p.get_default(n)]
    args.engine_flags = [f"--{n}" if n == "lossless" else f"--{n} {getattr(args, n)}" for n in given]
    if given:  # the engine, only where a flag needs it
        import engine
        engine.checked(p, args)
    args.dtype = DTYPES[args.dtype]
    return args


def generate_examples(model, tok, examples, B, tau, max_new_tokens):
    """Yields (example, its output, whether it is right: None without an "answer"), from `generate`, one prompt
    at a time; the output has what show reads of an engine.Request (tokens, chunks, forwards, seconds)."""
    for e in examples:
        prompt = tok.prompt_ids(e["prompt"])
        check_room(prompt, model.config.max_seq_len)
        t0 = time.perf_counter()  # generate reads every forward's tokens back: the device is done when it returns
        out, chunks = generate(model, prompt, tok.eot, tok.mask, B, tau, max_new_tokens, tok.n_vocab)
        g = SimpleNamespace(tokens=out, chunks=chunks, forwards=len(chunks), seconds=time.perf_counter() - t0)
        yield e, g, data.check(e, tok.answer(out)) if "answer" in e else None


def show(tok, example, g, correct, as_json, colour, route):
    """One answer: the text, split into what each forward committed, and the statistics; for a held-out prompt
    (its answer known) whether it is right, and if not, what was expected; in JSON, which route ran."""
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
    body = "".join(f"\033[{36 - 3 * (i % 2)}m{p}\033[0m" for i, p in enumerate(pieces)) if colour else "|".join(pieces)
    verdict = "" if correct is None else "  right" if correct else f"  wrong, expected: {example['answer']}"
    print(f"> {example['prompt']}\n{body}\n  [{n} tokens, {g.forwards} forwards, {stats['tokens_per_forward']:.2f} "
          f"tokens/forward, {stats['tokens_per_second']:.0f} tokens/s]{verdict}\n", flush=True)
    return correct


def chat(answer, tau, name):
    """One prompt per line from stdin; '/tau X' turns the knob between prompts."""
    print(f"chat with {name} (tau={tau}); '/tau X' changes the threshold, Ctrl-D ends", file=sys.stderr)
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
    torch.manual_seed(args.seed)
    ckpt = load_checkpoint(args.ckpt, args.device, args.dtype)
    if not (args.chat or args.prompt or "train_config" in ckpt):
        raise UserError(f"{args.ckpt} has no held-out prompts of its own (not trained here): give --prompt or --chat")
    model, tok = model_from_checkpoint(ckpt, args.device, args.dtype)
    model.eval()
    if not (args.ar or args.B or "mars" in ckpt):  # --B: untrained masks, which tau = 1.0 and --lossless make exact
        raise UserError(f"{args.ckpt} is an AR checkpoint (no MARS block size): use --ar, --B, or a MARS checkpoint")
    B = 1 if args.ar else args.B or ckpt["mars"]["B"]
    if args.engine_flags:
        import engine
        route, decode = engine.route(args, model, tok, B)
    else:
        route = {"route": "paper loop", "why": "one prompt, greedy, sliding cache, prob rule, fixed masks"}

        def decode(examples, tau):
            return generate_examples(model, tok, examples, B, tau, args.max_new_tokens)
    colour = sys.stdout.isatty()
    if not args.json:  # a JSON object names it itself
        print(f"route: {route['route']} ({route['why']})\n")

    def answer(examples, tau):
        """Decode and show each example ({"prompt"}, with "answer" when known); returns how many came out right."""
        return sum(bool(show(tok, e, g, ok, args.json, colour, route)) for e, g, ok in decode(examples, tau))

    if args.chat:
        return chat(answer, args.tau, f"{args.ckpt} (B={B})")
    if args.prompt:
        return answer([{"prompt": p} for p in args.prompt], args.tau)
    cfg = ckpt["train_config"]
    test = data.load_splits(cfg["data"], cfg["seed"], cfg["n_train"], cfg.get("tasks"))["test"][:args.num_prompts]
    right = answer(test, args.tau)
    print(f"{right}/{len(test)} right", file=sys.stderr if args.json else sys.stdout)  # stdout stays JSON lines


if __name__ == "__main__":
    run_cli(main)
