"""The one batched decoder: every decoding rule of the project, once.

sample.generate is the paper's loop for one prompt, written to be read. This is the
same loop for many requests at once, each with its own tau, length and budget, as
sample.py's batches, extras.eval and extras.serve run it (a test checks that at batch 1
both commit the same tokens in the same forwards). What it adds:
  ragged rows     each row has its own KV-cache length; windows are right-padded;
  joining/leaving requests are admitted before a forward and leave after it;
  caches          none (the reference), sliding (cache the committed prefix, drop the
                  masks after each forward) or block (the paper's block-level cache);
  lossless        commit only what AR greedy decoding would (beyond the paper);
  the trace       per forward and row: what was fed, predicted and committed.
"""
import time
from collections import deque
from dataclasses import dataclass, field

import torch

import mars

CACHE_MODES = ("none", "sliding", "block")


@dataclass(eq=False)  # requests compare by identity
class Request:
    prompt: list  # token ids
    tau: float = 1.0  # read at every forward: a serving policy may change it mid-request
    lossless: bool = False  # commit only tokens equal to the AR argmax (tau unused)
    max_new_tokens: int = None  # this request's limit (default: the engine's)
    cancelled: bool = False  # set by anyone (a client hung up): the request leaves before the next forward
    index: int = 0  # its place in a generate_batch call: the trace's "row"
    # decoding state
    ids: list = None  # prompt + committed tokens
    cached: int = 0  # leading tokens of ids held by the row's KV cache
    drafts: list = field(default_factory=list)  # lossless only: unverified tokens fed after ids
    n_masks: int = 0  # <|mask|> tokens fed after the drafts
    left: int = 0  # tokens it may still commit (its budget and the context)
    end: int = 0  # block cache: the length of ids at which the current block is full
    # results
    tokens: list = field(default_factory=list)  # generated ids, <|endoftext|> included when reached
    chunks: list = field(default_factory=list)  # what each forward added to tokens
    steps: int = 0  # forwards it took part in (the block cache's waits and writes included)
    accepted: int = 0  # tokens the rule accepted, before the cut at <|endoftext|> and the budget
    tau_sum: float = 0.0  # the sum of its tau over its forwards (a policy may vary it)
    batch_forwards: int = 0  # generate_batch: forwards of its whole batch
    seconds: float = 0.0  # generate_batch: wall clock of its whole batch


@torch.inference_mode()
def decode_step(model, rows, kv, mask_id, *, temperature=0.0, metric="prob", generator=None, n_vocab=None):
    """One forward for a batch of rows: each feeds ids[cached:] + drafts + n_masks masks (no cache: from 0).

    Returns (tokens, conf), each (rows, n_read): column 0 is the prediction after the last real token (the AR
    prediction), then one after each draft and each mask; beyond a row's own reads conf is 0. After the
    forward the cache holds every fed position; the caller rolls it back to what it keeps.
    n_vocab: ids from there on (a real checkpoint's padding rows) are never chosen."""
    device = model.wte.weight.device
    start = [0 if kv is None else r.cached for r in rows]
    windows = [r.ids[s:] + r.drafts + [mask_id] * r.n_masks for r, s in zip(rows, start)]
    width = max(map(len, windows))
    ids = torch.tensor([w + [mask_id] * (width - len(w)) for w in windows], device=device)
    cols = torch.arange(width, device=device)
    positions = torch.tensor(start, device=device)[:, None] + cols
    u = torch.tensor([len(r.ids) - s for r, s in zip(rows, start)], device=device)[:, None]  # real tokens fed
    reads = torch.tensor([1 + len(r.drafts) + r.n_masks for r in rows], device=device)[:, None]
    if kv is not None:
        kv.rollback(start)
    flat = model(ids, positions=positions, cache=kv, logits_at=(cols >= u - 1) & (cols < u - 1 + reads))
    own = torch.arange(int(reads.max()), device=device) < reads  # (rows, n_read): the row's reads, then padding
    logits = flat.new_zeros(len(rows), own.shape[1], flat.shape[-1])
    logits[own] = flat  # row-major order on both sides
    logits[..., mask_id] = float("-inf")  # a placeholder is never an output
    if n_vocab is not None:
        logits[..., n_vocab:] = float("-inf")
    tokens, conf = mars.choose(logits, temperature, metric, generator)
    return tokens, conf * own


def through_eot(tokens, eot_id):
    """tokens up to and including the first <|endoftext|>: a sequence ends there."""
    return tokens[:tokens.index(eot_id) + 1] if eot_id in tokens else tokens


def lossless_commit(row, drafts, B):
    """Self-speculative verification (beyond the paper): row holds the AR argmax after the last
    token and after each draft, then the masks' predictions. Accept drafts while each equals the
    AR token at its place, then commit the AR token there. Returns (commit, next drafts): when every
    draft survived, the masks' predictions become the next drafts; else they are dropped."""
    m = 0
    while m < len(drafts) and drafts[m] == row[m]:
        m += 1
    return drafts[:m] + [row[m]], row[len(drafts) + 1:len(drafts) + B] if m == len(drafts) else []


def kv_slots(prompts, max_seq, max_new_tokens, B, cache, cache_block):
    """KV-cache slots a batch of prompts can need: a forward writes its window, padded to the widest
    row's, after the longest row's cached tokens. A row caches at most its final length - 1; the widest
    later window is 2B - 1 when sliding (new tokens or drafts, then B - 1 masks), cache_block + 1 for blocks."""
    longest = max(min(len(p) + max_new_tokens, max_seq) for p in prompts)
    widest = cache_block + 1 if cache == "block" else 2 * B - 1
    return longest - 1 + widest


class Engine:
    """Continuous batching: requests wait, are admitted before a forward (up to max_batch; a new
    prompt is prefilled in the same forward as the others' steps) and leave after the forward that
    finishes them. A request commits exactly what it would commit alone: its window, reads and
    acceptance are its own, whatever else shares the batch."""

    def __init__(self, model, eot_id, mask_id, B, max_batch, max_new_tokens=64, *, cache="sliding",
                 cache_block=16, cache_len=None, max_context=None, n_vocab=None, metric="prob", temperature=0.0,
                 max_accept=None, trace=None):
        if cache not in CACHE_MODES:
            raise ValueError(f"cache must be one of {CACHE_MODES}")
        self.model, self.eot_id, self.mask_id, self.B = model, eot_id, mask_id, B
        self.max_batch, self.max_new_tokens, self.cache, self.cache_block = max_batch, max_new_tokens, cache, cache_block
        self.choose = dict(temperature=temperature, metric=metric, n_vocab=n_vocab)
        self.max_accept, self.trace = max_accept, trace
        # prompt + answer: the model's context, or less (a 32k context would size a 32k cache per row)
        self.max_seq = min(model.config.max_seq_len, max_context or model.config.max_seq_len)
        slots = cache_len or 2 * self.max_seq + max(2 * B, cache_block + 1)  # a joining prompt pads every window
        self.kv = None if cache == "none" else model.new_cache(0, slots)
        self.waiting, self.running = deque(), []
        self.forwards, self.filling = 0, False  # filling: the block cache is inside a block

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
        self.evict([i for i, r in enumerate(self.running) if not r.cancelled])
        self.waiting = deque(r for r in self.waiting if not r.cancelled)
        n = 0 if self.filling else min(len(self.waiting), self.max_batch - len(self.running))
        for _ in range(n):  # the block cache admits at block boundaries only
            r = self.waiting.popleft()
            if len(r.prompt) >= self.max_seq:
                raise ValueError(f"prompt of {len(r.prompt)} tokens does not fit the model's context of {self.max_seq}")
            r.ids = list(r.prompt)
            r.left = min(r.max_new_tokens or self.max_new_tokens, self.max_seq - len(r.prompt))
            self.running.append(r)
        if n and self.kv is not None:
            self.kv.add_rows(n)

    def finished(self, r):
        return r.left <= 0 or r.tokens[-1:] == [self.eot_id]

    def step(self):
        """Admit, one forward, commit, evict. Returns (stepped, finished, width): the requests
        the forward carried, those that left after it, and its window width (what it costs).
        With the block cache, requests join and leave only at a block's write."""
        self.admit()
        stepped = list(self.running)
        if not stepped:
            return [], [], 0
        wrote = self.cache == "block" and not self.filling
        width = self.block_step() if self.cache == "block" else self.slide_step()
        leave = [(wrote or self.cache != "block") and self.finished(r) for r in stepped]
        finished = [r for r, out in zip(stepped, leave) if out]
        self.evict([i for i, out in enumerate(leave) if not out])
        if wrote:
            self.filling = bool(self.running)
        return stepped, finished, width

    def forward(self):
        """decode_step over the running rows; counts the forward and logs it when tracing."""
        rows = self.running
        tokens, conf = decode_step(self.model, rows, self.kv, self.mask_id, **self.choose)
        self.forwards += 1
        for r in rows:
            r.steps += 1
            r.tau_sum += r.tau
        if self.trace is not None:
            for r, t, c in zip(rows, tokens.tolist(), conf.tolist()):
                n, start = 1 + len(r.drafts) + r.n_masks, r.cached if self.kv is not None else 0
                self.trace.append(dict(step=self.forwards - 1, row=r.index, cache_before=start, tokens=t[:n],
                                       conf=c[:n], fed=r.ids[start:] + r.drafts + [self.mask_id] * r.n_masks))
        return tokens, conf

    def choose_commits(self, tokens, conf):
        """Each row's commit: lossless verification, or mars.accept under its own tau, never past its own
        reads (a tau that rounds to 0 in float32 would otherwise take the padding)."""
        taus = torch.tensor([r.tau for r in self.running], dtype=torch.float32, device=conf.device)
        reads = torch.tensor([1 + len(r.drafts) + r.n_masks for r in self.running], device=conf.device)
        n = torch.minimum(mars.accept(conf, taus, self.max_accept), reads)
        rows = torch.cat([n[:, None], tokens], dim=1).tolist()
        commits = []
        for r, (k, *row) in zip(self.running, rows):
            commits.append(lossless_commit(row, r.drafts, self.B) if r.lossless else (row[:k], []))
        return commits

    def commit(self, r, new, past_eot=False):
        """Append new tokens to r, at most what its budget leaves, cut after <|endoftext|> unless
        past_eot (the block cache fills its block); its output stops at <|endoftext|>."""
        r.accepted += len(new)
        new = new[:r.left] if past_eot else through_eot(new[:r.left], self.eot_id)
        r.left -= len(new)
        r.ids += new
        shown = [] if r.tokens[-1:] == [self.eot_id] else through_eot(new, self.eot_id)
        if shown:
            r.tokens += shown
            r.chunks.append(shown)
        return new

    def settle(self, rows_committed):
        """Roll the cache back to what each row keeps; finish the trace entries of this forward."""
        if self.kv is not None:
            self.kv.rollback([r.cached for r in self.running])
        if self.trace is not None:
            for e, r, new in zip(self.trace[-len(self.running):], self.running, rows_committed):
                e.update(committed=new, cache_after=r.cached if self.kv is not None else 0)

    def slide_step(self):
        """Sliding cache (or none): feed [uncached real tokens | drafts | masks], commit what the rule
        accepts; the cache keeps the real tokens fed. A row at tau = 1.0 commits its AR token alone,
        so it is fed no masks and costs what AR costs."""
        for r in self.running:
            r.n_masks = self.B - 1 if r.tau < 1 or r.lossless else 0
        width = max(len(r.ids) - (r.cached if self.kv is not None else 0) + len(r.drafts) + r.n_masks
                    for r in self.running)
        committed = []
        for r, (new, drafts) in zip(self.running, self.choose_commits(*self.forward())):
            kept = self.commit(r, new)
            r.drafts = drafts if kept == new else []
            r.cached = len(r.ids) - (1 if r.lossless else len(kept))  # lossless fed its accepted drafts too
            committed.append(kept)
        self.settle(committed)
        return width

    def block_step(self):
        """The paper's block-level cache (the official MARSBlockCachedSampler). Per block of cache_block
        positions the cached prefix is frozen; each inner forward feeds the block (its committed tokens,
        then masks to its end) and commits left to right, never past the block's end; a full row waits.
        Then one forward writes the block into the cache (it counts, as does the prompt's first write)."""
        if not self.filling:  # write every committed token but the last, which opens the next windows
            for r in self.running:
                r.n_masks = 0
            width = max(len(r.ids) - r.cached for r in self.running)
            self.forward()
            for r in self.running:
                r.cached = len(r.ids) - 1
                r.end = len(r.ids) + min(self.cache_block, r.left)
            self.settle([[] for _ in self.running])
            return width
        for r in self.running:
            r.n_masks = max(r.end - len(r.ids) - 1, 0) if self.B > 1 else 0
        width = max(len(r.ids) - r.cached + r.n_masks for r in self.running)
        committed = []
        for r, (new, _) in zip(self.running, self.choose_commits(*self.forward())):
            committed.append(self.commit(r, new, past_eot=True) if len(r.ids) < r.end else [])
        self.settle(committed)
        self.filling = any(len(r.ids) < r.end for r in self.running)
        return width


def clock(model):
    """time.perf_counter() once the model's device has finished its queued work (CUDA runs asynchronously)."""
    if model.wte.weight.device.type == "cuda":
        torch.cuda.synchronize(model.wte.weight.device)
    return time.perf_counter()


def generate_batch(model, prompts, eot_id, mask_id, *, B=1, tau=1.0, cache="sliding", cache_block=16,
                   lossless=False, max_new_tokens=64, **options):
    """Decode a batch of prompts (lists of ids) together; returns one finished Request per prompt.
    tau: a number or one per prompt. options: metric, temperature, max_accept, n_vocab, trace
    (a list: one dict per forward and row)."""
    if lossless and (cache == "block" or options.get("temperature", 0) > 0):
        raise ValueError("lossless decoding is greedy, with cache none or sliding")
    if not prompts:
        return []
    taus = [float(t) for t in tau] if hasattr(tau, "__len__") else [float(tau)] * len(prompts)
    slots = kv_slots(prompts, model.config.max_seq_len, max_new_tokens, B, cache, cache_block)
    engine = Engine(model, eot_id, mask_id, B, len(prompts), max_new_tokens, cache=cache, cache_block=cache_block,
                    cache_len=slots, **options)
    requests = [Request(list(p), tau=t, lossless=lossless, index=i) for i, (p, t) in enumerate(zip(prompts, taus))]
    engine.waiting.extend(requests)
    t0 = clock(model)
    while engine.backlog:
        engine.step()
    seconds = clock(model) - t0
    for r in requests:
        r.batch_forwards, r.seconds = engine.forwards, seconds
    return requests
