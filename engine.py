"""The one batched decoder: every decoding rule of the project, once.

sample.generate is the paper's loop for one prompt, written to be read; this is the same loop for many
requests at once, as sample.py's batches, extras.bench.eval and extras.serving.serve run it (a test checks that at batch 1
both commit the same tokens in the same forwards). It adds: ragged rows (a KV-cache length per batch row,
windows right-padded); requests joining before a forward and leaving after it, each with its own tau and
budget; three caches: none (the reference), sliding (keep the committed prefix, drop the masks after each
forward) and the paper's block-level cache; lossless decoding and masks="auto" (as many masks as pay for
what they cost, cost.py), both beyond the paper; a trace of what each forward fed, predicted and committed.
"""
import time
from collections import deque
from dataclasses import dataclass, field

import torch

import data
import mars

CACHE_MODES = ("none", "sliding", "block")
MASK_MODES = ("fixed", "auto")  # auto: cost.py, imported only for it


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
def decode_step(model, requests, kv, mask_id, *, temperature=0.0, metric="prob", generator=None, n_vocab=None):
    """One forward for a batch of requests, one row each, each feeding its window. Returns (tokens, conf),
    each (rows, n_read): column 0 is the prediction after the last real token (the AR prediction), then one
    after each draft and each mask; beyond a request's own reads conf is 0. After the forward the cache holds
    every fed position; the caller rolls it back to what it keeps.
    n_vocab: ids from there on (a real checkpoint's padding rows) are never chosen."""
    device = model.wte.weight.device
    cached = [0 if kv is None else r.cached for r in requests]
    windows = [window(r, kv, mask_id) for r in requests]
    width = max(map(len, windows))
    ids = torch.tensor([w + [mask_id] * (width - len(w)) for w in windows], device=device)
    cols = torch.arange(width, device=device)
    positions = torch.tensor(cached, device=device)[:, None] + cols
    u = torch.tensor([len(r.ids) - c for r, c in zip(requests, cached)], device=device)[:, None]  # real tokens fed
    reads = torch.tensor([n_reads(r) for r in requests], device=device)[:, None]
    if kv is not None:
        kv.rollback(cached)
    flat = model(ids, positions=positions, cache=kv, logits_at=(cols >= u - 1) & (cols < u - 1 + reads))
    own = torch.arange(int(reads.max()), device=device) < reads  # (rows, n_read): the row's reads, then padding
    logits = flat.new_zeros(len(requests), own.shape[1], flat.shape[-1])
    logits[own] = flat  # row-major order on both sides
    logits[..., mask_id] = float("-inf")  # a placeholder is never an output
    if n_vocab is not None:
        logits[..., n_vocab:] = float("-inf")
    tokens, conf = mars.choose(logits, temperature, metric, generator)
    return tokens, conf * own


def through_eot(tokens, eot_id):
    """tokens up to and including the first <|endoftext|>: a sequence ends there."""
    return tokens[:tokens.index(eot_id) + 1] if eot_id in tokens else tokens


def commit(request, new, eot_id, past_eot=False):
    """Append new tokens to a request, at most what its budget leaves, cut after <|endoftext|> unless
    past_eot (the block cache fills its span); its output stops at <|endoftext|>. Returns what it kept."""
    request.accepted += len(new)
    new = new[:request.left] if past_eot else through_eot(new[:request.left], eot_id)
    request.left -= len(new)
    request.ids += new
    shown = [] if request.tokens[-1:] == [eot_id] else through_eot(new, eot_id)
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


def kv_slots(prompts, max_seq, max_new_tokens, B, cache, B_cache):
    """KV-cache slots a batch of prompts can need: a row caches at most its final length - 1, then a forward writes
    the widest row's window: 2B - 1 sliding (new tokens or drafts, B - 1 masks), B_cache + 1 for the block cache
    (or 2B - 1 if wider: under masks="auto" it slides)."""
    longest = max(min(len(p) + max_new_tokens, max_seq) for p in prompts)
    widest = max(B_cache + 1 if cache == "block" else 0, 2 * B - 1)
    return longest - 1 + widest


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

    def step(self, decoder):
        """One forward, a write or an inner one; returns its window width."""
        requests, full = decoder.running, not self.filling(decoder.running)
        for r in requests:
            r.n_masks = 0 if full or not mars.masks_to_feed(decoder.B, r.tau) else max(r.end - len(r.ids) - 1, 0)
        tokens, conf, width = decoder.forward()
        self.wrote = full
        committed = [commit(r, new, decoder.eot_id, past_eot=True) if len(r.ids) < r.end else []  # a full request waits
                     for r, (new, _) in zip(requests, decoder.commits(tokens, conf))]
        if self.wrote:  # everything fed is cached but the last token, which opens the next windows
            for r in requests:
                r.cached = len(r.ids) - 1
                r.end = len(r.ids) + min(self.B_cache, r.left)
        decoder.settle(committed)
        return width


class Engine:
    """Continuous batching: requests wait, are admitted before a forward (up to max_batch; a new prompt is
    prefilled in the same forward as the others' steps) and leave after the forward that finishes them. A request
    commits exactly what it would alone (its window, reads and acceptance are its own) unless masks="auto"."""

    def __init__(self, model, eot_id, mask_id, B, max_batch, max_new_tokens=64, *, cache="sliding",
                 B_cache=16, cache_len=None, max_context=None, n_vocab=None, metric="prob", temperature=0.0,
                 max_accept=None, trace=None, masks="fixed", step_cost=None):
        if cache not in CACHE_MODES or masks not in MASK_MODES:
            raise ValueError(f"cache must be one of {CACHE_MODES}, masks one of {MASK_MODES}")
        self.model, self.eot_id, self.mask_id, self.B = model, eot_id, mask_id, B
        self.max_batch, self.max_new_tokens, self.max_accept, self.trace = max_batch, max_new_tokens, max_accept, trace
        self.sampling = dict(temperature=temperature, metric=metric, n_vocab=n_vocab)
        # masks="auto" (beyond the paper) writes at every forward: attention is causal, so a committed token's K/V
        # will not change before its span's end, and keeping it out of the cache only feeds it again. Its spans
        # then last one forward: the block cache under auto is the sliding cache.
        self.block_cache = BlockCache(B_cache) if cache == "block" and masks == "fixed" else None
        # prompt + answer: the model's context, or less (a 32k context would size a 32k cache per row)
        self.max_seq = min(model.config.max_seq_len, max_context or model.config.max_seq_len)
        slots = cache_len or 2 * self.max_seq + max(2 * B, B_cache + 1)  # a joining prompt pads every window
        self.kv = None if cache == "none" else model.new_cache(0, slots)
        self.waiting, self.running, self.forwards = deque(), [], 0
        self.auto = None
        if masks == "auto" and B > 1:  # t(batch, width)
            from cost import AutoMasks
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
            if len(r.prompt) >= self.max_seq:
                raise ValueError(f"prompt of {len(r.prompt)} tokens does not fit the model's context of {self.max_seq}")
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
        tokens, conf = decode_step(self.model, requests, self.kv, self.mask_id, **self.sampling)
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
        reads (a tau that rounds to 0 in float32 would otherwise take the padding)."""
        taus = torch.tensor([r.tau for r in self.running], dtype=torch.float32, device=conf.device)
        reads = torch.tensor([n_reads(r) for r in self.running], device=conf.device)
        n = torch.minimum(mars.accept(conf, taus, self.max_accept), reads)
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
    (a list: one dict per forward and request), masks ("fixed" or "auto") and step_cost (auto's cost model)."""
    if lossless and (cache == "block" or options.get("temperature", 0) > 0):
        raise ValueError("lossless decoding is greedy, with cache none or sliding")
    if not prompts:
        return []
    taus = [float(t) for t in tau] if hasattr(tau, "__len__") else [float(tau)] * len(prompts)
    slots = kv_slots(prompts, model.config.max_seq_len, max_new_tokens, B, cache, B_cache)
    decoder = Engine(model, eot_id, mask_id, B, len(prompts), max_new_tokens, cache=cache, B_cache=B_cache,
                     cache_len=slots, **options)
    requests = [Request(list(p), tau=t, lossless=lossless, index=i) for i, (p, t) in enumerate(zip(prompts, taus))]
    decoder.waiting.extend(requests)
    t0 = clock(model)
    while decoder.backlog:
        decoder.step()
    seconds = clock(model) - t0
    for r in requests:
        r.seconds = seconds
    return requests


def decode_examples(model, tok, examples, batch_size=64, **decode):
    """Yields (example, its finished Request, whether it is right: None without an "answer"), decoding batch_size
    prompts at a time: sample.py's route where a flag needs the engine. decode goes to generate_batch."""
    for i in range(0, len(examples), batch_size):
        batch = examples[i:i + batch_size]
        gens = generate_batch(model, [tok.prompt_ids(e["prompt"]) for e in batch], tok.eot, tok.mask,
                              **{"n_vocab": tok.n_vocab, **decode})  # never an id past the tokenizer
        for e, g in zip(batch, gens):
            yield e, g, data.check(e, tok.answer(g.tokens)) if "answer" in e else None
