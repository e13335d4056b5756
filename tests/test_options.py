"""extras/real/options.py: the options beyond the paper that python -m extras.real.train runs
through its Stage. A shifted block grid is the paper's mask composed from mars.py's, a shifted
grid and the --no_sft weights keep the paper's per-sequence loss, with none of them the loss is
the paper's, and a MARS checkpoint records them, which --resume holds a run to."""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import data
import mars
from conftest import assert_one_line_error, run_cli
from extras.real import options


def cfg(**changes):
    paper = dict(B=4, ar_weight=0.5, no_sft=False, block_offset="fixed", targets="hard",
                 clean_padding="keep", from_hf=False, device="cpu")
    return SimpleNamespace(**{**paper, **changes})


@pytest.fixture(scope="module")
def batch(tok, splits):
    from model import GPT, GPTConfig
    rows = [r for r in data.tokenize(splits["train"][:40], tok, 64, 4)][:8]
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=tok.n_vocab, max_seq_len=64, n_layer=2, n_head=2, n_embd=32)
    return GPT(config).double(), rows, tok


def test_no_sft_weights_are_one_over_uniform_t():
    w = options.no_sft_weights(20000, torch.Generator().manual_seed(0))
    t = 1 / w
    assert w.shape == (20000,) and t.min() >= 1e-3 and t.max() < 1
    assert abs(t.mean().item() - 0.5) < 0.01  # t ~ U[0.001, 1)


@pytest.mark.parametrize("T,B,offset", [(12, 4, 0), (12, 4, 3), (9, 3, 1), (7, 1, 0)])
def test_the_shifted_mask_is_the_rule_on_the_shifted_grid(T, B, offset):
    """The composed mask (the paper's over T + offset positions, its last T of each stream) is
    the MARS rule with block(p) = (p + offset) // B, and the paper's own at offset 0."""
    pos = torch.arange(T)
    blk = (pos + offset) // B
    causal = pos[None, :] <= pos[:, None]
    top = torch.cat([causal & (blk[None, :] == blk[:, None]), blk[None, :] < blk[:, None]], 1)
    bottom = torch.cat([torch.zeros_like(causal), causal], 1)
    got = options.shifted_mask(T, B, offset, "cpu")
    assert torch.equal(got, torch.cat([top, bottom]))
    if offset == 0:
        assert torch.equal(got, mars.mars_attention_mask(T, B))


def test_without_options_the_loss_is_the_papers(batch):
    m, rows, tok = batch
    x, y = data.make_batch(rows, tok.eot, 4)
    loss, parts = options.Options("mars", cfg(), tok).loss(m, x, y)
    paper = mars.mars_loss(m, x, y, tok.mask, 4, 0.5)
    for got, want in zip((loss, parts["noisy"], parts["clean"]), paper):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_weighted_noisy_loss_is_the_weighted_mean_of_the_sequences(batch):
    """--no_sft's loss: the mean over sequences of 1/t times each sequence's noisy loss."""
    m, rows, tok = batch
    x, y = data.make_batch(rows, tok.eot, 4)
    T, where = x.shape[1], y != -1
    ids = torch.cat([mars.noisy_copy(x, y, tok.mask), x], 1)
    logits = m(ids, positions=torch.arange(T).repeat(2),
               attn_mask=mars.mars_attention_mask(T, 4))[:, :T]
    noisy_seq = torch.stack([F.cross_entropy(logits[b][where[b]], y[b][where[b]])
                             for b in range(len(x))])
    weights = torch.rand(len(x), dtype=torch.float64) * 5
    o = options.Options("mars", cfg(ar_weight=0.0, no_sft=True), tok)
    loss, _ = o.loss(m, x, y, weights=weights)
    torch.testing.assert_close(loss.double(), (weights * noisy_seq).mean(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("B,offset", [(4, 0), (4, 3), (3, 1), (1, 0)])
def test_leaving_out_idle_noisy_positions_changes_no_loss_on_any_grid(batch, monkeypatch, B,
                                                                      offset):
    m, rows, tok = batch
    x, y = data.make_batch(rows, tok.eot, B)
    skip = options.idle_noisy_positions(y, B, offset)
    assert (skip + offset) % B == 0 or skip == 0
    o = options.Options("mars", cfg(B=B, no_sft=True, ar_weight=0.5), tok)
    weights = torch.rand(len(x), dtype=torch.float64) * 5
    trimmed = o.loss(m, x, y, offset, weights)[1]
    monkeypatch.setattr(mars, "idle_noisy_positions", lambda *args: 0)
    assert options.idle_noisy_positions(y, B, offset) == 0
    full = o.loss(m, x, y, offset, weights)[1]
    for k in trimmed:
        torch.testing.assert_close(trimmed[k], full[k], atol=1e-6, rtol=0)


def test_a_batch_loss_is_the_mean_of_its_rows_on_a_shifted_grid(batch):
    """The per-sequence normalisation holds with a block offset and weights: each term of the
    batch's loss is the mean over rows of that row's loss alone."""
    m, rows, tok = batch
    x, y = data.make_batch(rows, tok.eot, 4)
    weights = torch.rand(len(rows), dtype=torch.float64) + 0.5
    o = options.Options("mars", cfg(no_sft=True, ar_weight=0.5), tok)
    for offset in (0, 2):
        terms = o.loss(m, x, y, offset, weights)[1]
        alone = [o.loss(m, *data.make_batch([r], tok.eot, 4), offset, weights[i:i + 1])[1]
                 for i, r in enumerate(rows)]
        for k, term in terms.items():
            torch.testing.assert_close(term, torch.stack([a[k] for a in alone]).mean(),
                                       atol=0, rtol=1e-6)


def test_a_mars_checkpoint_records_its_options_and_resume_holds_a_run_to_them(tiny_run,
                                                                              tmp_path):
    """The six stage-2 flags under "mars": an interrupted run resumes with the same flags and
    refuses changed ones."""
    flags = ["--preset", "tiny", "--stage", "mars", "--init_from", tiny_run / "ar.pt",
             "--out_dir", tmp_path, "--mars_iters", "2", "--eval_every", "2",
             "--summary_limit", "0", "--device", "cpu", "--no_sft"]
    proc = run_cli(["extras/real/train.py", *flags, "--block_offset", "random"])
    assert proc.returncode == 0, proc.stderr
    path = tmp_path / "mars.pt"
    ckpt = torch.load(path, weights_only=True)
    assert ckpt["mars"] == {"B": 4, "ar_weight": 0.0, "no_sft": True, "block_offset": "random",
                            "targets": "hard", "clean_padding": "keep"}
    assert "hf" not in ckpt and ckpt["train_config"]["from_hf"] is False

    def interrupted():  # as if Ctrl-C had stopped it after its first step
        torch.save({**ckpt, "iter": 1, "done": False, "history": ckpt["history"][:1]}, path)
    interrupted()
    proc = run_cli(["extras/real/train.py", *flags, "--block_offset", "random", "--resume"])
    assert proc.returncode == 0, proc.stderr
    again = torch.load(path, weights_only=True)
    assert again["done"] and [h["iter"] for h in again["history"]] == [1, 2]
    interrupted()
    proc = run_cli(["extras/real/train.py", *flags, "--resume"])
    assert_one_line_error(proc)
    assert "--resume with changed stage-2 flags (block_offset random -> fixed)" in proc.stderr
