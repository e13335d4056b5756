"""extras/real/options.py: the options beyond the paper that train.py reaches through its one hook
(train.beyond_the_paper): a shifted block grid and the --no_sft weights keep the paper's per-sequence
loss, and with none of them the hook's loss is the paper's."""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import data
import mars
from extras.real import options


def cfg(**changes):
    paper = dict(B=4, ar_weight=0.5, no_sft=False, block_offset="fixed", targets="hard", clean_padding="keep",
                 from_hf=False, device="cpu")
    return SimpleNamespace(**{**paper, **changes})


@pytest.fixture(scope="module")
def batch(tok, splits):
    from model import GPT, GPTConfig
    rows = [r for r in data.tokenize(splits["train"][:40], tok, 64, 4)][:8]
    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab_size=tok.n_vocab, max_seq_len=64, n_layer=2, n_head=2, n_embd=32)).double()
    return m, rows, tok


def test_no_sft_weights_are_one_over_uniform_t():
    w = options.no_sft_weights(20000, torch.Generator().manual_seed(0))
    t = 1 / w
    assert w.shape == (20000,) and t.min() >= 1e-3 and t.max() < 1
    assert abs(t.mean().item() - 0.5) < 0.01  # t ~ U[0.001, 1)


def test_without_options_the_hook_gives_the_papers_loss(batch):
    m, rows, tok = batch
    x, y = data.make_batch(rows, tok.eot, 4)
    draws = options.Options("mars", cfg(), tok).draws(torch.Generator().manual_seed(0), len(rows))
    loss, parts = options.Options("mars", cfg(), tok).loss(m, x, y, draws, slice(0, len(rows)))
    paper = mars.mars_loss(m, x, y, tok.mask, 4, 0.5)
    for got, want in zip((loss, parts["noisy"], parts["clean"]), paper):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_weighted_noisy_loss_is_the_weighted_mean_of_the_sequences(batch):
    """--no_sft's loss: the mean over sequences of 1/t times each sequence's noisy loss."""
    m, rows, tok = batch
    x, y = data.make_batch(rows, tok.eot, 4)
    T, where = x.shape[1], y != -1
    logits = m(torch.cat([mars.noisy_copy(x, y, tok.mask), x], 1), positions=torch.arange(T).repeat(2),
               attn_mask=mars.mars_attention_mask(T, 4))[:, :T]
    noisy_seq = torch.stack([F.cross_entropy(logits[b][where[b]], y[b][where[b]]) for b in range(len(x))])
    weights = torch.rand(len(x), dtype=torch.float64) * 5
    o = options.Options("mars", cfg(ar_weight=0.0, no_sft=True), tok)
    loss, _ = o.loss(m, x, y, {"offset": 0, "weights": weights, "soft": False}, slice(0, len(x)))
    torch.testing.assert_close(loss.double(), (weights * noisy_seq).mean(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("B,offset", [(4, 0), (4, 3), (3, 1), (1, 0)])
def test_leaving_out_idle_noisy_positions_changes_no_loss_on_any_grid(batch, monkeypatch, B, offset):
    m, rows, tok = batch
    x, y = data.make_batch(rows, tok.eot, B)
    skip = mars.idle_noisy_positions(y, B, offset)
    assert (skip + offset) % B == 0 or skip == 0
    o = options.Options("mars", cfg(B=B, no_sft=True, ar_weight=0.5), tok)
    draws = {"offset": offset, "weights": torch.rand(len(x), dtype=torch.float64) * 5, "soft": False}
    trimmed = o.loss(m, x, y, draws, slice(0, len(x)))[1]
    monkeypatch.setattr(mars, "idle_noisy_positions", lambda *args: 0)
    full = o.loss(m, x, y, draws, slice(0, len(x)))[1]
    for k in trimmed:
        torch.testing.assert_close(trimmed[k], full[k], atol=1e-6, rtol=0)


def test_a_batch_loss_is_the_mean_of_its_rows_on_a_shifted_grid(batch):
    """The per-sequence normalisation holds with a block offset and weights: each term of the batch's loss
    is the mean over rows of that row's loss alone."""
    m, rows, tok = batch
    x, y = data.make_batch(rows, tok.eot, 4)
    weights = torch.rand(len(rows), dtype=torch.float64) + 0.5
    o = options.Options("mars", cfg(no_sft=True, ar_weight=0.5), tok)
    for offset in (0, 2):
        draws = {"offset": offset, "weights": weights, "soft": False}
        terms = o.loss(m, x, y, draws, slice(0, len(rows)))[1]
        alone = [o.loss(m, *data.make_batch([r], tok.eot, 4), draws, slice(i, i + 1))[1]
                 for i, r in enumerate(rows)]
        for k, term in terms.items():
            torch.testing.assert_close(term, torch.stack([a[k] for a in alone]).mean(), atol=0, rtol=1e-6)
