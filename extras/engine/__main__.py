"""The engine's command: sample.py's flags, and the engine's (batches, caches, lossless decoding,
sampling, other confidence rules, masks that pay for themselves), on our checkpoints and real models.

    python -m extras.engine --batch_size 8 --threshold 0.9          # held-out prompts, 8 at a time
    python -m extras.engine --lossless                              # AR's output, fewer forwards
    python -m extras.engine --cache block --B_cache 16              # the paper's block-level cache
    python -m extras.engine --ckpt smollm2 --B 4 --threshold 1.0 --chat   # a real model (GGUF)
    python -m extras.engine --ckpt DIR --dtype bfloat16 --chat      # a Hugging Face directory

Without an engine flag below, sample.generate decodes (the paper's loop, one prompt at a time, as
sample.py does); with one, the engine (engine.generate_batch). Both commit the same tokens in the
same forwards (tests check it); each output says which decoded and why (its route).
"""
import time
from types import SimpleNamespace

import torch

import sample
from common import Parser, UserError, run_cli
from extras.checkpoints import foreign
from extras.engine import engine
from extras.real import records

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# sample.generate takes none of these: given one, the engine decodes
ROUTING_FLAGS = ("batch_size", "cache", "lossless", "temperature", "metric", "max_accept", "masks")


def parser():
    p = Parser(__doc__)
    p.prog = "python -m extras.engine"
    sample.add_flags(p)
    a = p.add_argument
    a("--B", type=int, default=None, help="the paper's block size B: predictions per forward, "
      "B - 1 from masks (default: the checkpoint's; an AR checkpoint's masks are untrained: "
      "exact at tau 1.0, lossless)")
    a("--dtype", choices=DTYPES, default="float32", help="weights and activations: float32 "
      "(default), bfloat16 or float16 (a real model on a GPU)")
    e = p.add_argument_group("the engine's flags", "sample.generate takes none: given one, the "
                             "engine decodes (the same loop, batched, with these tools)")
    a = e.add_argument
    a("--batch_size", type=int, default=1, help="prompts decoded together (default 1)")
    a("--cache", choices=engine.CACHE_MODES, default="sliding", help="KV cache: sliding "
      "(default, fastest), block (the paper's block-level cache), none (the reference)")
    a("--B_cache", type=int, default=16, help="the paper's B_cache, with --cache block: "
      "positions filled between two cache writes (default 16)")
    a("--lossless", action="store_true", help="self-speculative: several tokens per forward, "
      "output identical to --ar (greedy)")
    a("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples "
      "(Gumbel-max)")
    a("--seed", type=int, default=0, help="the random seed of --temperature's draws (default 0)")
    a("--metric", choices=engine.METRICS, default="prob", help="confidence: prob of the token "
      "(default), margin (top1 - top2), or entropy (1 - normalised entropy)")
    a("--max_accept", type=int, default=None, help="commit at most this many tokens a forward")
    a("--masks", choices=engine.MASK_MODES, default="fixed", help="masks per forward: fixed "
      "(default, the paper's) B - 1; auto: as many as pay for their cost here "
      "(extras/engine/cost.py), so outputs vary; under --cache block, auto writes at every "
      "forward")
    return p


def get_args(argv=None):
    p = parser()
    args = p.parse_args(argv)
    for name in ("B", "B_cache", "batch_size", "max_new_tokens", "num_prompts", "max_accept"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    if args.temperature < 0:
        p.error("--temperature must be >= 0")
    if args.ar and args.lossless:
        p.error("--ar and --lossless decode differently; choose one")
    if args.lossless and args.temperature > 0:
        p.error("--lossless is greedy: it reproduces --ar exactly, so --temperature does not apply")
    given = [n for n in ROUTING_FLAGS if getattr(args, n) != p.get_default(n)]
    args.engine_flags = [f"--{n}" + ("" if n == "lossless" else f" {getattr(args, n)}")
                         for n in given]
    args.dtype = DTYPES[args.dtype]
    return args


def paper_loop(model, tok, B, max_new_tokens):
    """decode(examples, tau) by sample.generate, one prompt at a time, as sample.py decodes:
    yields (example, its answer, whether it is right: None without an "answer")."""
    def decode(examples, tau):
        for e in examples:
            prompt = tok.prompt_ids(e["prompt"])
            sample.check_room(prompt, model.config.max_seq_len)
            t0 = time.perf_counter()  # generate read every forward's tokens back: the device is done
            (out, chunks), = sample.generate(model, [prompt], tok.eot, tok.mask, B, tau,
                                             max_new_tokens, tok.n_vocab)
            g = SimpleNamespace(tokens=out, chunks=chunks, forwards=len(chunks),
                                seconds=time.perf_counter() - t0)
            yield e, g, records.check(e, tok.answer(out)) if "answer" in e else None
    return decode


def route(args, model, tok, B):
    """(which decodes and why, decode(examples, tau)): the engine where an engine flag is given,
    else the paper's loop."""
    if not args.engine_flags:
        why = "one prompt, greedy, sliding cache, prob rule, fixed masks"
        return {"route": "paper loop", "why": why}, paper_loop(model, tok, B, args.max_new_tokens)
    options = dict(B=B, cache=args.cache, B_cache=args.B_cache, lossless=args.lossless,
                   metric=args.metric, temperature=args.temperature, max_accept=args.max_accept,
                   max_new_tokens=args.max_new_tokens, masks=args.masks)
    why = f"sample.generate does not take {', '.join(args.engine_flags)}"

    def decode(examples, tau):
        return engine.decode_examples(model, tok, examples, args.batch_size, tau=tau,
                                      check=records.check, **options)
    return {"route": "engine", "why": why}, decode


def main(argv=None):
    args = get_args(argv)
    torch.manual_seed(args.seed)  # --temperature's draws
    ckpt, model, tok = foreign.load(args.ckpt, args.device, args.dtype)
    if not (args.chat or args.prompt or "train_config" in ckpt):
        raise UserError(f"{args.ckpt} has no held-out prompts of its own (not trained here): "
                        "give --prompt or --chat")
    model.eval()
    if not (args.ar or args.B or "mars" in ckpt):  # --B: untrained masks, exact at tau 1.0
        raise UserError(f"{args.ckpt} is an AR checkpoint (no MARS block size): use --ar, --B, "
                        "or a MARS checkpoint")
    B = 1 if args.ar else args.B or ckpt["mars"]["B"]
    label, decode = route(args, model, tok, B)
    if not args.json:  # a JSON object names it itself
        print(f"route: {label['route']} ({label['why']})\n")
    sample.respond(args, ckpt, tok, decode, label, read=records.read_record)


if __name__ == "__main__":
    run_cli(main)
