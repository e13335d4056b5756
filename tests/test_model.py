"""model.py: the KV cache against uncached forwards, rollback, targets, positions, tying, grouped-query
attention."""
import pytest
import torch

import model
from conftest import V, random_model, tiny_config

ATOL = 1e-10


@pytest.fixture(scope="module")
def m():
    return random_model(seed=3)


def seqs(b, t, seed=0):
    return torch.randint(0, V, (b, t), generator=torch.Generator().manual_seed(seed))


def test_weight_tying(m):
    assert m.lm_head.weight is m.wte.weight
    fresh = model.GPT(tiny_config())
    assert fresh.lm_head.weight is fresh.wte.weight
    n_params = sum(p.numel() for p in fresh.parameters())
    assert n_params == sum(p.numel() for n, p in fresh.named_parameters() if not n.startswith("lm_head"))


def test_cache_prefill_then_one_token_at_a_time(m):
    x = seqs(2, 30)
    full = m(x)
    cache = m.new_cache(2)
    out = [m(x[:, :10], cache=cache)]
    for t in range(10, 30):
        out.append(m(x[:, t:t + 1], cache=cache))
        assert cache.lengths == [t + 1, t + 1]
    torch.testing.assert_close(torch.cat(out, 1), full, atol=ATOL, rtol=0)


def test_cache_prefill_then_chunks(m):
    x = seqs(3, 40, seed=1)
    full = m(x)
    cache = m.new_cache(3)
    out, t = [], 0
    for size in (7, 1, 5, 3, 12, 2, 10):
        out.append(m(x[:, t:t + size], cache=cache))
        t += size
    assert t == 40 and cache.lengths == [40] * 3
    torch.testing.assert_close(torch.cat(out, 1), full, atol=ATOL, rtol=0)


def test_cache_ragged_rows(m):
    """Rows rolled back to different lengths, then one chunk: each row continues from its own length."""
    x = seqs(3, 40, seed=2)
    full = m(x)
    cache = m.new_cache(3)
    m(x[:, :20], cache=cache)
    lengths = [8, 15, 20]
    cache.rollback(lengths)
    chunk = torch.stack([x[b, n:n + 6] for b, n in enumerate(lengths)])
    logits = m(chunk, cache=cache)
    assert cache.lengths == [n + 6 for n in lengths]
    for b, n in enumerate(lengths):
        torch.testing.assert_close(logits[b], full[b, n:n + 6], atol=ATOL, rtol=0)
    # a second ragged step (one token each), then equal lengths again
    nxt = torch.stack([x[b, n + 6:n + 7] for b, n in enumerate(lengths)])
    logits = m(nxt, cache=cache)
    for b, n in enumerate(lengths):
        torch.testing.assert_close(logits[b, 0], full[b, n + 6], atol=ATOL, rtol=0)


def test_cache_ragged_rows_explicit_positions(m):
    """Explicit positions with a ragged cache give the same as the default ones."""
    x = seqs(2, 30, seed=4)
    c1, c2 = m.new_cache(2), m.new_cache(2)
    m(x[:, :12], cache=c1)
    m(x[:, :12], cache=c2)
    c1.rollback([5, 12])
    c2.rollback([5, 12])
    chunk = torch.stack([x[0, 5:9], x[1, 12:16]])
    a = m(chunk, cache=c1)
    b = m(chunk, cache=c2, positions=torch.tensor([[5, 6, 7, 8], [12, 13, 14, 15]]))
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_rollback_forgets_tokens(m):
    x = seqs(2, 24, seed=5)
    junk = seqs(2, 6, seed=6)
    reference = m(x)
    cache = m.new_cache(2)
    m(x[:, :10], cache=cache)
    m(junk, cache=cache)  # appended, then rolled back
    cache.rollback([10, 10])
    logits = m(x[:, 10:], cache=cache)
    torch.testing.assert_close(logits, reference[:, 10:], atol=ATOL, rtol=0)
    # the junk really mattered before the rollback (so the test can fail)
    with_junk = m(torch.cat([x[:, :10], junk, x[:, 10:]], 1))[:, 16:]
    assert (with_junk - reference[:, 10:]).abs().max() > 1e-3


def test_cache_overflow_raises(m):
    cache = m.new_cache(1, max_len=8)
    m(seqs(1, 6), cache=cache)
    with pytest.raises(ValueError, match=r"KV cache overflow: 9 > 8 slots"):
        m(seqs(1, 3), cache=cache)


def test_context_overflow_raises(m):
    """Past the context, with or without a cache (one whose slots would still have room)."""
    with pytest.raises(ValueError, match=r"sequence longer than the model's context \(64\)"):
        m(seqs(1, 65))
    cache = m.new_cache(1, max_len=80)
    m(seqs(1, 60), cache=cache)
    with pytest.raises(ValueError, match=r"sequence longer than the model's context \(64\)"):
        m(seqs(1, 5), cache=cache)


def test_targets_give_the_cross_entropy_where_there_is_one(m, monkeypatch):
    """forward(idx, targets): the cross-entropy (b, t) in float32 of the full logits where a target is given,
    0 where it is -1, and lm_head computes logits at those positions only."""
    x = seqs(3, 20, seed=7)
    full = m(x)
    targets = seqs(3, 20, seed=8)
    targets[torch.rand(3, 20, generator=torch.Generator().manual_seed(0)) < 0.7] = -1
    where = targets != -1
    rows = []
    monkeypatch.setattr(m.lm_head, "forward", lambda h: rows.append(h.shape[0]) or h @ m.lm_head.weight.T)
    ce = m(x, targets)
    assert ce.dtype == torch.float32 and ce.shape == (3, 20) and rows == [int(where.sum())]
    want = torch.nn.functional.cross_entropy(full[where].float(), targets[where], reduction="none")
    torch.testing.assert_close(ce[where], want, atol=1e-6, rtol=0)
    assert (ce[~where] == 0).all()
    torch.testing.assert_close(m.lm_head(m.hidden(x)), full, atol=0, rtol=0)


def gqa_pair(seed=0):
    """A float64 GPT with grouped-query attention (4 query heads, 2 key/value heads), and the same model with
    every key/value head repeated for its query heads (plain multi-head attention): the same function."""
    torch.manual_seed(seed)
    config = dict(vocab_size=V, max_seq_len=64, n_layer=2, n_head=4, n_embd=32)
    gqa = model.GPT(model.GPTConfig(n_kv_head=2, **config)).double().eval()
    mha = model.GPT(model.GPTConfig(**config)).double().eval()
    state = gqa.state_dict()
    for name in [n for n in state if n.endswith(("attn.k.weight", "attn.v.weight"))]:
        state[name] = state[name].view(2, 8, 32).repeat_interleave(2, dim=0).reshape(32, 32)
    mha.load_state_dict(state)
    return gqa, mha


def test_grouped_query_attention_with_a_mask_is_the_repeated_heads_model():
    """k and v expanded to the query heads where a mask is given (the memory-efficient kernel's path): the
    outputs of the equivalent multi-head model, uncached and masked (both streams' mask), and cached (ragged
    rows, whose mask is explicit, and one token per row, which has none)."""
    gqa, mha = gqa_pair()
    x = seqs(2, 24, seed=4)
    torch.testing.assert_close(gqa(x), mha(x), atol=ATOL, rtol=0)
    mask = torch.rand(24, 24, generator=torch.Generator().manual_seed(1)) < 0.5
    mask |= torch.eye(24, dtype=torch.bool)
    for attn_mask in (mask, mask.expand(2, 24, 24)):
        torch.testing.assert_close(gqa(x, attn_mask=attn_mask), mha(x, attn_mask=attn_mask), atol=ATOL, rtol=0)
    caches = gqa.new_cache(2), mha.new_cache(2)
    out = []
    for m_, cache in zip((gqa, mha), caches):
        m_(x[:, :10], cache=cache)
        cache.rollback([6, 10])
        chunk = torch.stack([x[0, 6:11], x[1, 10:15]])
        ragged = m_(chunk, cache=cache)
        cache.rollback([11, 11])
        out.append((ragged, m_(x[:, 11:12], cache=cache)))
    for a, b in zip(*out):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def test_explicit_positions_equal_default(m):
    x = seqs(2, 16, seed=8)
    a = m(x)
    torch.testing.assert_close(m(x, positions=torch.arange(16)), a, atol=0, rtol=0)
    torch.testing.assert_close(m(x, positions=torch.arange(16).expand(2, 16)), a, atol=0, rtol=0)
    # rotary positions: only distances matter, so shifting every position changes nothing
    torch.testing.assert_close(m(x, positions=torch.arange(16) + 37), a, atol=ATOL, rtol=0)
    torch.testing.assert_close(m(x, positions=torch.arange(16) + torch.tensor([[5], [200]])), a, atol=ATOL, rtol=0)
    # ... but the distances are used: stretching them changes the logits
    stretched = m(x, positions=2 * torch.arange(16))
    assert (stretched - a).abs().max() > 1e-3


def test_explicit_causal_mask_equals_default(m):
    x = seqs(2, 16, seed=9)
    causal = torch.ones(16, 16, dtype=torch.bool).tril()
    torch.testing.assert_close(m(x, attn_mask=causal), m(x), atol=ATOL, rtol=0)
    torch.testing.assert_close(m(x, attn_mask=causal.expand(2, 16, 16)), m(x), atol=ATOL, rtol=0)
