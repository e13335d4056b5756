"""The batched engine: the paper's decoding loop (sample.generate) with the tools beyond it.

sample.generate is the paper's loop, written to be read; this is the same loop for requests that join and
leave, as `python -m extras.engine` (__main__.py), extras.bench.eval and extras.serving.serve run it (tests
check that both commit the same tokens in the same forwards). It reuses the loop's small rules (mars.banned,
through_eot, cache_slots) and adds: ragged rows (a KV-cache length per batch row, windows right-padded);
requests joining before a forward and leaving after it, each with its own tau and budget; three caches: none
(the reference), sliding (keep the committed prefix, drop the masks after each forward) and the paper's
block-level cache; lossless decoding and masks="auto" (as many masks as pay for what they cost, cost.py), both
beyond the paper; a trace of what each forward fed, predicted and committed. On CUDA a greedy step replays a
CUDA graph of its fixed shapes over a static KV cache (CudaGraphs, static_cache.py), committing what the eager
step commits; on a CPU the step runs eagerly, as it always has.
"""
import math
import time
import weakref
from collections import deque
from dataclasses import dataclass, field

import torch

import data
import mars
from extras.engine.static_cache import StaticKVCache
from model import KVCache
from sample import check_room

CACHE_MODES = ("none", "sliding", "block")
MASK_MODES = ("fixed", "auto")  # auto: cost.py, imported only for it
GRAPH_MODES = ("off", "captured", "compiled")  # CudaGraphs: none, captured forwards, compiled then captured
GRAPH_WIDTHS = (1, 2, 4, 8, 16, 32)  # a window pads to the next of these; a wider one (a prefill) runs eagerly


@dataclass(eq=False)  # requests compare by identity
class Request:
    prompt: list  # token ids
    tau: float = 1.0  # read at every forward: a serving policy may change it mid-request
    lossless: bool = False  # commit only tokens equal to the AR argmax (tau unused)
    max_new_tokens: int = None  # this request's limit (default: the engine's)
    index: int = 0  # its place in a generate_batch call: the trace's "row"
    # decoding state
    ids: list = None  # prompt + committed tokens
    cached: int = 0  # leading tokens of ids held by its row of the KV cache
    drafts: list = field(default_factory=list)  # lossless only: unverified tokens fed after ids
    n_masks: int = 0  # <|mask|> tokens fed after the drafts
    left: int = 0  # tokens it may still commit (its budget and the context)
    end: int = 0  # block cache: the length of ids at which its current B_cache span is full
    acceptance: list = None  # masks="auto": how often each prediction after the AR one was reached, accepted
    # results
    tokens: list = field(default_factory=list)  # generated ids, <|endoftext|> included when reached
    chunks: list = field(default_factory=list)  # what each forward added to tokens
    forwards: int = 0  # forwards it took part in (the block cache's waits and writes included)
    accepted: int = 0  # tokens the rule accepted, before the cut at <|endoftext|> and the budget
    seconds: float = 0.0  # generate_batch: wall clock of its whole batch


def window(request, kv, mask_id):
    """What a request feeds a forward: the ids its cache row lacks (all without a cache), drafts, masks."""
    cached = 0 if kv is None else request.cached
    return request.ids[cached:] + request.drafts + [mask_id] * request.n_masks


def n_reads(request):
    """Predictions a request reads: the AR one (after its last real token), one per draft, one per mask."""
    return 1 + len(request.drafts) + request.n_masks


@torch.inference_mode()
def decode_step(model, requests, kv, mask_id, *, temperature=0.0, metric="prob", generator=None, n_vocab=None,
                graphs=None):
    """One forward for a batch of requests, one row each, each feeding its window. Returns (tokens, conf),
    each (rows, n_read): column 0 is the prediction after the last real token (the AR prediction), then one
    after each draft and each mask; beyond a request's own reads conf is 0. After the forward the cache holds
    every fed position; the caller rolls it back to what it keeps.
    n_vocab: ids from there on (a real checkpoint's padding rows) never come out.
    graphs: the CudaGraphs that kv belongs to: a greedy step runs there, at fixed shapes."""
    device = model.wte.weight.device
    cached = [0 if kv is None else r.cached for r in requests]
    windows = [window(r, kv, mask_id) for r in requests]
    u = [len(r.ids) - c for r, c in zip(requests, cached)]  # real tokens fed
    if kv is not None:
        kv.rollback(cached)
    if graphs is not None and temperature == 0:
        return graphs.step(model, windows, cached, u, [n_reads(r) for r in requests])
    reads = torch.tensor([n_reads(r) for r in requests], device=device)[:, None]
    width = max(map(len, windows))
    if graphs is not None:  # sampling on the graphs' static cache: its keys must cover this step's positions
        graphs.attend(max(cached) + width)
    ids = torch.tensor([w + [mask_id] * (width - len(w)) for w in windows], device=device)
    cols = torch.arange(width, device=device)
    positions = torch.tensor(cached, device=device)[:, None] + cols
    u = torch.tensor(u, device=device)[:, None]
    flat = logits_at(model, ids, (cols >= u - 1) & (cols < u - 1 + reads), positions=positions, cache=kv)
    own = torch.arange(int(reads.max()), device=device) < reads  # (rows, n_read): the row's reads, then padding
    logits = flat.new_zeros(len(requests), own.shape[1], flat.shape[-1])
    logits[own] = flat  # row-major order on both sides
    tokens, conf = choose(mars.banned(logits, mask_id, n_vocab), temperature, metric, generator)
    return tokens, conf * own


def logits_at(model, ids, at, **forward):
    """The model's logits where a step reads them only (a large vocabulary's cost): at bool (rows, width) ->
    (n, vocab), in row-major order; at long (rows, r) -> (rows, r, vocab), the logits of these columns of each
    row, at fixed shapes with no host sync (a CUDA graph captures it). forward: model.hidden's arguments."""
    x = model.hidden(ids, **forward)
    x = x[at] if at.dtype == torch.bool else x.gather(1, at[..., None].expand(-1, -1, x.shape[-1]))
    return model.lm_head(x)


# ---------------------------------------------------------------------------
# Beyond the paper's greedy rule: the tools of the engine's flags, extras.bench.eval and the servers

METRICS = ("prob", "entropy", "margin")  # the confidences --metric offers, extras.bench.eval sweeps


def choose(logits, temperature=0.0, metric="prob", generator=None):
    """mars.choose (the paper's greedy rule, argmax and its probability) unless a tool asks for more: a token drawn
    at temperature > 0 (--temperature, the server), or another confidence metric (--metric)."""
    if temperature == 0 and metric == "prob":
        return mars.choose(logits)
    logits = logits.float()
    tokens = logits.argmax(-1) if temperature == 0 else gumbel_max(logits, temperature, generator)
    probs = logits.softmax(-1)
    return tokens, probs.gather(-1, tokens[..., None])[..., 0] if metric == "prob" else other_confidence(probs, metric)


def gumbel_max(logits, temperature, generator=None):
    """A token drawn from softmax(logits / T) (Gumbel-max), for --temperature. The confidence stays the untempered
    softmax's, as in the official sampler: T changes the token, not tau's scale."""
    u = torch.rand(logits.shape, generator=generator, device=logits.device)
    return (logits / temperature - torch.log(-torch.log(u.clamp_min(1e-20)))).argmax(-1)


def other_confidence(probs, metric):
    """The confidences --metric compares, on the scale of prob, so that one rule, conf >= tau, serves all:
      margin:  top-1 minus top-2 probability
      entropy: 1 - H(p) / log(vocab)"""
    if metric == "margin":
        top2 = probs.topk(2, dim=-1).values
        return top2[..., 0] - top2[..., 1]
    if metric == "entropy":
        h = -(probs * probs.clamp_min(1e-30).log()).sum(-1)
        return 1 - h / math.log(probs.shape[-1])
    raise ValueError(f"unknown confidence metric {metric!r}; choose from {METRICS}")


# ---------------------------------------------------------------------------
# Committing

def commit(request, new, eot_id, past_eot=False):
    """Append new tokens to a request, at most what its budget leaves, cut after <|endoftext|> unless
    past_eot (the block cache fills its span); its output stops at <|endoftext|>. Returns what it kept."""
    request.accepted += len(new)
    new = new[:request.left] if past_eot else mars.through_eot(new[:request.left], eot_id)
    request.left -= len(new)
    request.ids += new
    shown = [] if request.tokens[-1:] == [eot_id] else mars.through_eot(new, eot_id)
    if shown:
        request.tokens += shown
        request.chunks.append(shown)
    return new


def lossless_commit(preds, drafts):
    """Self-speculative verification (beyond the paper): preds holds the AR argmax after the last token and
    after each draft, then the masks' predictions. Accept drafts while each equals the AR token at its place,
    then commit the AR token there. Returns (commit, next drafts): the masks' predictions if every draft survived."""
    m = 0
    while m < len(drafts) and drafts[m] == preds[m]:
        m += 1
    return drafts[:m] + [preds[m]], preds[len(drafts) + 1:] if m == len(drafts) else []


def kv_slots(longest, B, cache, B_cache):
    """KV-cache slots a row can need in a cache mode: mars.cache_slots; with the block cache, room for a window of
    B_cache + 1 positions (a span and the token before it) if wider (under masks="auto" it slides)."""
    slots = mars.cache_slots(longest, B)
    return max(slots, longest + B_cache) if cache == "block" else slots


class JoinKVCache(KVCache):
    """model.KVCache whose batch grows: requests join a running batch."""

    def add_rows(self, n):
        """Append n empty rows."""
        empty = self.k.new_zeros(self.k.shape[0], n, *self.k.shape[2:])
        self.k, self.v = torch.cat([self.k, empty], dim=1), torch.cat([self.v, empty], dim=1)
        self.lengths = self.lengths + [0] * n


@dataclass
class BlockCache:
    """The paper's block-level KV cache (the official MARSBlockCachedSampler). The cached prefix stays
    frozen while each request fills its next B_cache positions: each inner forward feeds the span (its
    committed tokens, then masks to its end) and commits left to right, never past its end; a full request
    waits. When every request is full, one forward writes the spans into the cache (it counts, as does
    the prompt's first write); requests join and leave only then. masks="fixed" only (see Engine)."""
    B_cache: int  # positions filled between two writes: the cache's synchronisation granularity, not MARS's B
    wrote: bool = False  # the last forward was a write

    @staticmethod
    def filling(requests):  # between two writes
        return any(len(r.ids) < r.end for r in requests)

    def step(self, engine):
        """One forward, a write or an inner one; returns its window width."""
        requests, full = engine.running, not self.filling(engine.running)
        for r in requests:
            r.n_masks = 0 if full or not mars.masks_to_feed(engine.B, r.tau) else max(r.end - len(r.ids) - 1, 0)
        tokens, conf, width = engine.forward()
        self.wrote = full
        committed = [commit(r, new, engine.eot_id, past_eot=True) if len(r.ids) < r.end else []  # a full request waits
                     for r, (new, _) in zip(requests, engine.commits(tokens, conf))]
        if self.wrote:  # everything fed is cached but the last token, which opens the next windows
            for r in requests:
                r.cached = len(r.ids) - 1
                r.end = len(r.ids) + min(self.B_cache, r.left)
        engine.settle(committed)
        return width


class Engine:
    """Continuous batching: requests wait, are admitted before a forward (up to max_batch; a new prompt is prefilled
    in the forward of the others' steps) and leave after the one that finishes them, committing what they would alone
    (their windows, reads and acceptance are their own) unless masks="auto"."""

    def __init__(self, model, eot_id, mask_id, B, max_batch, max_new_tokens=64, *, cache="sliding",
                 B_cache=16, cache_len=None, max_context=None, n_vocab=None, metric="prob", temperature=0.0,
                 max_accept=None, trace=None, masks="fixed", step_cost=None, graphs=None):
        if cache not in CACHE_MODES or masks not in MASK_MODES or graphs not in (None, *GRAPH_MODES):
            raise ValueError(f"cache: one of {CACHE_MODES}, masks: one of {MASK_MODES}, graphs: one of {GRAPH_MODES}")
        self.model, self.eot_id, self.mask_id, self.B = model, eot_id, mask_id, B
        self.max_batch, self.max_new_tokens, self.trace = max_batch, max_new_tokens, trace
        self.max_accept = max_accept  # a cap on the tokens a forward commits: a tool (--max_accept)
        self.sampling = dict(temperature=temperature, metric=metric, n_vocab=n_vocab)
        # masks="auto" (beyond the paper) writes at every forward: a committed token's K/V will not change (causal
        # attention), and keeping it out only feeds it again; so under auto the block cache is the sliding cache.
        self.block_cache = BlockCache(B_cache) if cache == "block" and masks == "fixed" else None
        # prompt + answer: the model's context, or less (a 32k context would size a 32k cache per row)
        self.max_seq = min(model.config.max_seq_len, max_context or model.config.max_seq_len)
        slots = cache_len or kv_slots(2 * self.max_seq, B, cache, B_cache)  # a joining prompt pads every window
        # CUDA graphs by default on CUDA, with a cache (masks="auto" sizes its windows on the eager step's profile)
        graphs = graphs or ("captured" if model.wte.weight.is_cuda and masks == "fixed" else "off")
        self.graphs = None if cache == "none" or graphs == "off" else lend_graphs(self, slots, graphs == "compiled")
        p = model.wte.weight
        self.kv = (None if cache == "none" else self.graphs.cache if self.graphs
                   else JoinKVCache(model.config, 0, slots, p.dtype, p.device))
        self.waiting, self.running, self.forwards = deque(), [], 0
        self.auto = None
        if masks == "auto" and B > 1:  # t(batch, width)
            from extras.engine.cost import AutoMasks
            self.auto = AutoMasks(self, step_cost, decode_step)

    @property
    def backlog(self):
        return len(self.waiting) + len(self.running)

    def evict(self, keep):
        """Keep running[i] for i in keep, with their cache rows; the others leave."""
        if len(keep) < len(self.running):
            if self.kv is not None:
                self.kv.keep_rows(keep)
            self.running = [self.running[i] for i in keep]

    def admit(self):
        """Waiting requests join, up to max_batch (the block cache: only at a write)."""
        if self.block_cache and self.block_cache.filling(self.running):
            return
        n = min(len(self.waiting), self.max_batch - len(self.running))
        for _ in range(n):
            r = self.waiting.popleft()
            check_room(r.prompt, self.max_seq)
            r.ids = list(r.prompt)
            r.left = min(r.max_new_tokens or self.max_new_tokens, self.max_seq - len(r.prompt))
            self.running.append(r)
        if n and self.kv is not None:
            self.kv.add_rows(n)

    def step(self):
        """Admit, one forward, commit, evict. Returns (stepped, finished, width): who it carried, who left, its cost."""
        self.admit()
        stepped = list(self.running)
        if not stepped:
            return [], [], 0
        width = self.block_cache.step(self) if self.block_cache else self.slide_step()
        may_leave = not self.block_cache or self.block_cache.wrote  # the block cache: after a write only
        leave = [may_leave and (r.left <= 0 or r.tokens[-1:] == [self.eot_id]) for r in stepped]
        self.evict([i for i, out in enumerate(leave) if not out])
        return stepped, [r for r, out in zip(stepped, leave) if out], width

    def forward(self):
        """decode_step over the running requests: (tokens, conf, window width). Counts it; traces it."""
        requests = self.running
        if self.auto:  # fewer masks where they would cost more than they commit
            self.auto.size(requests)
        tokens, conf = decode_step(self.model, requests, self.kv, self.mask_id, graphs=self.graphs, **self.sampling)
        self.forwards += 1
        for r in requests:
            r.forwards += 1
        windows = [window(r, self.kv, self.mask_id) for r in requests]
        if self.trace is not None:
            for r, fed, t, c in zip(requests, windows, tokens.tolist(), conf.tolist()):
                n, cached = n_reads(r), r.cached if self.kv is not None else 0
                self.trace.append(dict(step=self.forwards - 1, row=r.index, cache_before=cached, tokens=t[:n],
                                       conf=c[:n], fed=fed))
        return tokens, conf, max(map(len, windows))

    def commits(self, tokens, conf):
        """Each request's commit: lossless verification, or mars.accept under its own tau, never past its own
        reads (a tau that rounds to 0 in float32 would otherwise take the padding) nor past max_accept."""
        taus = torch.tensor([[r.tau] for r in self.running], dtype=torch.float32, device=conf.device)
        most = torch.tensor([min(n_reads(r), self.max_accept or n_reads(r)) for r in self.running], device=conf.device)
        n = torch.minimum(mars.accept(conf, taus), most)
        per_request = torch.cat([n[:, None], tokens], dim=1).tolist()
        out = [lossless_commit(preds[:n_reads(r)], r.drafts) if r.lossless else (preds[:k], [])
               for r, (k, *preds) in zip(self.running, per_request)]
        if self.auto:
            self.auto.observe(self.running, [len(new) - 1 for new, _ in out])
        return out

    def settle(self, committed):
        """Roll the cache back to what each request keeps; finish the trace entries of this forward."""
        if self.kv is not None:
            self.kv.rollback([r.cached for r in self.running])
        if self.trace is not None:
            for e, r, new in zip(self.trace[-len(self.running):], self.running, committed):
                e.update(committed=new, cache_after=r.cached if self.kv is not None else 0)

    def slide_step(self):
        """Sliding cache (or none): feed [uncached real tokens | drafts | masks], commit what the rule
        accepts; the cache keeps the real tokens fed. A request at tau = 1.0 commits its AR token alone,
        so it is fed no masks and costs what AR costs."""
        for r in self.running:
            r.n_masks = self.B - 1 if r.lossless else mars.masks_to_feed(self.B, r.tau)
        tokens, conf, width = self.forward()
        committed = []
        for r, (new, drafts) in zip(self.running, self.commits(tokens, conf)):
            kept = commit(r, new, self.eot_id)
            r.drafts = drafts if kept == new else []
            r.cached = len(r.ids) - (1 if r.lossless else len(kept))  # lossless fed its accepted drafts too
            committed.append(kept)
        self.settle(committed)
        return width


def clock(model):
    """time.perf_counter() once the model's device has finished its queued work (CUDA runs asynchronously)."""
    if model.wte.weight.device.type == "cuda":
        torch.cuda.synchronize(model.wte.weight.device)
    return time.perf_counter()


def generate_batch(model, prompts, eot_id, mask_id, *, B=1, tau=1.0, cache="sliding", B_cache=16,
                   lossless=False, max_new_tokens=64, **options):
    """Decode a batch of prompts (lists of ids) together; returns one finished Request per prompt.
    tau: a number or one per prompt. options: metric, temperature, max_accept, n_vocab, trace
    (a list: one dict per forward and request), masks ("fixed" or "auto"), step_cost (auto's cost model) and
    graphs (GRAPH_MODES; default: captured on CUDA, else off)."""
    if lossless and (cache == "block" or options.get("temperature", 0) > 0):
        raise ValueError("lossless decoding is greedy, with cache none or sliding")
    if not prompts:
        return []
    taus = [float(t) for t in tau] if hasattr(tau, "__len__") else [float(tau)] * len(prompts)
    longest = max(min(len(p) + max_new_tokens, model.config.max_seq_len) for p in prompts)
    slots = kv_slots(longest, B, cache, B_cache)
    engine = Engine(model, eot_id, mask_id, B, len(prompts), max_new_tokens, cache=cache, B_cache=B_cache,
                     cache_len=slots, **options)
    requests = [Request(list(p), tau=t, lossless=lossless, index=i) for i, (p, t) in enumerate(zip(prompts, taus))]
    engine.waiting.extend(requests)
    t0 = clock(model)
    try:
        while engine.backlog:
            engine.step()
    finally:
        if engine.graphs:  # the next call's engine borrows them
            engine.graphs.holder = None
    seconds = clock(model) - t0
    for r in requests:
        r.seconds = seconds
    return requests


def decode_examples(model, tok, examples, batch_size=64, check=data.check, **decode):
    """Yields (example, its finished Request, whether it is right by check: None without an "answer"), decoding
    batch_size prompts at a time (python -m extras.engine, extras.bench.eval). decode goes to generate_batch."""
    for i in range(0, len(examples), batch_size):
        batch = examples[i:i + batch_size]
        gens = generate_batch(model, [tok.prompt_ids(e["prompt"]) for e in batch], tok.eot, tok.mask,
                              **{"n_vocab": tok.n_vocab, **decode})  # never an id past the tokenizer
        for e, g in zip(batch, gens):
            yield e, g, check(e, tok.answer(g.tokens)) if "answer" in e else None


# ---------------------------------------------------------------------------
# CUDA graphs: decode_step's greedy forward at fixed shapes, replayed (the engine's default on CUDA)

def fixed_step(model, cache, inputs, n_read, mask_id, n_vocab, metric):
    """decode_step's device part on a StaticKVCache, greedy, from one integer tensor (rows, width + 3): each row's
    window, then its cached length, the real tokens it feeds (u) and its reads. Returns decode_step's tokens and
    conf, (rows, n_read); beyond a row's reads both are 0. Nothing in it reads the host, so that a CUDA graph
    captures it whole."""
    ids, cached, u, reads = inputs[:, :-3], inputs[:, -3:-2], inputs[:, -2:-1], inputs[:, -1:]
    cols = torch.arange(ids.shape[1], device=ids.device)
    at = (u - 1 + cols[:n_read]).clamp(max=ids.shape[1] - 1)  # past a row's reads: any column, then zeroed
    logits = logits_at(model, ids, at, positions=cached + cols, cache=cache)
    tokens, conf = choose(mars.banned(logits, mask_id, n_vocab), 0.0, metric)
    own = cols[:n_read] < reads
    return tokens * own, conf * own


def packed(windows, cached, u, reads, width, rows, mask_id):
    """fixed_step's inputs: windows right-padded with masks to width, then rows of masks at position 0 up to rows."""
    real = [w + [mask_id] * (width - len(w)) + [c, n, r] for w, c, n, r in zip(windows, cached, u, reads)]
    return torch.tensor(real + [[mask_id] * width + [0, 1, 1]] * (rows - len(windows)))


class CudaGraphs:
    """decode_step at the GPU's speed rather than Python's (gpt-fast's recipe): a static KV cache, and `fixed_step` at
    fixed shapes, each captured once in a CUDA graph and replayed. A small model's eager forward is hundreds of
    kernel launches, each costing the host more than the GPU; a replay is one. Rows pad to a power of two, windows
    to the next of GRAPH_WIDTHS: padding sits after the real tokens, which never attend to it, and is never read;
    the keys attended, to a power of two above the positions fed (a graph per length, not the whole cache at every
    step). A wider forward (a prompt's prefill) runs `fixed_step` eagerly at its own shape. compiled: torch.compile
    `fixed_step` before capture (fused kernels; compiling takes a while, once per process). On a CPU nothing is
    captured: the fixed shapes run eagerly (the tests check them there). choice: (mask_id, n_vocab, metric)."""

    def __init__(self, model, rows, max_len, choice, compiled):
        p = model.wte.weight
        self.cache = StaticKVCache(model.config, 1 << (rows - 1).bit_length(), max_len, p.dtype, p.device)
        self.weights, self.choice, self.compiled = weights(model), choice, compiled
        self.run = torch.compile(fixed_step, dynamic=True) if compiled else fixed_step
        self.captured = {}  # (rows, width, keys, n_read) -> (inputs, graph, outputs)
        self.holder = None  # the engine that borrows it
        self.pool = None  # the graphs' memory, shared: one replays at a time, its outputs copied before the next
        self.fell_back = None  # compiled: why the steps run uncompiled, if they do

    def fixed_step(self, model, inputs, n_read):
        """`fixed_step` on the cache; compiled, it fails loudly at Dynamo's recompile limit (which would silently run it
        eagerly), and from then on runs uncompiled, said once and recorded in fell_back."""
        if not self.compiled or self.fell_back:
            return fixed_step(model, self.cache, inputs, n_read, *self.choice)
        try:
            with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
                return self.run(model, self.cache, inputs, n_read, *self.choice)
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            self.fell_back = "Dynamo's recompile limit: the fixed shapes run uncompiled (still captured on CUDA)"
            print(f"graphs='compiled' fell back: {self.fell_back}", flush=True)
            return fixed_step(model, self.cache, inputs, n_read, *self.choice)

    def step(self, model, windows, cached, u, reads):
        """decode_step's tokens and conf for the rows' windows, cached lengths, real tokens fed and reads."""
        n, width, mask_id = len(windows), max(map(len, windows)), self.choice[0]
        padded = next((w for w in GRAPH_WIDTHS if w >= width), None)
        self.attend(max(cached) + (padded or width))
        if padded is None:  # a prefill: once per prompt, eagerly
            inputs = packed(windows, cached, u, reads, width, n, mask_id).to(self.cache.k.device)
            return self.fixed_step(model, inputs, max(reads))
        n_read = next(w for w in GRAPH_WIDTHS if w >= max(reads))  # the columns read, padded: not the window's
        host = packed(windows, cached, u, reads, padded, 1 << (n - 1).bit_length(), mask_id)
        shape = (*host.shape, self.cache.keys, n_read)
        if shape not in self.captured:
            self.captured[shape] = self.capture(model, host, n_read)
        inputs, graph, out = self.captured[shape]
        inputs.copy_(host)
        if graph is None:  # a CPU
            out = self.fixed_step(model, inputs, n_read)
        else:
            graph.replay()
        return out[0][:n, :max(reads)].clone(), out[1][:n, :max(reads)].clone()  # the next replay overwrites out

    def attend(self, end):
        """Every query of the next forward attends the cache's first `keys` slots: a power of two (128 at least) at
        or past end, the position after the last one fed."""
        if end > self.cache.max_len:
            raise ValueError(f"KV cache overflow: {end} > {self.cache.max_len} slots")
        self.cache.keys = min(max(1 << (end - 1).bit_length(), 128), self.cache.max_len)

    def capture(self, model, host, n_read):
        """(static inputs, graph, its outputs) for host's shape, the cache's keys and the columns read (n_read): warmed
        up on a side stream (lazy initialisations cannot happen in a capture), then captured. Its writes are those of
        the step it serves: the same keys and values at the same slots. A CPU has no graphs: (inputs, None, None)."""
        inputs = host.to(self.cache.k.device)
        if inputs.device.type != "cuda":
            return inputs, None, None
        with torch.cuda.device(inputs.device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self.fixed_step(model, inputs, n_read)
            torch.cuda.current_stream().wait_stream(side)
            self.pool = self.pool or torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self.fixed_step(model, inputs, n_read)
        return inputs, graph, out


_shared = weakref.WeakKeyDictionary()  # model -> the CudaGraphs one engine at a time borrows


def weights(model):
    """Where the model's weights are: a graph reads them there (a model moved or cast has new ones)."""
    return tuple(p.data_ptr() for p in model.parameters())


def lend_graphs(engine, slots, compiled):
    """The model's shared CudaGraphs for this engine if no live engine holds it and it fits (rows, slots, the same
    weights and choice), else a new one, shared from then on unless another engine holds the old. Engines decode
    one after another (generate_batch makes one per call): each would otherwise capture its shapes again. Its
    cache has room for the widest padding, in multiples of 256 slots, so that later engines fit."""
    model, old = engine.model, _shared.get(engine.model)
    rows, max_len = engine.max_batch, 256 * math.ceil((slots + GRAPH_WIDTHS[-1]) / 256)
    choice = (engine.mask_id, engine.sampling["n_vocab"], engine.sampling["metric"])
    free = old is not None and (old.holder is None or old.holder() is None)
    same = free and (old.weights, old.choice, old.compiled) == (weights(model), choice, compiled)
    if same and old.cache.k.shape[1] >= rows and old.cache.max_len >= max_len:
        graphs = old
    else:
        if same:  # grow: the next engine may need what the last one did
            rows, max_len = max(rows, old.cache.k.shape[1]), max(max_len, old.cache.max_len)
        graphs = CudaGraphs(model, rows, max_len, choice, compiled)
        if old is None or free:
            _shared[model] = graphs
    graphs.holder, graphs.cache.lengths = weakref.ref(engine), []
    return graphs
