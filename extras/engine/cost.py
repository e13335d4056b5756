"""What a forward costs, and how many masks pay for themselves (beyond the paper).

The paper feeds B - 1 masks at every forward. They are not free: a forward of width w + k costs more than
one of width w, a little where a forward is memory-bound (batch 1), nearly k/w more where it is compute-bound
(a big batch on a CPU). engine.py's masks="auto" feeds each request the number of masks, from 0 (plain AR
with the KV cache) up to what the fixed mode feeds, that maximises its expected committed tokens per second:

    E(k) / t(batch, width(k)),   E(k) = 1 + sum_{i=1..k} p_1 ... p_i,

t the StepCost below, p_j the request's running rate of acceptance of prediction j + 1 when it was reached
(AutoMasks). Acceptance is still conf >= tau and lossless decoding stays exact: only the number of masks
changes. Under the block cache, auto writes at every forward, so it slides (engine.Engine says why). Its
outputs then depend on this machine's timings, which is why the fixed mode is the default.
extras.serving.serve's virtual clock uses the same cost model. The engine imports this module; profiling times
the engine's forward, which its callers hand in (decode_step).
"""
import bisect
import time
import weakref
from types import SimpleNamespace

import numpy as np
import torch

PRIOR = 2.0  # a request's acceptance starts at the engine-wide rate, which counts as this many of its own forwards
AUTO_CONTEXT = 128  # tokens each profiled row has cached: a prompt and an answer, as this project decodes


class StepCost:
    """t(batch, width): seconds of one decoding forward, profiled on a grid, bilinear in between, extended
    along the last width segment's slope beyond the grid (a prompt being prefilled, or no cache)."""

    def __init__(self, batches, widths, seconds):  # at least two widths
        # more work never costs less: take out the timing noise that says otherwise
        seconds = np.maximum.accumulate(np.maximum.accumulate(np.asarray(seconds, dtype=float), axis=0), axis=1)
        self.batches, self.widths, self.seconds = list(batches), list(widths), seconds
        self.rows = {}  # batch -> seconds per width: masks="auto" asks before every forward, in plain Python

    def __call__(self, batch, width):
        if batch not in self.rows:
            self.rows[batch] = [float(np.interp(batch, self.batches, column)) for column in self.seconds.T]
        w, t = self.widths, self.rows[batch]
        i = min(max(bisect.bisect(w, width) - 1, 0), len(w) - 2)  # the segment, the last one beyond the grid
        return t[i] + (width - w[i]) * (t[i + 1] - t[i]) / (w[i + 1] - w[i])

    @classmethod
    @torch.inference_mode()
    def profile(cls, decode_step, model, mask_id, batches, widths, context, repeats=8):
        """The fastest of `repeats` timings of engine.decode_step at each grid point, rows with about `context`
        tokens cached, each a different length: the ragged rows the engine almost always runs (equal lengths
        would take the cache's cheaper slice path). The minimum, and rounds over the whole grid rather than
        repeats in a row: on a shared machine other processes only ever add time, and a busy spell then
        spoils no point for good. One forward per batch size first warms up its shapes."""
        cached = [max(context - k % 4, 0) for k in range(max(batches))]
        caches = {b: model.new_cache(b, context + max(widths) + 1) for b in batches}
        seconds = np.full((len(batches), len(widths)), np.inf)

        def forward(b, w):
            rows = [SimpleNamespace(ids=[mask_id] * (c + w), cached=c, drafts=[], n_masks=0) for c in cached[:b]]
            t0 = time.perf_counter()
            decode_step(model, rows, caches[b], mask_id)[0].tolist()  # to the host: waits for the device
            return time.perf_counter() - t0

        for b in batches:
            forward(b, max(widths))
        for _ in range(repeats):
            for i, b in enumerate(batches):
                for j, w in enumerate(widths):
                    seconds[i, j] = min(seconds[i, j], forward(b, w))
        return cls(batches, widths, seconds)


def batch_grid(max_batch):
    """Powers of two below max_batch, and max_batch."""
    return sorted({2 ** k for k in range(max_batch.bit_length())} | {max_batch})


_measured = weakref.WeakKeyDictionary()  # model -> {(device, dtype): StepCost}: one profile per model in a process


def measured(decode_step, model, mask_id, max_batch, B):
    """A short profile for masks="auto" (a few seconds): batches up to max_batch, widths 1 to 2B (the widest
    sliding window is 2B - 1), three rounds. Kept per model, device and dtype for the process, and reused by
    every engine it covers (extras.bench.eval builds one per batch); profiled again, larger, when one needs more."""
    weight = model.wte.weight
    known = _measured.setdefault(model, {})
    old = known.get((weight.device, weight.dtype))
    if old:
        if old.batches[-1] >= max_batch and old.widths[-1] >= 2 * B:
            return old
        max_batch, B = max(max_batch, old.batches[-1]), max(B, old.widths[-1] // 2)
    widths = list(range(1, 2 * B + 1))
    context = min(model.config.max_seq_len // 2, AUTO_CONTEXT)
    cost = StepCost.profile(decode_step, model, mask_id, batch_grid(max_batch), widths, context, repeats=3)
    known[weight.device, weight.dtype] = cost
    return cost


def best_masks(chances, cost, fed=None):
    """How many masks each request of a batch feeds: min(K, len(chances[r])) for the K that maximises the batch's
    expected committed tokens per second, sum_r E_r(k_r) / cost(batch, width), the fewest on a tie.

    chances[r][j - 1]: the chance that request r's prediction j + 1 is accepted once reached, for each mask it
    may feed; E_r(k) = 1 + sum_{i <= k} prod_{j <= i} chances[r][j - 1], the tokens it is expected to commit.
    width: the forward's, its widest row's, fed_r + k_r, fed_r being what row r carries whatever k (the whole
    sequence without a cache); fed=None: the sliding cache, whose row carries what its last forward committed,
    E_r(k_r) once k_r is what it feeds (so a token is paid for when it is fed).
    One K for the batch: a row's masks cost nothing while another row is wider, so every row takes them."""
    gains = []  # per request, E(k) for k = 0..its most
    for p in chances:
        E, reached = [1.0], 1.0
        for chance in p:
            reached *= chance
            E.append(E[-1] + reached)
        gains.append(E)
    best, best_rate, carried, n = 0, 0.0, fed or [None] * len(gains), len(chances)
    for K in range(max(map(len, chances), default=0) + 1):
        tokens = width = 0
        for E, f in zip(gains, carried):
            k = min(K, len(E) - 1)
            tokens += E[k]
            width = max(width, k + (E[k] if f is None else f))
        rate = tokens / cost(n, width)
        if rate > best_rate:
            best, best_rate = K, rate
    return [min(best, len(p)) for p in chances]


class AutoMasks:
    """The engine's masks="auto": before a forward, the masks of each request (at most what the fixed mode would
    feed it), by best_masks from the cost model and the requests' acceptance so far; after it, what was accepted.

    Counts per prediction j + 1: how often it was reached (fed, and predictions 2..j accepted) and accepted,
    per request (Request.acceptance) and over all. A request's rate is its own counts plus PRIOR forwards at
    the engine-wide rate (A + 1) / (N + 1), which starts optimistic (1.0: feed masks, then learn) and goes on
    learning from every request that feeds masks: a request that stopped feeding them follows the others'.
    Plain Python on a few numbers per request: this runs before every forward, and must cost far less than
    the forward it sizes (a millisecond, for a small model)."""

    def __init__(self, engine, step_cost=None, decode_step=None):
        self.most = engine.B - 1  # the fixed mode's masks
        self.cost = step_cost or measured(decode_step, engine.model, engine.mask_id, engine.max_batch, engine.B)
        self.sliding, self.max_accept = engine.kv is not None, engine.max_accept
        self.total = self.new_counts()
        self.prior = [1.0] * self.most  # the engine-wide rates

    def new_counts(self):
        return [[0] * self.most, [0] * self.most]  # [reached, accepted] per prediction after the AR one

    def rates(self, request, most):
        """The request's estimated acceptance of predictions 2, ..., most + 1."""
        reached, accepted = request.acceptance or self.new_counts()
        return [(accepted[j] + PRIOR * self.prior[j]) / (reached[j] + PRIOR) for j in range(most)]

    def size(self, requests):
        """Set each request's n_masks, at most what it was given (the fixed mode's)."""
        cap = self.max_accept - 1 if self.max_accept else self.most
        most = [max(min(r.n_masks, r.left - 1, cap), 0) for r in requests]  # masks whose predictions could commit
        chances = [self.rates(r, m) for r, m in zip(requests, most)]
        fed = None if self.sliding else [len(r.ids) + len(r.drafts) for r in requests]  # no cache: all of it
        for r, k in zip(requests, best_masks(chances, self.cost, fed)):
            r.n_masks = k

    def observe(self, requests, extra):
        """extra: per request, the predictions after the AR one that its forward accepted (lossless: its drafts)."""
        for r, got in zip(requests, extra):
            fed = len(r.drafts) if r.lossless else r.n_masks  # lossless verifies the drafts, the last masks' output
            if fed:
                r.acceptance = r.acceptance or self.new_counts()
                for counts in (r.acceptance, self.total):
                    for j in range(min(got + 1, fed)):
                        counts[0][j] += 1
                    for j in range(got):
                        counts[1][j] += 1
        self.prior = [(accepted + 1) / (reached + 1) for reached, accepted in zip(*self.total)]
