"""mars.py: the structured attention mask, no leakage, the loss, noisy_copy, accept, choose."""
import pytest
import torch
import torch.nn.functional as F

import data
import mars
from conftest import MASK, V, random_model

ATOL = 1e-10
SHAPES = [(8, 4), (10, 4), (7, 3), (5, 1), (6, 8), (12, 2), (9, 9)]


@pytest.fixture(scope="module")
def m():
    return random_model(seed=5)


def reference_mask(T, B):
    """The four rules of the paper's section "Training" (mars.mars_attention_mask), one element at a
    time."""
    M = [[False] * (2 * T) for _ in range(2 * T)]
    for i in range(2 * T):
        for j in range(2 * T):
            qi, pi = ("noisy", i) if i < T else ("clean", i - T)
            kj, pj = ("noisy", j) if j < T else ("clean", j - T)
            if qi == "clean" and kj == "clean":
                M[i][j] = pj <= pi
            elif qi == "noisy" and kj == "noisy":
                M[i][j] = pj // B == pi // B and pj <= pi
            elif qi == "noisy" and kj == "clean":
                M[i][j] = pj // B < pi // B
            else:
                M[i][j] = False
    return torch.tensor(M)


@pytest.mark.parametrize("T,B", SHAPES)
def test_attention_mask_matches_the_four_rules(T, B):
    mask = mars.mars_attention_mask(T, B)
    assert mask.shape == (2 * T, 2 * T) and mask.dtype == torch.bool
    assert torch.equal(mask, reference_mask(T, B))
    assert mask.any(dim=1).all()  # every query sees something: SDPA gives no NaN
    assert mask.diagonal().all()


def test_attention_mask_block_one_noisy_sees_all_earlier_clean():
    # B = 1: noisy query at p sees clean 0..p-1 and itself only, i.e. exactly the AR context
    T = 6
    mask = mars.mars_attention_mask(T, 1)
    for p in range(T):
        assert mask[p, :T].nonzero().flatten().tolist() == [p]
        assert mask[p, T:].nonzero().flatten().tolist() == list(range(p))


def mars_inputs(x, y):
    b, T = x.shape
    return torch.cat([mars.noisy_copy(x, y, MASK), x], 1), torch.arange(T).repeat(2)


def random_batch(b=2, T=16, n_prompt=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V - 2, (b, T), generator=g)
    y = torch.full((b, T), -1)
    y[:, n_prompt - 1:T - 1] = x[:, n_prompt:]
    y[:, T - 1] = torch.randint(0, V - 2, (b,), generator=g)
    return x, y


@pytest.mark.parametrize("T,B", [(16, 4), (15, 4), (12, 3), (10, 1)])
def test_no_leakage_from_future_clean_tokens(m, T, B):
    x, y = random_batch(T=T, n_prompt=3, seed=T + B)
    ids, pos = mars_inputs(x, y)
    attn = mars.mars_attention_mask(T, B)
    base = m(ids, positions=pos, attn_mask=attn)
    g = torch.Generator().manual_seed(1)
    for k in range((T + B - 1) // B):
        changed = ids.clone()
        changed[:, T + k * B:] = torch.randint(0, V - 2, (2, T - k * B), generator=g)  # clean positions >= k*B
        assert not torch.equal(changed, ids)
        out = m(changed, positions=pos, attn_mask=attn)
        # noisy logits of blocks 0..k do not move
        torch.testing.assert_close(out[:, :min((k + 1) * B, T)], base[:, :min((k + 1) * B, T)], atol=ATOL, rtol=0)
        # but the clean logits from k*B on do (the change was real)
        assert (out[:, T + k * B:] - base[:, T + k * B:]).abs().max() > 1e-6
        # and so do later noisy blocks, which may see clean block k
        if (k + 1) * B < T:
            assert (out[:, (k + 1) * B:T] - base[:, (k + 1) * B:T]).abs().max() > 1e-6


def test_noisy_block_sees_previous_clean_block(m):
    """The mask is not trivially blocking: changing clean token k*B - 1 moves block k's noisy logits."""
    T, B = 16, 4
    x, y = random_batch(T=T, n_prompt=3, seed=9)
    ids, pos = mars_inputs(x, y)
    attn = mars.mars_attention_mask(T, B)
    base = m(ids, positions=pos, attn_mask=attn)
    changed = ids.clone()
    changed[:, T + 2 * B - 1] = (changed[:, T + 2 * B - 1] + 1) % (V - 2)
    out = m(changed, positions=pos, attn_mask=attn)
    torch.testing.assert_close(out[:, :2 * B], base[:, :2 * B], atol=ATOL, rtol=0)
    assert (out[:, 2 * B:3 * B] - base[:, 2 * B:3 * B]).abs().max() > 1e-6


@pytest.mark.parametrize("B", [1, 3, 4, 8])
def test_clean_half_is_the_plain_causal_model(m, B):
    x, y = random_batch(T=14, seed=B)
    ids, pos = mars_inputs(x, y)
    out = m(ids, positions=pos, attn_mask=mars.mars_attention_mask(14, B))
    torch.testing.assert_close(out[:, 14:], m(x), atol=ATOL, rtol=0)


def test_noisy_copy_masks_exactly_the_response():
    x, y = random_batch(b=3, T=12, n_prompt=4)
    y[1, 9:] = -1  # a shorter row (padding at the end)
    xn = mars.noisy_copy(x, y, MASK)
    for b in range(3):
        for q in range(12):
            is_response = q > 0 and y[b, q - 1] != -1
            assert xn[b, q] == (MASK if is_response else x[b, q]), (b, q)
    assert (xn[:, :4] == x[:, :4]).all()  # the prompt stays visible
    assert (xn[0, 4:] == MASK).all()


@pytest.fixture(scope="module")
def padded_batch(tok, splits):
    rows = [tok.example_ids(e["prompt"], e["response"]) for e in splits["train"][:6]]
    assert len({len(ids) for ids, _ in rows}) > 1
    return data.make_batch(rows, tok.eot), tok


def tok_model(tok, seed=0):
    from model import GPT, GPTConfig
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=tok.n_vocab, max_seq_len=64, n_layer=2, n_head=2, n_embd=32)).double()


def test_mars_loss_padded_batch_finite_with_finite_grads(padded_batch):
    (x, y), tok = padded_batch
    m = tok_model(tok)
    loss, noisy, clean = mars.mars_loss(m, x, y, tok.mask, 4)
    assert torch.isfinite(loss) and torch.isfinite(noisy) and torch.isfinite(clean)
    loss.backward()
    grads = [p.grad for p in m.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert sum(g.abs().sum() for g in grads) > 0


@pytest.mark.parametrize("B", [1, 4, 8])
def test_mars_loss_matches_an_independent_computation(padded_batch, B):
    (x, y), tok = padded_batch
    m = tok_model(tok, seed=B)
    T = x.shape[1]
    ids = torch.cat([mars.noisy_copy(x, y, tok.mask), x], 1)
    logits = m(ids, positions=torch.arange(T).repeat(2), attn_mask=mars.mars_attention_mask(T, B))
    where = y != -1

    def per_sequence(half):  # the official "sequence" normalisation, one sequence at a time
        return torch.stack([F.cross_entropy(half[b][where[b]], y[b][where[b]]) for b in range(len(x))])
    noisy_seq, clean_seq = per_sequence(logits[:, :T]), per_sequence(logits[:, T:])
    noisy_ref, clean_ref = noisy_seq.mean(), clean_seq.mean()
    # stage 1 keeps the token mean of an ordinary SFT trainer, so long answers weigh more there
    token_mean = F.cross_entropy(logits[:, T:][where], y[where])
    torch.testing.assert_close(token_mean, mars.ar_loss(m, x, y).double(), atol=1e-6, rtol=0)
    assert abs(token_mean - clean_ref) > 1e-4
    for w in (0.0, 0.5, 1.0):
        loss, noisy, clean = mars.mars_loss(m, x, y, tok.mask, B, ar_weight=w)
        torch.testing.assert_close(noisy.double(), noisy_ref, atol=1e-6, rtol=0)
        torch.testing.assert_close(clean.double(), clean_ref, atol=1e-6, rtol=0)
        torch.testing.assert_close(loss.double(), noisy_ref + w * clean_ref, atol=1e-5, rtol=0)
    assert abs(noisy_ref - clean_ref) > 1e-3  # the two streams really differ


@pytest.mark.parametrize("B", [4, 3, 1])
def test_leaving_out_idle_noisy_positions_changes_no_loss(padded_batch, monkeypatch, B):
    """mars_loss drops the noisy positions before the block of the batch's first target (a saving): with
    the noisy stream in full the three losses are the same, whatever the blocks."""
    (x, y), tok = padded_batch
    m = tok_model(tok, seed=B)
    skip = mars.idle_noisy_positions(y, B)
    first_target = int((y != -1).int().argmax(1).min())
    assert 0 < skip <= first_target < skip + B and skip % B == 0  # the start of that block
    trimmed = mars.mars_loss(m, x, y, tok.mask, B, 0.5)
    monkeypatch.setattr(mars, "idle_noisy_positions", lambda *args: 0)
    full = mars.mars_loss(m, x, y, tok.mask, B, 0.5)
    for a, b in zip(trimmed, full):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_idle_noisy_positions_starts_at_zero_when_the_grid_does():
    """A target inside the first block leaves nothing out; one in block k leaves out k blocks."""
    y = torch.full((2, 12), -1)
    y[0, 6:] = 1
    y[1, 2:] = 1
    assert mars.idle_noisy_positions(y, 4) == 0
    assert mars.idle_noisy_positions(y[:1], 4) == 4 and mars.idle_noisy_positions(y[:1], 8) == 0
    assert mars.idle_noisy_positions(y[:1], 3) == 6 and mars.idle_noisy_positions(y[:1], 5) == 5


def test_ar_loss_counts_response_tokens_only(padded_batch):
    (x, y), tok = padded_batch
    m = tok_model(tok)
    base = mars.ar_loss(m, x, y)
    # changing targets outside the response (they are -1) or the padding inputs changes nothing
    x2 = x.clone()
    pad_cols = (x == tok.eot) & (y == -1)
    pad_cols[:, :2] = False
    x2[pad_cols] = 7
    torch.testing.assert_close(mars.ar_loss(m, x2, y), base, atol=1e-10, rtol=0)
    y2 = y.clone()
    first = (y2[0] != -1).nonzero()[0, 0]
    y2[0, first] = (y2[0, first] + 1) % tok.n_vocab
    assert mars.ar_loss(m, x, y2) != base


def test_control_loss_is_the_clean_term_of_the_mars_loss(padded_batch):
    """The control (train.py --stage control) differs from MARS only by the noisy stream: its loss,
    ar_loss(per_sequence=True), is mars_loss's clean term; stage 1's token mean is another number."""
    (x, y), tok = padded_batch
    m = tok_model(tok)
    _, _, clean = mars.mars_loss(m, x, y, tok.mask, 4)
    control = mars.ar_loss(m, x, y, per_sequence=True)
    torch.testing.assert_close(control, clean, atol=1e-10, rtol=0)
    assert abs(mars.ar_loss(m, x, y) - control) > 1e-6  # the batch's sequences differ in length


# ---------------------------------------------------------------------------
# Acceptance

def test_accept_rules():
    conf = torch.tensor([[0.1, 0.2, 0.3, 0.4],     # first always accepted
                         [0.9, 0.95, 0.5, 0.99],   # stops at the first short one
                         [0.2, 0.9, 0.9, 0.9],     # all after the first
                         [1.0, 0.8, 0.95, 0.95]])  # exactly tau counts
    assert mars.accept(conf, 0.8).tolist() == [1, 2, 4, 4]
    assert mars.accept(conf, 0.95).tolist() == [1, 2, 1, 1]


def test_accept_tau_one_commits_one_token_even_at_probability_one():
    conf = torch.ones(3, 5)
    assert mars.accept(conf, 1.0).tolist() == [1, 1, 1]
    assert mars.accept(conf, torch.tensor([[1.0], [0.5], [1.0]])).tolist() == [1, 5, 1]
    assert mars.accept(conf.double(), 1.0).tolist() == [1, 1, 1]


def test_accept_per_row_tau():
    """The engine's requests each have a tau: a (b, 1) column broadcasts over each row's predictions."""
    conf = torch.tensor([[0.5, 0.6, 0.7], [0.5, 0.6, 0.7], [0.5, 0.6, 0.7]])
    assert mars.accept(conf, torch.tensor([[0.65], [0.55], [0.75]])).tolist() == [1, 3, 1]
    assert mars.accept(conf, torch.tensor([[0.6], [0.7], [0.1]])).tolist() == [3, 1, 3]


def test_accept_compares_in_the_confidences_precision():
    """tau is cast to conf's dtype before the comparison: a float32 probability that is tau's float32 value
    passes, though a float64 tau is a little above it."""
    conf = torch.full((2, 3), 0.9)  # float32: 0.899999976...
    assert conf[0, 0].item() < 0.9
    assert mars.accept(conf, torch.tensor([[0.9], [0.95]], dtype=torch.float64)).tolist() == [3, 1]
    assert mars.accept(conf, 0.9).tolist() == [3, 3]


def test_accept_block_of_one():
    assert mars.accept(torch.tensor([[0.01], [0.99]]), 0.5).tolist() == [1, 1]


def test_choose_is_the_greedy_rule():
    logits = torch.randn(3, 5, V, generator=torch.Generator().manual_seed(0)) * 4
    tokens, conf = mars.choose(logits)
    assert torch.equal(tokens, logits.argmax(-1))
    torch.testing.assert_close(conf, logits.softmax(-1).max(-1).values)


# ---------------------------------------------------------------------------
# The central invariant (paper, "Inference"): why decoding needs no new attention pattern


def window_vs_training_stream(model, ids, n_prompt, mask_id, eot_id, B, s):
    """Largest |difference| between the decoding window [ids[:s] | B-1 masks] under plain causal attention and
    the training forward of ids ([noisy | clean], mars_attention_mask): the window's first prediction (after
    ids[s-1]) against the clean stream at s-1, its mask predictions against the noisy stream at s..s+B-2."""
    x, y = data.make_batch([(ids, n_prompt)], eot_id, B)
    T = x.shape[1]
    train = model(torch.cat([mars.noisy_copy(x, y, mask_id), x], 1), positions=torch.arange(T).repeat(2),
                  attn_mask=mars.mars_attention_mask(T, B))[0]
    window = model(torch.tensor([ids[:s] + [mask_id] * (B - 1)]))[0, s - 1:]
    return max((window[0] - train[T + s - 1]).abs().max().item(), (window[1:] - train[s:s + B - 1]).abs().max().item())


def test_decoding_window_is_the_training_noisy_stream(tiny_run):
    """On the trained checkpoint, in float64: the window [prompt | committed tokens up to a block start | B-1 masks]
    under causal attention gives exactly the training forward's logits: the last real token's is the clean
    stream's (the AR logit), each mask's is the noisy stream's at its position. It holds when the masks start on
    the training grid (s % B == 0); elsewhere the window is not a training context, and it fails (so the check
    can fail)."""
    import common
    import train
    ckpt = common.load_checkpoint(str(tiny_run / "mars.pt"))
    model, tok = common.model_from_checkpoint(ckpt)
    model = model.double().eval()
    B, cfg = ckpt["mars"]["B"], ckpt["train_config"]
    examples = data.load_splits(cfg["data"], cfg["seed"], cfg["n_train"])["val"][:6]
    on_grid, off_grid = [], []
    with torch.no_grad():
        for e in examples:
            ids, n_prompt = tok.example_ids(e["prompt"], e["response"])
            T = len(ids) + (-len(ids) % B) - 1  # the training input: padded with <|endoftext|> to a multiple of B
            for s in range(n_prompt, T - B + 2):  # the masks stand for response tokens (or the trained padding)
                if s % B and s == n_prompt:
                    continue  # the prompt's last tokens are visible in the noisy stream too: a training context
                diff = window_vs_training_stream(model, ids, n_prompt, tok.mask, tok.eot, B, s)
                (on_grid if s % B == 0 else off_grid).append(diff)
    assert len(on_grid) >= 6 and max(on_grid) < 1e-10, max(on_grid)
    assert min(off_grid) > 1e-4


def test_mars_loss_defaults_to_alpha_one_and_a_one_token_answer_is_its_token(padded_batch):
    """The paper's alpha = 1 is the default; a row whose response is one token weighs that token's loss whole
    (each row's mean divides by its own count of targets), in mars_loss and in ar_loss per sequence."""
    (x, y), tok = padded_batch
    m = tok_model(tok)
    loss, noisy, clean = mars.mars_loss(m, x, y, tok.mask, 4)
    torch.testing.assert_close(loss, noisy + clean)
    rows, first = torch.arange(len(y)), (y != -1).int().argmax(1)
    one = torch.full_like(y, -1)
    one[rows, first] = y[rows, first]
    per_token = m(x, one)  # the plain causal forward's loss at each target, 0 elsewhere
    _, _, clean_one = mars.mars_loss(m, x, one, tok.mask, 4)
    torch.testing.assert_close(clean_one, per_token.sum(1).mean())
    torch.testing.assert_close(mars.ar_loss(m, x, one, per_sequence=True), per_token.sum(1).mean())
