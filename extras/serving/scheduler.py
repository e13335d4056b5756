"""The serving scheduler: continuous batching with a server's bookkeeping (ServingEngine, Served), tau
policies (Fixed, Adaptive), clocks (virtual, wall), the load experiment's trace, its simulation and metrics,
and loading a MARS checkpoint with held-out prompts for it. The command line is serve.py; the HTTP server
(server.py) and its load clients (load_http.py) import this module, never serve.py.
"""
import random
import sys
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

import data
from common import UserError
from extras.checkpoints import foreign
from extras.engine.cost import StepCost, batch_grid
from extras.engine.engine import Engine, Request, decode_step
from extras.real import records

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
    forwards = sum(r.forwards for r in reqs)
    correct = [records.check(r.example, tok.answer(r.tokens)) for r in reqs]
    pct = lambda xs, q: float(np.percentile(xs, q))
    return dict(requests=len(reqs), p50_latency=pct(lat, 50), p99_latency=pct(lat, 99),
                p50_ttft=pct(ttft, 50), p99_ttft=pct(ttft, 99),
                tokens_per_second=sum(n for t, _, _, n in steps if start <= t < end) / (end - start),
                goodput=sum(x <= slo for x in lat) / (end - start),
                tokens_per_forward=sum(len(r.tokens) for r in reqs) / forwards,
                mean_tau=sum(r.tau_sum for r in reqs) / forwards, accuracy=sum(correct) / len(reqs))


def load_mars(path, device, dtype=None):
    """(model in eval mode, tokenizer, B, checkpoint) of a MARS checkpoint (ours, or a real
    model's directory or GGUF file: extras/checkpoints/foreign.py), or UserError."""
    ckpt, model, tok = foreign.load(path, device, dtype)
    if "mars" not in ckpt:
        raise UserError(f"{path} is a stage-1 (AR) checkpoint: serve needs a MARS checkpoint (mars.pt)")
    return model.eval(), tok, ckpt["mars"]["B"], ckpt


def prompts_for_load(ckpt, tok, max_seq, max_batch, data_path=None):
    """(held-out test examples, 12 * max_batch calibration examples) whose prompts fit the context:
    the checkpoint's own test and validation splits, or a JSONL of {prompt, answer} (data_path)."""
    fits = lambda split: [e for e in split if len(tok.prompt_ids(e["prompt"])) < max_seq]
    if data_path:
        test = val = fits(data.read_jsonl(data_path, read=records.read_record))
    elif "train_config" not in ckpt:
        raise UserError(f"{ckpt.get('hf', {}).get('path', 'this checkpoint')} was not trained here and has no "
                        "held-out prompts: give --data FILE (JSONL of {prompt, answer})")
    else:
        cfg = ckpt["train_config"]
        splits = data.splits_of(cfg, read=records.read_record)
        test, val = fits(splits["test"]), fits(splits["val"])
    if not test:
        raise UserError(f"no held-out prompt fits the model's context of {max_seq} tokens")
    return test, ((val or test) * 12 * max_batch)[:12 * max_batch]
