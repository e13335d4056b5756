"""Serving under load: continuous batching, a threshold per request, and a
controller that lowers tau when the queue grows.

    python -m extras.serving.serve                   # out/mars.pt -> out/serve.json, out/serve.png, a Markdown table
    python -m extras.serving.serve --clock wall      # the same trace against the real clock, as a sanity check
    python -m extras.serving.serve --http            # an OpenAI-compatible HTTP server and a page on this engine (server.py)
    python -m extras.serving.serve --http_load       # the trace sent by real HTTP clients, on the wall clock (server.py)

The paper claims that under high load a MARS server "can increase throughput on the fly
without swapping models or restarting", and never measures it. This is that experiment:

1. The engine: continuous batching (iteration-level scheduling, as in Orca and vLLM)
   in engine.py, the decoder every tool shares. Before every forward it
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
"""
import json
import os
import random
import sys
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

import data
from cli import Parser, UserError, load_checkpoint, model_from_checkpoint, run_cli, threshold
from cost import MASK_MODES, StepCost, batch_grid
from extras.bench.eval import machine
from extras.serving.report import goals, markdown, plot
from engine import Engine, Request, decode_step

# the trace: (phase, arrival rate as a multiple of the tau = 1.0 capacity), equal durations
PHASES = (("light", 0.5), ("overload", 1.3), ("recovery", 0.5))


@dataclass(eq=False)
class Served(Request):
    """A request as a server holds it: a client may give up on it, and a policy may change its tau at any forward."""
    cancelled: bool = False  # set by anyone (a client hung up): the request leaves before the next forward
    tau_sum: float = 0.0  # the sum of its tau over its forwards


class ServingEngine(Engine):
    """The engine with a server's bookkeeping, for Served requests: the cancelled leave before the next
    forward, and each request sums its tau over the forwards it takes part in (its mean tau)."""

    def admit(self):
        self.evict([i for i, r in enumerate(self.running) if not r.cancelled])
        self.waiting = deque(r for r in self.waiting if not r.cancelled)
        super().admit()

    def step(self):
        stepped, finished, width = super().step()
        for r in stepped:
            r.tau_sum += r.tau
        return stepped, finished, width


@dataclass(eq=False)
class Timed(Served):
    """A request of the trace, with its times (seconds since the start of the trace)."""
    arrival: float = 0.0
    example: dict = None  # the held-out example, for the answer checker
    admitted: float = None
    first_token: float = None
    finish: float = None


# ---------------------------------------------------------------------------
# Policies: the tau of every request, chosen before each forward from the backlog

class Fixed:
    def __init__(self, tau): self.tau = tau
    def __call__(self, load): return self.tau


@dataclass
class Adaptive:
    """A ladder of tau values, climbed down as the smoothed load grows.

    load = backlog / max_batch: 1.0 is a full batch with nobody waiting. The controller leaves
    rung k (towards lower tau) when the smoothed load exceeds `first + spacing * k`, and climbs
    back only when it falls `gap` below the threshold that brought it down: without that gap a
    load sitting at a threshold would flip tau at every forward. The smoothing (an exponential
    average over forwards) ignores the short bursts a Poisson stream always has."""
    ladder: tuple = (1.0, 0.99, 0.95, 0.9)
    first: float = 1.0
    spacing: float = 0.5
    gap: float = 0.5
    smoothing: float = 0.1  # weight of the newest backlog in the average
    rung: int = 0
    load: float = 0.0

    def __call__(self, load):
        self.load += self.smoothing * (load - self.load)
        down = self.first + self.spacing * self.rung
        if self.rung < len(self.ladder) - 1 and self.load > down:
            self.rung += 1
        elif self.rung > 0 and self.load < down - self.spacing - self.gap:
            self.rung -= 1
        return self.ladder[self.rung]


# ---------------------------------------------------------------------------
# Clocks and the step-cost model (cost.py: the same model sizes the windows of --masks auto)

def profile_cost(model, mask_id, max_batch, B):
    """The virtual clock's cost model: cost.StepCost on a grid from one token to the whole context, rows with
    half a context cached, eight rounds."""
    max_seq = model.config.max_seq_len
    widths = [w for w in (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64, 96) if w < max_seq + B] + [max_seq + B]
    return StepCost.profile(decode_step, model, mask_id, batch_grid(max_batch), widths, context=max_seq // 2, repeats=8)


class VirtualClock:
    """Time advances by the step-cost model only: reproducible on a busy machine."""
    def __init__(self, cost): self.cost, self.t = cost, 0.0
    def now(self): return self.t
    def forward_done(self, batch, width): self.t += self.cost(batch, width)
    def idle_until(self, t): self.t = max(self.t, t)


class WallClock:
    def __init__(self): self.t0 = time.perf_counter()
    def now(self): return time.perf_counter() - self.t0
    def forward_done(self, batch, width): pass
    def idle_until(self, t): time.sleep(max(0.0, t - self.now()))


# ---------------------------------------------------------------------------
# The experiment

def make_trace(examples, phases, seed):
    """Open-loop Poisson arrivals: [(arrival, example)] for phases [(name, rate, seconds)], back to back.
    Prompts come from a seeded shuffle of examples, reused in turn if the trace is longer."""
    rng = random.Random(seed)
    order = rng.sample(examples, len(examples))
    trace, start = [], 0.0
    for _, rate, seconds in phases:
        t = start + rng.expovariate(rate)
        while t < start + seconds:
            trace.append((t, order[len(trace) % len(order)]))
            t += rng.expovariate(rate)
        start += seconds
    return trace


def simulate(model, tok, trace, policy, B, max_batch, clock, max_new_tokens, **engine):
    """Serve a trace; returns (requests, steps), steps = [(end time, backlog, tau, tokens committed)].
    engine: options of the engine (masks, step_cost)."""
    engine = ServingEngine(model, tok.eot, tok.mask, B, max_batch, max_new_tokens, n_vocab=tok.n_vocab, **engine)
    reqs = [Timed(tok.prompt_ids(e["prompt"]), arrival=a, example=e) for a, e in trace]
    steps, i = [], 0
    while i < len(reqs) or engine.backlog:
        while i < len(reqs) and reqs[i].arrival <= clock.now():
            engine.waiting.append(reqs[i])
            i += 1
        if not engine.backlog:
            clock.idle_until(reqs[i].arrival)
            continue
        backlog = engine.backlog
        tau = policy(backlog / max_batch)
        for r in list(engine.waiting) + engine.running:
            r.tau = tau
        before = sum(len(r.tokens) for r in engine.running)  # the admitted have none yet
        start = clock.now()
        stepped, finished, width = engine.step()
        clock.forward_done(len(stepped), width)
        now = clock.now()
        for r in stepped:
            r.admitted = start if r.admitted is None else r.admitted
            r.first_token = now if r.first_token is None else r.first_token
        for r in finished:
            r.finish = now
        steps.append((now, backlog, tau, sum(len(r.tokens) for r in stepped) - before))
    return reqs, steps


def capacity(model, tok, examples, tau, B, max_batch, make_clock, max_new_tokens, **engine):
    """(requests/s, median service seconds) at a fixed tau with a full queue (all waiting at time 0).
    The rate counts the completions between the first and the last max_batch, when the batch is full."""
    reqs, _ = simulate(model, tok, [(0.0, e) for e in examples], Fixed(tau), B, max_batch, make_clock(),
                       max_new_tokens, **engine)
    done = sorted(r.finish for r in reqs)
    lo, hi = max_batch - 1, len(done) - max_batch - 1
    rate = (hi - lo) / (done[hi] - done[lo])
    return rate, float(np.median([r.finish - r.admitted for r in reqs]))


def calibrate(model, tok, calib, B, args, make_clock, **engine):
    """(capacity at tau = 1.0, at the lowest tau of the ladder, the SLO): a full queue of calibration prompts."""
    low, mb, n = args.ladder[-1], args.max_batch, args.max_new_tokens
    t0 = time.perf_counter()
    warm_up = [(0.0, e) for e in calib[:2 * mb]]  # the first forwards of each shape are slow
    simulate(model, tok, warm_up, Fixed(low), B, mb, make_clock(), n, **engine)
    cap, service = capacity(model, tok, calib, 1.0, B, mb, make_clock, n, **engine)
    cap_low, _ = capacity(model, tok, calib, low, B, mb, make_clock, n, **engine)
    slo = args.slo or 3 * service
    print(f"capacity at max_batch {mb}: {cap:.1f} requests/s at tau = 1.0, {cap_low:.1f} at tau = {low} "
          f"({cap_low / cap:.2f}x); SLO {slo:.3f} s; {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
    return cap, cap_low, slo


def by_phase(policy, reqs, phases, metrics):
    """Rows {policy, phase, rate, **metrics(requests, start, end)}: one per phase, by arrival, then the whole trace."""
    rows, start = [], 0.0
    for name, rate, secs in phases:
        inside = [r for r in reqs if start <= r.arrival < start + secs]
        rows.append({"policy": policy, "phase": name, "rate": rate, **metrics(inside, start, start + secs)})
        start += secs
    return rows + [{"policy": policy, "rate": len(reqs) / start, **metrics(reqs, 0.0, start)}]


def summarise(reqs, steps, start, end, slo, tok):
    """Metrics of the requests that arrived in [start, end); throughput counts what the
    server committed in that window, whichever request it belonged to."""
    lat = [r.finish - r.arrival for r in reqs]
    ttft = [r.first_token - r.arrival for r in reqs]
    forwards = sum(r.steps for r in reqs)
    correct = [data.check(r.example, tok.decode([t for t in r.tokens if t != tok.eot])) for r in reqs]
    pct = lambda xs, q: float(np.percentile(xs, q))
    return dict(requests=len(reqs), p50_latency=pct(lat, 50), p99_latency=pct(lat, 99),
                p50_ttft=pct(ttft, 50), p99_ttft=pct(ttft, 99),
                tokens_per_second=sum(n for t, _, _, n in steps if start <= t < end) / (end - start),
                goodput=sum(x <= slo for x in lat) / (end - start),
                tokens_per_forward=sum(len(r.tokens) for r in reqs) / forwards,
                mean_tau=sum(r.tau_sum for r in reqs) / forwards, accuracy=sum(correct) / len(reqs))


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
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default cuda when available)")
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
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return args


def load_mars(path, device, dtype=None):
    """(model in eval mode, tokenizer, B, checkpoint) of a MARS checkpoint, or UserError."""
    ckpt = load_checkpoint(path, device, dtype)
    if "mars" not in ckpt:
        raise UserError(f"{path} is a stage-1 (AR) checkpoint: serve needs a MARS checkpoint (mars.pt)")
    model, tok = model_from_checkpoint(ckpt, device, dtype)
    return model.eval(), tok, ckpt["mars"]["B"], ckpt


def prompts_for_load(ckpt, tok, max_seq, max_batch, data_path=None):
    """(held-out test examples, 12 * max_batch calibration examples) whose prompts fit the context:
    the checkpoint's own test and validation splits, or a JSONL of {prompt, answer} (data_path)."""
    fits = lambda split: [e for e in split if len(tok.prompt_ids(e["prompt"])) < max_seq]
    if data_path:
        test = val = fits(data.read_jsonl(data_path))
    elif "train_config" not in ckpt:
        raise UserError(f"{ckpt.get('hf', {}).get('path', 'this checkpoint')} was not trained here and has no "
                        "held-out prompts: give --data FILE (JSONL of {prompt, answer})")
    else:
        cfg = ckpt["train_config"]
        splits = data.load_splits(cfg["data"], cfg["seed"], cfg["n_train"])
        test, val = fits(splits["test"]), fits(splits["val"])
    if not test:
        raise UserError(f"no held-out prompt fits the model's context of {max_seq} tokens")
    return test, ((val or test) * 12 * max_batch)[:12 * max_batch]


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
