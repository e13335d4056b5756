"""Serving under load: continuous batching, a threshold per request, and a
controller that lowers tau when the queue grows.

    python -m extras.serving.serve                   # out/mars.pt -> out/serve.json, out/serve.png, a Markdown table
    python -m extras.serving.serve --clock wall      # the same trace against the real clock, as a sanity check
    python -m extras.serving.serve --http            # an OpenAI-compatible HTTP server and a page on this engine (server.py)
    python -m extras.serving.serve --http_load       # the trace sent by real HTTP clients, on the wall clock (server.py)

The paper claims that under high load a MARS server "can increase throughput on the fly
without swapping models or restarting", and never measures it. This is that experiment:

1. The engine: continuous batching (iteration-level scheduling, as in Orca and vLLM)
   in engine.py, which every tool shares. Before every forward it
   admits waiting requests up to --max_batch; a new prompt is the uncached part of its
   row's window, so it is prefilled in the same forward as the others' steps; finished
   requests leave after it. Each request's tau is read at every step. A row at tau = 1.0
   commits one token whatever its masks predict, so it is fed none: it costs what AR costs.
2. The load: an open-loop Poisson trace from a seed, held-out prompts, in three phases of
   equal length: light (0.5x the tau = 1.0 capacity), overload (1.3x), light again
   ("recovery"). The capacities are measured at start-up (a full queue, validation prompts).
3. The policies, on the same trace: ar (B = 1), tau = 1.0, the lowest tau of --ladder,
   and adaptive: the smoothed backlog (waiting + running) picks a rung of the ladder, with
   hysteresis. Under load it *lowers* tau (unlike speculative decoding, which engines
   switch off under load): a MARS forward carries its masks anyway, and tau only decides
   how many of their predictions to keep.
4. The clock is virtual: forwards really run, so acceptance and answers are real, but
   time advances by a step-cost model t(batch, window width) profiled at start-up, so
   that a noisy shared machine does not change the result.
Why --max_batch 8: a CPU forward's cost grows with the tokens it carries almost at once,
and a joining prompt pads every row's window; the capacities measured at start-up are in
serve.json ("capacity"), and a GPU stays cheap per token far longer: use more there.
This file is the command line; the scheduler, its policies, clocks and trace are extras/serving/scheduler.py.
"""
import json
import os
import sys
import time

import torch

from common import Parser, add_device, run_cli, threshold
from extras.engine.engine import MASK_MODES
from extras.bench.eval import machine
from extras.serving.report import goals, markdown, plot
from extras.serving.scheduler import (PHASES, Adaptive, Fixed, ServingEngine, VirtualClock, WallClock, by_phase,
                                      calibrate, load_mars, make_trace, profile_cost, prompts_for_load, simulate,
                                      summarise)


# ---------------------------------------------------------------------------
# Over HTTP: the server (extras/serving/server.py); the trace sent to it by real clients is extras/serving/load_http.py

def http_serve(args):
    from extras.serving.server import Server  # the HTTP stack loads only when asked for
    model, tok, B, _ = load_mars(args.ckpt, args.device, args.dtype)
    engine = ServingEngine(model, tok.eot, tok.mask, B, args.max_batch, args.max_new_tokens, n_vocab=tok.n_vocab,
                           max_context=args.max_context, masks=args.masks)
    policy = Adaptive(ladder=tuple(args.ladder)) if args.adaptive else Fixed(args.tau)
    httpd = Server(engine, tok, policy, args, name=os.path.splitext(os.path.basename(os.path.normpath(args.ckpt)))[0])
    how = f"adaptive tau {args.ladder}" if args.adaptive else f"tau {args.tau} unless a request says"
    print(f"serving {args.ckpt} (B = {B}, {how}, {args.masks} masks) on {httpd.url}/ ; Ctrl-C stops", flush=True)
    httpd.serve_forever()


# ---------------------------------------------------------------------------
# The command line

def get_args(argv=None):
    p = Parser(__doc__)
    p.add_argument("--ckpt", default="out/mars.pt", help="MARS checkpoint (default out/mars.pt)")
    p.add_argument("--out_dir", default="out", help="where serve.json and serve.png go (default out)")
    p.add_argument("--max_batch", type=int, default=8, help="most requests decoded together (default 8: on the 2-core "
                   "reference CPU it serves the most requests/s both at tau = 1.0 and at low tau; see the top of this file)")
    p.add_argument("--ladder", type=threshold, nargs="+", default=[1.0, 0.99, 0.95, 0.9], help="the adaptive policy's "
                   "tau values, from light to heavy load (default 1.0 0.99 0.95 0.9); the last is also the fixed low-tau policy")
    p.add_argument("--requests", type=int, default=600, help="expected requests in the three-phase trace (default 600)")
    p.add_argument("--sweep", type=float, nargs="+", default=[0.5, 0.8, 1.1, 1.4], help="steady arrival rates for the "
                   "second panel, as multiples of the tau = 1.0 capacity (default 0.5 0.8 1.1 1.4)")
    p.add_argument("--sweep_requests", type=int, default=120, help="expected requests per sweep rate (default 120)")
    p.add_argument("--slo", type=float, default=None, help="latency SLO in seconds for goodput (default 3x the median "
                   "service time of a request in a full tau = 1.0 batch, measured at start-up)")
    p.add_argument("--clock", choices=["virtual", "wall"], default="virtual", help="virtual (default): time advances by "
                   "a step-cost model profiled at start-up, reproducible; wall: the real clock, as a sanity check")
    p.add_argument("--max_new_tokens", type=int, default=64, help="stop a response after this many tokens (default 64)")
    p.add_argument("--masks", choices=MASK_MODES, default="fixed", help="fixed (default): B - 1 masks per forward, the "
                   "paper's method; auto: per request, as many masks as pay for what they cost (cost.py; beyond the "
                   "paper; its outputs depend on this machine's timings)")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrival trace and its prompts (default 0)")
    add_device(p)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="weights' precision (default float32)")
    p.add_argument("--max_context", type=int, default=2048, help="longest prompt + answer served, within the model's "
                   "context; the KV cache is sized by it (default 2048)")
    p.add_argument("--data", help="JSONL of {prompt, answer} for the load experiment (default: the checkpoint's "
                   "held-out prompts; needed for a model not trained here)")
    h = p.add_argument_group("over HTTP", "Limits: a request body over 1 MiB gets 413; the kernel queues up to 2048\n"
                             "connections (the listen backlog) until the server accepts them; --max_queue,\n"
                             "--max_connections and --timeout below.")
    h.add_argument("--http", action="store_true", help="serve HTTP: the page at /, /v1/chat/completions, /v1/models")
    h.add_argument("--http_load", action="store_true", help="the load trace sent over HTTP by real clients, wall "
                   "clock: fixed tau = 1.0 and adaptive -> OUT_DIR/serve_http.json")
    h.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    h.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free port)")
    h.add_argument("--tau", type=threshold, default=0.9, help="tau of a request that does not give one (default 0.9)")
    h.add_argument("--adaptive", action="store_true", help="the server picks tau from the backlog (--ladder) for "
                   "every request that does not give its own")
    h.add_argument("--max_queue", type=int, default=64, help="requests waiting beyond the running batch before the "
                   "server answers 503 with Retry-After (default 64)")
    h.add_argument("--max_connections", type=int, default=512, help="open connections at most, idle ones included "
                   "(default 512): with that many open a request gets 503, and a new connection is closed at once; "
                   "the open-files limit (ulimit -n) is raised to fit it, or the server does not start")
    h.add_argument("--timeout", type=float, default=10.0, help="seconds a connection has to send each request whole, "
                   "and may stay idle between requests, before it is closed (default 10)")
    h.add_argument("--allow_host", action="append", default=[], help="a name this server also answers to in the Host "
                   "header (repeatable; with --host 0.0.0.0, the names clients use), besides the --host address, "
                   "localhost and 127.0.0.1; any other is refused, so that another site's page cannot reach the server "
                   "by rebinding its name")
    h.add_argument("--cors", metavar="ORIGIN", help="let the page of this one origin (e.g. http://localhost:3000) "
                   "call the API from a browser (default: no CORS headers, so no other page can)")
    args = p.parse_args(argv)
    args.dtype = args.dtype and getattr(torch, args.dtype)
    for name in ("max_batch", "max_new_tokens", "max_context"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    if args.requests < 40 or args.sweep_requests < 10:  # so that every phase and every rate sees arrivals
        p.error("--requests must be at least 40 and --sweep_requests at least 10")
    if len(args.ladder) < 2 or any(a <= b for a, b in zip(args.ladder, args.ladder[1:])):
        p.error("--ladder needs at least two taus, strictly decreasing, e.g. 1.0 0.99 0.95 0.9")
    if min(args.sweep) <= 0 or (args.slo is not None and args.slo <= 0):
        p.error("--sweep rates and --slo must be positive")
    if args.http and args.http_load:
        p.error("--http serves, --http_load runs the experiment: give one")
    if not 0 <= args.port <= 65535:
        p.error(f"--port must be in 0..65535, got {args.port}")
    if min(args.max_queue, args.max_connections) < 1 or not args.timeout > 0:
        p.error("--max_queue and --max_connections must be at least 1, --timeout positive")
    return args


def main(argv=None):
    args = get_args(argv)
    if args.http or args.http_load:
        if args.http_load:
            from extras.serving.load_http import http_load  # the HTTP stack loads only when asked for
            return http_load(args)
        return http_serve(args)
    model, tok, B, ckpt = load_mars(args.ckpt, args.device, args.dtype)
    test, calib = prompts_for_load(ckpt, tok, min(model.config.max_seq_len, args.max_context), args.max_batch,
                                   args.data)
    low = args.ladder[-1]
    policies = {"ar": (1, lambda: Fixed(1.0)), "tau=1.0": (B, lambda: Fixed(1.0)), f"tau={low}": (B, lambda: Fixed(low)),
                "adaptive": (B, lambda: Adaptive(ladder=tuple(args.ladder)))}
    os.makedirs(args.out_dir, exist_ok=True)
    t0 = time.perf_counter()
    # start-up: the step-cost model, then the capacities it implies
    cost = profile_cost(model, tok.mask, args.max_batch, B) if args.clock == "virtual" else None
    make_clock = (lambda: VirtualClock(cost)) if cost else WallClock
    engine = dict(masks=args.masks, step_cost=cost)  # --masks auto sizes windows by the clock's own cost model
    cap, cap_low, slo = calibrate(model, tok, calib, B, args, make_clock, **engine)

    total, done = len(policies) * (args.requests + len(args.sweep) * args.sweep_requests), 0

    def every_policy(name, trace):
        """{policy: (requests, steps)}: every policy serves the same arrivals."""
        nonlocal done
        out = {}
        for policy, (b, make_policy) in policies.items():
            t_run = time.perf_counter()
            out[policy] = simulate(model, tok, trace, make_policy(), b, args.max_batch, make_clock(),
                                   args.max_new_tokens, **engine)
            done += len(trace)
            print(f"  {name:8s} {policy:9s} {len(trace):4d} requests in {time.perf_counter() - t_run:5.1f}s | "
                  f"ETA {(time.perf_counter() - t0) / done * max(total - done, 0):.0f}s", file=sys.stderr, flush=True)
        return out

    # the three-phase trace
    seconds = args.requests / (cap * sum(m for _, m in PHASES))  # per phase
    phases = [(name, m * cap, seconds) for name, m in PHASES]
    trace = make_trace(test, phases, args.seed)
    served = every_policy("trace", trace)
    runs, whole = [], []
    for policy, (reqs, steps) in served.items():
        runs += by_phase(policy, reqs, phases, lambda rs, a, b: summarise(rs, steps, a, b, slo, tok))
        whole.append(runs.pop())

    # the sweep: one steady trace per rate, all from one seed, so the same requests come at every rate,
    # only closer together: accuracy then changes with tau alone, not with the sample of prompts
    sweep = []
    for m in args.sweep:
        rate, secs = m * cap, args.sweep_requests / (m * cap)
        for policy, (reqs, steps) in every_policy(f"load {m}", make_trace(test, [("sweep", rate, secs)], args.seed + 1)).items():
            sweep.append({"policy": policy, "rate": rate, "load": m, **summarise(reqs, steps, 0, secs, slo, tok)})

    result = {"clock": args.clock, "masks": args.masks,
              "max_batch": args.max_batch, "slo_seconds": slo, "machine": machine(),
              "runs": runs, "whole_trace": whole, "sweep": sweep, "ckpt": args.ckpt, "B": B,
              "ladder": args.ladder, "capacity": {"tau=1.0": cap, f"tau={low}": cap_low},
              "phases": [{"phase": n, "rate": r, "seconds": s} for n, r, s in phases], "seed": args.seed,
              "step_cost": cost and {"batches": cost.batches, "widths": cost.widths, "seconds": cost.seconds.tolist()}}
    result["goals"] = goals(result)
    with open(os.path.join(args.out_dir, "serve.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(result, {policy: steps for policy, (_, steps) in served.items()}, [a for a, _ in trace],
         os.path.join(args.out_dir, "serve.png"))
    print(markdown(result))
    print(f"done in {time.perf_counter() - t0:.0f}s: {args.out_dir}/serve.json, {args.out_dir}/serve.png", file=sys.stderr)


if __name__ == "__main__":
    run_cli(main)
