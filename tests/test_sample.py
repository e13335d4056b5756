"""engine.generate_batch (and sample.generate, the loop a student reads): MARS decoding against AR greedy, the three caches, batches,
per-request thresholds, metrics, stopping, lossless decoding and the KV cache
contents; on random float64 models and on the trained tiny checkpoint."""
import pytest
import torch

import mars
import model as model_lib
from extras.engine import engine
import common
import sample
from conftest import EOT, MASK, V, random_model, random_prompts, tiny_config
from extras.bench.eval import official_tpf

PROMPTS = random_prompts((3, 7, 12, 5, 1))
N = 40  # max_new_tokens


@pytest.fixture(scope="module", params=[2, 8], ids=lambda s: f"model{s}")
def m(request):
    return random_model(seed=request.param)


@pytest.fixture(scope="module")
def ar_out(m):
    """AR greedy (B = 1) for each prompt alone, without a cache: the reference."""
    return [engine.generate_batch(m, [p], EOT, MASK, B=1, cache="none", max_new_tokens=N)[0].tokens for p in PROMPTS]


def gen(m, prompts=PROMPTS, **kw):
    kw.setdefault("max_new_tokens", N)
    return engine.generate_batch(m, prompts, EOT, MASK, **kw)


def toks(gens):
    return [g.tokens for g in gens]


def check_accounting(gens, max_new_tokens=N):
    for g in gens:
        assert sum(len(c) for c in g.chunks) == len(g.tokens)
        assert [t for c in g.chunks for t in c] == g.tokens
        assert all(g.chunks)
        assert 0 < len(g.tokens) <= max_new_tokens
        assert EOT not in g.tokens[:-1]
        assert g.seconds > 0


def test_test_models_are_meaningful(m, ar_out):
    """AR output is varied, and tau < 1 really commits several tokens per forward (sometimes)."""
    assert all(len(set(t)) >= 3 for t in ar_out)
    sizes = [len(c) for g in gen(m, B=4, tau=0.5) for c in g.chunks]
    assert max(sizes) > 1 and min(sizes) == 1
    assert sum(sizes) / len(sizes) > 1.2
    assert toks(gen(m, B=4, tau=0.5)) != ar_out  # so equality tests below are not trivial


@pytest.mark.parametrize("B", [2, 4, 8])
@pytest.mark.parametrize("cache", ["sliding", "none", "block"])
def test_tau_one_equals_ar_greedy(m, ar_out, B, cache):
    gens = gen(m, B=B, tau=1.0, cache=cache, B_cache=5)
    assert toks(gens) == ar_out
    assert all(len(g.chunks) == len(g.tokens) for g in gens)
    check_accounting(gens)
    assert [gen(m, [p], B=B, tau=1.0, cache=cache)[0].tokens for p in PROMPTS[:2]] == ar_out[:2]


def test_ar_batched_and_cached_equals_reference(m, ar_out):
    for cache in ("sliding", "block", "none"):
        assert toks(gen(m, B=1, cache=cache, B_cache=4)) == ar_out


@pytest.mark.parametrize("B", [2, 4, 8])
def test_caches_agree_and_batch_equals_alone(m, B):
    """none and sliding commit the same tokens, batched or alone: the sliding cache
    changes what is computed, never what is committed. (The paper's block cache
    commits differently at tau < 1: see test_block_cache_is_the_official_algorithm.)"""
    ref = toks(gen(m, B=B, tau=0.5, cache="none"))
    assert any(len(c) > 1 for g in gen(m, B=B, tau=0.5) for c in g.chunks)  # multi-token steps happen
    for cache in ("none", "sliding"):
        batched = gen(m, B=B, tau=0.5, cache=cache)
        check_accounting(batched)
        assert toks(batched) == ref, cache
        assert [gen(m, [p], B=B, tau=0.5, cache=cache)[0].tokens for p in PROMPTS] == ref, cache


def window_predictions(m, prefix, B):
    """Uncached reference: the B predictions of the window [prefix | B-1 masks]."""
    ids = torch.tensor([prefix + [MASK] * (B - 1)])
    logits = m(ids)[0, len(prefix) - 1:]
    tokens, conf = mars.choose(logits)
    return tokens.tolist(), mars.accept(conf[None], 0.5).item()


def test_sliding_chunks_match_uncached_windows(m):
    for p, g in zip(PROMPTS, gen(m, B=4, tau=0.5)):
        prefix = list(p)
        for chunk in g.chunks:
            tokens, n = window_predictions(m, prefix, 4)
            assert chunk == tokens[:len(chunk)]
            assert len(chunk) == n or EOT in chunk or len(prefix) + len(chunk) - len(p) == N
            prefix += chunk


# ---------------------------------------------------------------------------
# The paper's block cache, against an uncached re-implementation of the official
# algorithm (MARSBlockCachedSampler), written here independently of sample.py

def official_block_cache(m, prompt, tau, B_cache, max_new_tokens, eot=EOT, mask=MASK):
    """Per block of B_cache positions: until it is full, feed [everything so far |
    masks to the block's end] and commit the first prediction, then the next ones while
    their probability >= tau; never past the block's end, and past <|endoftext|> too (the
    output stops there). Returns (chunks as the output shows them, inner forwards per block)."""
    ids, chunks, inner = list(prompt), [], []
    max_new_tokens = min(max_new_tokens, m.config.max_seq_len - len(prompt))  # and the context
    while True:
        end = len(ids) + min(B_cache, len(prompt) + max_new_tokens - len(ids))
        inner.append(0)
        while len(ids) < end:
            x = torch.tensor([ids + [mask] * (end - len(ids) - 1)])
            logits = m(x)[0, len(ids) - 1:].float()
            logits[:, mask] = float("-inf")  # the sampler never emits the placeholder
            conf, tokens = logits.softmax(-1).max(-1)
            n = 1
            while n < len(tokens) and conf[n] >= tau:
                n += 1
            shown = sum(chunks, [])
            if eot not in shown:
                new = tokens[:n].tolist()
                chunks.append(new[:new.index(eot) + 1] if eot in new else new)
            ids += tokens[:n].tolist()
            inner[-1] += 1
        if eot in ids[len(prompt):] or len(ids) - len(prompt) == max_new_tokens:
            return chunks, inner


def official_forwards(inner):
    """The official count for each row of a batch: the prompt's forward, then per block the
    inner forwards of its slowest row plus the one that writes the block into the cache."""
    total, out = 1, [0] * len(inner)
    for k in range(max(map(len, inner))):
        total += 1 + max(c[k] for c in inner if len(c) > k)
        out = [total if len(c) == k + 1 else o for c, o in zip(inner, out)]
    return out


def check_block_cache(model, prompts, tau, B_cache, eot, mask, max_new_tokens=N):
    ref = [official_block_cache(model, p, tau, B_cache, max_new_tokens, eot, mask) for p in prompts]
    for batch_size in (1, 4, 16):
        for i in range(0, len(prompts), batch_size):
            batch = prompts[i:i + batch_size]
            gens = engine.generate_batch(model, batch, eot, mask, B=4, tau=tau, cache="block", B_cache=B_cache,
                                   max_new_tokens=max_new_tokens)
            assert [g.chunks for g in gens] == [c for c, _ in ref[i:i + batch_size]], (batch_size, i)
            assert [g.forwards for g in gens] == official_forwards([n for _, n in ref[i:i + batch_size]])
    return [c for c, _ in ref]


@pytest.mark.parametrize("B_cache", [3, 8, N + 8])
def test_block_cache_is_the_official_algorithm(m, B_cache):
    prompts = random_prompts([1 + (5 * i) % 13 for i in range(16)], seed=4)
    chunks = check_block_cache(m, prompts, 0.5, B_cache, EOT, MASK)
    assert any(len(c) > 1 for cs in chunks for c in cs)  # multi-token steps happen
    sliding = [g.chunks for g in gen(m, prompts, B=4, tau=0.5)]
    assert sliding != chunks  # the paper's block cache is a different decoder at tau < 1


def test_decode_step_ragged_rows_join_and_leave(m):
    """decode_step against an uncached forward of each row alone, as rows of different
    lengths, drafts and masks share a cache, join it (add_rows) and leave it (keep_rows)."""
    def check(rows, kv):
        tokens, conf = engine.decode_step(m, rows, kv, MASK)
        assert tokens.shape == conf.shape == (len(rows), max(1 + len(r.drafts) + r.n_masks for r in rows))
        for r, t, c in zip(rows, tokens, conf):
            n = 1 + len(r.drafts) + r.n_masks
            logits = m(torch.tensor([r.ids + r.drafts + [MASK] * r.n_masks]))[0, len(r.ids) - 1:]
            logits[:, MASK] = float("-inf")  # the sampler never emits the placeholder
            ref_t, ref_c = mars.choose(logits)
            assert t[:n].tolist() == ref_t.tolist()
            torch.testing.assert_close(c[:n], ref_c)
            assert not c[n:].any()  # nothing beyond the row's own reads
        kv.rollback([r.cached for r in rows])

    kv = engine.JoinKVCache(m.config, 2, 64, torch.float64, "cpu")  # the engine's: rows join
    rows = [engine.Request([], ids=list(PROMPTS[1]), n_masks=3), engine.Request([], ids=list(PROMPTS[2]))]
    check(rows, kv)
    rows[0].cached, rows[1].cached = 5, len(PROMPTS[2])
    rows[1].ids += [4, 9]
    rows[1].drafts, rows[1].n_masks = [11, 3], 2
    kv.add_rows(1)
    rows.append(engine.Request([], ids=list(PROMPTS[0]), n_masks=1))
    check(rows, kv)
    kv.keep_rows([1, 2])
    rows = rows[1:]
    rows[1].cached = len(rows[1].ids)
    rows[1].ids += [7]
    check(rows, kv)


@pytest.mark.parametrize("kw", [dict(cache="sliding"), dict(cache="none"), dict(cache="block", B_cache=6)])
def test_trace(m, kw):
    """The trace holds, per forward and row, the window fed, the predictions read, what was
    committed and the cache length around it, consistently with the Generations."""
    trace = []
    gens = gen(m, PROMPTS[:3], B=4, tau=0.5, trace=trace, **kw)
    assert [e["step"] for e in trace] == sorted(e["step"] for e in trace)
    for i, (p, g) in enumerate(zip(PROMPTS, gens)):
        rows = [e for e in trace if e["row"] == i]
        assert len(rows) == g.forwards
        committed = sum((e["committed"] for e in rows), [])
        assert committed[:len(g.tokens)] == g.tokens
        ids = list(p)
        for e in rows:
            real = [t for t in e["fed"] if t != MASK]
            assert e["fed"] == ids[e["cache_before"]:] + [MASK] * (len(e["fed"]) - len(real))
            assert len(e["tokens"]) == len(e["conf"]) == len(e["fed"]) - len(real) + 1
            assert e["committed"] == e["tokens"][:len(e["committed"])]
            if kw["cache"] == "none":
                assert e["cache_before"] == e["cache_after"] == 0
            elif kw["cache"] == "sliding":  # keep the real tokens fed, drop the masks
                assert e["cache_after"] == e["cache_before"] + len(real)
            ids += e["committed"]


def test_per_request_tau(m, ar_out):
    taus = [1.0, 0.3, 0.6, 0.9, 0.45]
    for cache in ("sliding", "block"):
        batched = gen(m, B=4, tau=taus, cache=cache, B_cache=6)
        alone = [gen(m, [p], B=4, tau=t, cache=cache, B_cache=6)[0] for p, t in zip(PROMPTS, taus)]
        assert toks(batched) == toks(alone)
        assert batched[0].tokens == ar_out[0]
        assert len(batched[0].chunks) == len(batched[0].tokens)
        assert len(batched[1].chunks) < len(batched[1].tokens)
    assert toks(gen(m, B=4, tau=torch.tensor(taus))) == toks(gen(m, B=4, tau=taus))


@pytest.mark.parametrize("metric", engine.METRICS)
def test_metrics(m, ar_out, metric):
    assert toks(gen(m, B=4, tau=1.0, metric=metric)) == ar_out
    gens = gen(m, B=4, tau=0.5, metric=metric)
    check_accounting(gens)
    assert all(g.tokens[0] == a[0] for g, a in zip(gens, ar_out))  # the first token is always AR's


def test_max_accept(m, ar_out):
    assert toks(gen(m, B=4, tau=0.3, max_accept=1)) == ar_out
    gens = gen(m, B=8, tau=0.3, max_accept=2)
    assert max(len(c) for g in gens for c in g.chunks) == 2
    check_accounting(gens)


@pytest.mark.parametrize("kw", [dict(B=1), dict(B=4, tau=0.5), dict(B=4, lossless=True),
                                dict(B=8, tau=0.3, cache="block", B_cache=3)], ids=["ar", "mars", "lossless", "block"])
def test_stops_at_eot(m, kw):
    """Pretend a token the model emits is <|endoftext|>: generation ends right after its first occurrence."""
    for p in PROMPTS[1:4]:
        full = gen(m, [p], **kw)[0].tokens
        i = next(i for i in range(2, len(full) - 1) if full.index(full[i]) == i)
        g = engine.generate_batch(m, [p], full[i], MASK, max_new_tokens=N, **kw)[0]
        assert g.tokens == full[:i + 1]
        assert g.chunks[-1][-1] == full[i]


@pytest.mark.parametrize("n", [1, 2, 7])
def test_max_new_tokens(m, ar_out, n):
    for kw in (dict(B=1), dict(B=4, lossless=True), dict(B=4, tau=0.3), dict(B=8, tau=0.3, cache="block", B_cache=3)):
        gens = gen(m, max_new_tokens=n, **kw)
        check_accounting(gens, n)
        for g, a in zip(gens, ar_out):
            assert len(g.tokens) == n or g.tokens[-1] == EOT, kw
            if kw.get("B") == 1 or kw.get("lossless"):
                assert g.tokens == a[:n]


def test_context_limit(m):
    long = random_prompts((60,), seed=3)[0]
    ar = gen(m, [long], B=1, max_new_tokens=N)[0].tokens
    for kw in (dict(B=1), dict(B=8, tau=0.3), dict(B=4, lossless=True), dict(B=8, tau=0.3, cache="none")):
        g = gen(m, [long], max_new_tokens=N, **kw)[0]
        assert len(long) + len(g.tokens) == 64 or g.tokens[-1] == EOT  # stops at the model's context
        assert len(long) + len(g.tokens) <= 64
    assert gen(m, [long], B=4, lossless=True, max_new_tokens=N)[0].tokens == ar
    with pytest.raises(ValueError, match="a 64-token prompt fills the 64-token context"):
        gen(m, [random_prompts((64,))[0]])


class CacheHighWater:
    """Wraps model.KVCache.append: records each cached forward's need (longest cached row + window width)."""

    def __init__(self, monkeypatch):
        self.needs, plan = [], model_lib.KVCache.append

        def spy(kv, positions):
            self.needs.append((max(kv.lengths) + positions.shape[-1], kv.max_len))
            return plan(kv, positions)
        monkeypatch.setattr(model_lib.KVCache, "append", spy)


def test_ragged_batches_near_the_context_limit_fit_the_kv_cache(m, monkeypatch):
    """A block-cache window is up to B_cache + 1 wide and is padded across rows, so a row near the context
    limit next to a short row at a block start needs its cached prefix plus the widest window: a 58- and a
    4-token prompt at B_cache 16 overflowed a cache of max_seq_len + 2B (73 > 72 slots)."""
    spy = CacheHighWater(monkeypatch)
    long, short = random_prompts((58, 4), seed=3)
    alone = [gen(m, [p], B=4, tau=0.3, cache="block", B_cache=16)[0].tokens for p in (long, short)]
    assert toks(gen(m, [long, short], B=4, tau=0.3, cache="block", B_cache=16)) == alone
    assert max(need for need, _ in spy.needs) > 64 + 2 * 4  # the old sizing could not hold it
    # every decoder, ragged batches of long and short prompts, up to the context
    prompts = random_prompts((60, 3, 41, 1, 57, 63, 9), seed=6)
    for kw in (dict(B=1), dict(B=8, tau=0.3), dict(B=4, lossless=True),
               dict(B=4, tau=0.3, cache="block", B_cache=4), dict(B=8, tau=0.3, cache="block", B_cache=16),
               dict(B=1, cache="block", B_cache=32)):
        for n in (2, N):
            gens = gen(m, prompts, max_new_tokens=n, **kw)
            assert all(len(p) + len(g.tokens) <= 64 for p, g in zip(prompts, gens))
    assert all(need <= slots for need, slots in spy.needs)
    # sized from the prompts, not from the context alone: short prompts get a short cache
    spy.needs.clear()
    gen(m, [[1] * 5], B=4, tau=0.3, max_new_tokens=8)
    assert {slots for _, slots in spy.needs} == {5 + 8 - 1 + 7}
    # an engine without a cache length (the server's) holds a full context and a joining prompt's padded window
    assert engine.Engine(m, EOT, MASK, 4, 2, cache="block", B_cache=16).kv.max_len == 2 * 64 - 1 + 17


def test_official_tokens_per_forward_counter(m):
    """The official samplers' counter: per batch, the tokens every row accepted (those past <|endoftext|> in
    the same forward included) over the batch's forwards, each counted once."""
    trace = []
    gens = gen(m, B=4, tau=0.5, trace=trace)
    forwards = len({e["step"] for e in trace})  # the batch's forwards, each counted once
    assert len({g.forwards for g in gens}) > 1  # rows leave at different forwards; the batch runs on
    for i, g in enumerate(gens):  # accepted = what mars.accept took at each of the row's forwards
        confs = [e["conf"] for e in trace if e["row"] == i]
        n = [mars.accept(torch.tensor([c]), 0.5).item() for c in confs]
        assert g.accepted == sum(n) >= len(g.tokens)
    assert official_tpf([gens]) == sum(g.accepted for g in gens) / forwards
    block_trace = []
    block = gen(m, B=4, tau=0.5, cache="block", B_cache=6, trace=block_trace)
    assert official_tpf([block]) == sum(g.accepted for g in block) / len({e["step"] for e in block_trace})
    alone = [gen(m, [p], B=4, tau=0.5) for p in PROMPTS]
    assert official_tpf(alone) == sum(g[0].accepted for g in alone) / sum(g[0].forwards for g in alone)
    # past <|endoftext|>: pretend a token inside a multi-token chunk is the end; the rest of that chunk counts
    full = gen(m, [PROMPTS[1]], B=4, tau=0.3)[0]
    ends = [sum(map(len, full.chunks[:k + 1])) for k in range(len(full.chunks))]  # chunk k ends before ends[k]
    i = next(i for i in range(len(full.tokens)) if full.tokens.index(full.tokens[i]) == i and i + 1 not in ends)
    cut = engine.generate_batch(m, [PROMPTS[1]], full.tokens[i], MASK, B=4, tau=0.3, max_new_tokens=N)[0]
    assert cut.tokens == full.tokens[:i + 1]
    assert cut.accepted == next(e for e in ends if e > i) > len(cut.tokens)


def test_bad_arguments(m):
    with pytest.raises(ValueError, match="cache: one of"):
        gen(m, cache="nope")
    with pytest.raises(ValueError, match="lossless decoding is greedy, with cache none or sliding"):
        gen(m, B=4, lossless=True, cache="block")


def test_temperature_sampling_is_seeded(m):
    torch.manual_seed(0)
    a = toks(gen(m, B=4, tau=0.5, temperature=1.0))
    torch.manual_seed(0)
    b = toks(gen(m, B=4, tau=0.5, temperature=1.0))
    assert a == b
    check_accounting(gen(m, B=4, tau=0.5, temperature=1.0))


@pytest.mark.parametrize("metric", engine.METRICS)
def test_choose_metrics(metric):
    """engine.choose: mars.choose's argmax, with each metric's confidence on the scale of prob."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, V, generator=g) * 4
    logits[0, 0] = -1e4
    logits[0, 0, 3] = 1e4  # a certain prediction
    logits[1, 0] = 0.0  # a uniform one
    tokens, conf = engine.choose(logits, metric=metric)
    assert tokens.shape == conf.shape == (3, 5)
    assert torch.equal(tokens, logits.argmax(-1))
    assert ((conf >= 0) & (conf <= 1 + 1e-6)).all()
    assert conf[0, 0] > 0.999
    expected_uniform = 1 / V if metric == "prob" else 0.0
    assert abs(conf[1, 0].item() - expected_uniform) < 1e-5
    p = logits.float().softmax(-1)
    if metric == "prob":
        torch.testing.assert_close(conf, p.max(-1).values)
    elif metric == "margin":
        top2 = p.topk(2, -1).values
        torch.testing.assert_close(conf, top2[..., 0] - top2[..., 1])
    else:
        h = -(p * p.clamp_min(1e-30).log()).sum(-1)
        torch.testing.assert_close(conf, 1 - h / torch.log(torch.tensor(float(V))))


def test_choose_sampling_is_seeded_and_follows_the_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]]).expand(20000, 4)
    tokens, conf = engine.choose(logits, temperature=1.0, generator=torch.Generator().manual_seed(0))
    again, _ = engine.choose(logits, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert torch.equal(tokens, again)
    freq = torch.bincount(tokens, minlength=4).float() / 20000
    torch.testing.assert_close(freq, logits[0].softmax(-1), atol=0.02, rtol=0)
    torch.testing.assert_close(conf, logits[0].softmax(-1)[tokens])
    # the temperature changes which token is drawn, never the softmax the confidence is read from
    hot, hot_conf = engine.choose(logits, temperature=3.0, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(hot_conf, logits[0].softmax(-1)[hot])
    assert not torch.equal(hot, tokens)


def test_choose_unknown_metric_raises():
    with pytest.raises(ValueError, match="metric"):
        engine.choose(torch.randn(2, 3, 5), metric="nope")


# ---------------------------------------------------------------------------
# Lossless (self-speculative) decoding

@pytest.mark.parametrize("B", [2, 4, 8])
def test_lossless_equals_ar(m, ar_out, B):
    batched = gen(m, B=B, lossless=True)
    assert toks(batched) == ar_out
    check_accounting(batched)
    assert [gen(m, [p], B=B, lossless=True)[0].tokens for p in PROMPTS] == ar_out
    assert toks(gen(m, B=B, lossless=True, cache="none")) == ar_out
    assert sum(len(g.chunks) for g in batched) < sum(len(t) for t in ar_out)  # it did take several at once


class CacheSpy:
    """Wraps model.hidden (every forward runs it): before every cached call, checks that each row's
    first kv.lengths[b] cache entries are the keys and values of a fresh uncached
    forward over that row's final tokens (i.e. the cache holds committed tokens only)."""

    def __init__(self, model):
        self.model, self.hidden, self.snapshots = model, model.hidden, []
        model.hidden = self

    def __call__(self, idx, *args, cache=None, **kw):
        if cache is not None:
            self.snapshots.append((cache.k.clone(), cache.v.clone(), list(cache.lengths)))
        return self.hidden(idx, *args, cache=cache, **kw)

    def verify(self, final_ids):
        assert len(self.snapshots) > 2
        lengths = [snap[2][0] for snap in self.snapshots]
        assert lengths == sorted(lengths) and lengths[-1] > lengths[1] > 0
        assert lengths[-1] < len(final_ids)  # the last committed tokens were never cached
        for k, v, (L,) in self.snapshots:
            if L == 0:
                continue
            fresh = self.model.new_cache(1)
            self.model(torch.tensor(final_ids[:L])[None], cache=fresh)
            torch.testing.assert_close(k[:, 0, :, :L], fresh.k[:, 0, :, :L], atol=1e-10, rtol=0)
            torch.testing.assert_close(v[:, 0, :, :L], fresh.v[:, 0, :, :L], atol=1e-10, rtol=0)


@pytest.mark.parametrize("kw", [dict(B=4, lossless=True), dict(B=8, lossless=True), dict(B=4, tau=0.5),
                                dict(B=4, tau=0.5, cache="block", B_cache=5)],
                         ids=["lossless4", "lossless8", "sliding", "block"])
def test_kv_cache_holds_exactly_the_committed_tokens(m, kw):
    for p in PROMPTS[1:3]:
        spy = CacheSpy(m)
        try:
            g = gen(m, [p], **kw)[0]
        finally:
            del m.hidden  # back to the class's hidden
        spy.verify(p + g.tokens)


# ---------------------------------------------------------------------------
# The trained tiny checkpoint

@pytest.fixture(scope="module")
def trained(tiny_run):
    ckpt = common.load_checkpoint(str(tiny_run / "mars.pt"))
    model, tok = common.model_from_checkpoint(ckpt)
    return model.double().eval(), tok, ckpt


def test_trained_checkpoint_lossless_and_tau_one_equal_ar(trained, splits):
    model, tok, ckpt = trained
    prompts = [tok.prompt_ids(e["prompt"]) for e in splits["test"][:12]]
    ar = toks(engine.generate_batch(model, prompts, tok.eot, tok.mask, B=1))
    assert all(t for t in ar)
    for B in (2, 4, 8):
        assert toks(engine.generate_batch(model, prompts, tok.eot, tok.mask, B=B, lossless=True)) == ar, B
        assert toks(engine.generate_batch(model, prompts[:3], tok.eot, tok.mask, B=B, lossless=True, cache="none")) == ar[:3]
    B = ckpt["mars"]["B"]
    assert toks(engine.generate_batch(model, prompts, tok.eot, tok.mask, B=B, tau=1.0)) == ar
    assert [engine.generate_batch(model, [p], tok.eot, tok.mask, B=B, lossless=True)[0].tokens for p in prompts[:4]] == ar[:4]


def test_trained_checkpoint_block_cache_is_the_official_algorithm(trained, splits):
    model, tok, _ = trained
    prompts = [tok.prompt_ids(e["prompt"]) for e in splits["test"][:16]]
    for B_cache in (4, 16):
        chunks = check_block_cache(model, prompts, 0.3, B_cache, tok.eot, tok.mask)
        assert any(len(c) > 1 for cs in chunks for c in cs)


def test_trained_checkpoint_lossless_equals_ar_in_float32(tiny_run, splits):
    """As extras.bench.eval and python -m extras.engine run it (float32, batched): lossless decoding
    reproduces --ar (B = 1, one prompt at a time) token for token, while committing several tokens per
    forward."""
    model, tok = common.model_from_checkpoint(common.load_checkpoint(str(tiny_run / "mars.pt")))
    model.eval()
    assert model.wte.weight.dtype == torch.float32
    prompts = [tok.prompt_ids(e["prompt"]) for e in splits["test"][:32]]
    ar = [engine.generate_batch(model, [p], tok.eot, tok.mask, B=1)[0].tokens for p in prompts]
    for B in (4, 8):
        gens = engine.generate_batch(model, prompts, tok.eot, tok.mask, B=B, lossless=True)
        assert toks(gens) == ar, B
        assert sum(len(g.tokens) for g in gens) > sum(g.forwards for g in gens)  # some drafts were accepted


# ---------------------------------------------------------------------------
# The loop a student reads (sample.generate) is the loop the engine runs

@pytest.mark.parametrize("tau", [1.0, 0.9, 0.7, 0.5, 0.3])
def test_readable_loop_equals_engine(m, tau):
    for p in PROMPTS:
        (out, chunks), = sample.generate(m, [p], EOT, MASK, B=4, tau=tau, max_new_tokens=N)
        g = engine.generate_batch(m, [p], EOT, MASK, B=4, tau=tau, max_new_tokens=N)[0]
        assert (out, chunks) == (g.tokens, g.chunks)  # the same tokens, committed in the same forwards
        assert len(chunks) == g.forwards


def test_padding_rows_are_never_output(m):
    """A real checkpoint's embedding can have rows past the tokenizer's ids (n_vocab). Here 8 such rows score
    3x a real token's logit, so they would win often: generate and the engine both ban them, and still agree."""
    padded = model_lib.GPT(tiny_config(V + 8)).double().eval()
    rows = torch.cat([m.wte.weight, 3 * m.wte.weight[:8]])
    padded.load_state_dict({**m.state_dict(), "wte.weight": rows, "lm_head.weight": rows})
    assert any(t >= V for p in PROMPTS for t in sample.generate(padded, [p], EOT, MASK, B=4, tau=0.5)[0][0])
    for tau in (1.0, 0.5):
        for p in PROMPTS:
            (out, chunks), = sample.generate(padded, [p], EOT, MASK, B=4, tau=tau, max_new_tokens=N, n_vocab=V)
            g = engine.generate_batch(padded, [p], EOT, MASK, B=4, tau=tau, max_new_tokens=N, n_vocab=V)[0]
            assert (out, chunks) == (g.tokens, g.chunks) and max(out) < V


def test_readable_loop_stops_at_the_context(m):
    """sample.generate's budget is the context's room as well as max_new_tokens: each row commits
    min(max_new_tokens, max_seq_len - prompt) tokens unless it ends with <|endoftext|> first, as the engine does
    alone; a row with one slot of room commits one token, and a prompt that fills the context commits none."""
    prompts = random_prompts((60, 63, 64, 5, 30), seed=3)
    context = m.config.max_seq_len
    for B, tau in ((1, 1.0), (4, 0.3), (8, 0.3)):
        out = sample.generate(m, prompts, EOT, MASK, B, tau, max_new_tokens=N)
        assert out[2] == ([], [])  # the 64-token prompt
        assert len(out[1][0]) == 1  # the 63-token prompt
        for p, (tokens, chunks) in zip(prompts, out):
            assert len(tokens) == min(N, context - len(p)) or tokens[-1] == EOT
            if len(p) < context:
                g = engine.generate_batch(m, [p], EOT, MASK, B=B, tau=tau, max_new_tokens=N)[0]
                assert (tokens, chunks) == (g.tokens, g.chunks)
        # the context, not max_new_tokens or <|endoftext|>, ends the 30-token prompt's answer
        assert len(prompts[4]) + len(out[4][0]) == context and out[4][0][-1] != EOT


@pytest.mark.parametrize("tau", [1.0, 0.5])
@pytest.mark.parametrize("n_vocab", [None, V - 4])
def test_predictions_are_the_windows_logits_with_banned_ids_at_minus_infinity(m, tau, n_vocab):
    """sample.predictions on ragged rows, over two forwards with the cache: row r's logits at its last real
    token and after it at its masks (B - 1, none at tau = 1.0), those of an uncached forward of all its tokens
    and the masks; <|mask|> and the ids from n_vocab on at -inf, the rest untouched; the cache keeps the real
    tokens only."""
    B = 4
    n_masks = B - 1 if tau < 1 else 0
    banned = [MASK] if n_vocab is None else list(range(n_vocab, V))
    kept = [i for i in range(V) if i not in banned]
    cache = m.new_cache(len(PROMPTS), mars.cache_slots(64, B))
    fresh, seen = [list(p) for p in PROMPTS], [list(p) for p in PROMPTS]
    for _ in range(2):
        logits = sample.predictions(m, cache, fresh, MASK, B, tau, n_vocab)
        assert logits.shape == (len(PROMPTS), 1 + n_masks, V)
        assert cache.lengths == [len(s) for s in seen]
        for row, s in zip(logits, seen):
            want = m(torch.tensor([s + [MASK] * n_masks]))[0, len(s) - 1:]
            assert (row[:, banned] == float("-inf")).all()
            torch.testing.assert_close(row[:, kept], want[:, kept])
        fresh = [[(7 * i + j) % EOT for j in range(1 + i % 3)] for i in range(len(PROMPTS))]  # 1-3 tokens a row
        seen = [s + f for s, f in zip(seen, fresh)]


def test_trained_checkpoint_readable_loop_equals_engine(tiny_run, splits):
    """In float32, as sample.py runs: token for token and forward for forward, at several taus."""
    model, tok = common.model_from_checkpoint(common.load_checkpoint(str(tiny_run / "mars.pt")))
    model.eval()
    B = 4
    multi = 0
    for tau in (1.0, 0.95, 0.9, 0.7, 0.4):
        for e in splits["test"][:24]:
            p = tok.prompt_ids(e["prompt"])
            (out, chunks), = sample.generate(model, [p], tok.eot, tok.mask, B, tau, n_vocab=tok.n_vocab)
            g = engine.generate_batch(model, [p], tok.eot, tok.mask, B=B, tau=tau, n_vocab=tok.n_vocab)[0]
            assert (out, chunks, len(chunks)) == (g.tokens, g.chunks, g.forwards), (tau, e["prompt"])
            multi += any(len(c) > 1 for c in chunks)
    assert multi > 0  # several tokens per forward did happen


def test_trained_checkpoint_rows_equal_batch_one(trained, splits):
    """Each row of a batch commits what it commits alone, with either cache."""
    model, tok, ckpt = trained
    prompts = [tok.prompt_ids(e["prompt"]) for e in splits["test"][:10]]
    for kw in (dict(cache="sliding"), dict(cache="block", B_cache=8)):
        batched = engine.generate_batch(model, prompts, tok.eot, tok.mask, B=4, tau=0.6, **kw)
        alone = [engine.generate_batch(model, [p], tok.eot, tok.mask, B=4, tau=0.6, **kw)[0] for p in prompts]
        assert [g.chunks for g in batched] == [g.chunks for g in alone], kw


def test_tau_that_underflows_never_reads_another_rows_window(m):
    """A tau that rounds to 0 in float32 accepts every prediction of its own window, never the padding
    that a wider row (a lossless one, with drafts) puts after it in the same forward."""
    tiny = 1e-300
    alone = [engine.generate_batch(m, [p], EOT, MASK, B=4, tau=tiny, max_new_tokens=N)[0].tokens for p in PROMPTS]
    eng = engine.Engine(m, EOT, MASK, 4, len(PROMPTS) * 2, N)
    mixed = [engine.Request(list(p), tau=tiny) for p in PROMPTS]
    eng.waiting.extend([r for p, t in zip(PROMPTS, mixed) for r in (t, engine.Request(list(p), lossless=True))])
    while eng.backlog:
        eng.step()
    assert [r.tokens for r in mixed] == alone
    assert MASK not in sum(alone, [])


def test_block_cache_rows_join_at_block_writes(m):
    """With the block cache, a request that arrives mid-block waits for the next write, then
    commits exactly what it commits alone."""
    eng = engine.Engine(m, EOT, MASK, 4, 3, N, cache="block", B_cache=6)
    requests = [engine.Request(list(p), tau=0.5) for p in PROMPTS]
    joins = [0, 0, 2, 5, 9]
    step = 0
    while any(not r.tokens or r in eng.running or r in eng.waiting for r in requests):
        eng.waiting.extend(r for r, j in zip(requests, joins) if j == step)
        eng.step()
        step += 1
    for r, p in zip(requests, PROMPTS):
        alone = engine.generate_batch(m, [p], EOT, MASK, B=4, tau=0.5, cache="block", B_cache=6, max_new_tokens=N)
        assert r.tokens == alone[0].tokens


def test_generate_defaults_and_prompts_with_no_room(m):
    """tau 0.9 and 64 new tokens are generate's defaults (a model with room for more than 64); a batch whose
    prompts all fill the context answers nothing, at once."""
    torch.manual_seed(0)
    roomy = model_lib.GPT(model_lib.GPTConfig(vocab_size=V, max_seq_len=160, n_layer=1, n_head=2,
                                              n_embd=32)).double().eval()
    prompts = random_prompts([5, 9])
    for net in (m, roomy):
        assert sample.generate(net, prompts, EOT, MASK, 4) == \
            sample.generate(net, prompts, EOT, MASK, 4, tau=0.9, max_new_tokens=64)
    assert sample.generate(m, prompts, EOT, MASK, 4) != sample.generate(m, prompts, EOT, MASK, 4, tau=1.0)
    assert max(len(out) for out, _ in sample.generate(roomy, prompts, EOT, MASK, 4)) == 64  # no end token came
    full = random_prompts([m.config.max_seq_len] * 2)
    assert sample.generate(m, full, EOT, MASK, 4) == [([], []), ([], [])]
