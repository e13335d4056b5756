"""model.py: the KV cache against uncached forwards, rollback, logits_at, positions, tying."""
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
    with pytest.raises(ValueError):
        m(seqs(1, 3), cache=cache)


def test_context_overflow_raises(m):
    """Past the context, with or without a cache (one whose slots would still have room)."""
    with pytest.raises(ValueError, match=r"sequence longer than the model's context \(64\)"):
        m(seqs(1, 65))
    cache = m.new_cache(1, max_len=80)
    m(seqs(1, 60), cache=cache)
    with pytest.raises(ValueError, match=r"sequence longer than the model's context \(64\)"):
        m(seqs(1, 5), cache=cache)


def test_logits_at_selects_rows(m):
    x = seqs(3, 20, seed=7)
    full = m(x)
    where = torch.rand(3, 20, generator=torch.Generator().manual_seed(0)) < 0.3
    where[0, 0] = True
    sel = m(x, logits_at=where)
    assert sel.shape == (int(where.sum()), V)
    torch.testing.assert_close(sel, full[where], atol=ATOL, rtol=0)
    # row-major order
    rows, cols = where.nonzero(as_tuple=True)
    for i, (r, c) in enumerate(zip(rows.tolist(), cols.tolist())):
        torch.testing.assert_close(sel[i], full[r, c], atol=ATOL, rtol=0)


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


@pytest.mark.parametrize("soft", [False, True])
def test_chunked_cross_entropy_is_the_whole_ones_loss_and_gradients(monkeypatch, soft):
    """Past CE_CHUNK logit elements the loss takes its rows a chunk at a time (a real vocabulary's logits on many
    rows would not fit): the same cross-entropy and the same gradients as all rows at once, for token and for
    distribution targets; and the chunks really ran (with checkpoint: their logits recomputed in the backward)."""
    torch.manual_seed(0)
    m = model.GPT(tiny_config())
    x = torch.randint(V, (3, 20))
    where = torch.rand(3, 20) < 0.7
    n = int(where.sum())
    targets = torch.randn(n, V).softmax(-1) if soft else torch.randint(V, (n,))

    def loss_and_grads():
        m.zero_grad(set_to_none=True)
        ce = m(x, logits_at=where, targets=targets)
        ce.sum().backward()
        return ce.detach(), [p.grad.clone() for p in m.parameters()]
    whole, whole_grads = loss_and_grads()
    calls = []
    monkeypatch.setattr(model, "CE_CHUNK", 7 * V)  # 7 rows a chunk
    monkeypatch.setattr(model, "checkpoint", lambda f, *a, **k: calls.append(1) or torch.utils.checkpoint.checkpoint(
        f, *a, **k))
    chunked, chunked_grads = loss_and_grads()
    assert len(calls) == -(-n // 7) > 1
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6)
    for a, b in zip(chunked_grads, whole_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
