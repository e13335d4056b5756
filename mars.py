"""MARS (Mask AutoRegression) in one file: the training input, the structured
attention mask, the two-part loss, and the acceptance rule used at inference.

Paper: "MARS: Enabling Autoregressive Models Multi-Token Generation", Jin et
al., arXiv 2604.07023. Conventions: the hidden state at position q predicts
token q+1 for real tokens and masks alike ("right-shifted logits"); B is the
MARS block size; tau the acceptance threshold; ar_weight the paper's alpha.
"""
import functools

import torch


# ---------------------------------------------------------------------------
# Training (paper section "Training")

def mars_attention_mask(seq_len, B):
    """Boolean (2T, 2T) mask over the [noisy | clean] input, True = may attend. With logical
    position p and block(p) = p // B, query i may attend key j when
      clean -> clean: pos_j <= pos_i                         (a plain AR model)
      noisy -> noisy: same block and pos_j <= pos_i          (causal within a block)
      noisy -> clean: block(j) < block(i)                    (earlier blocks only)
      clean -> noisy: never"""
    pos = torch.arange(seq_len)
    blk = pos // B
    causal = pos[None, :] <= pos[:, None]
    same_block = blk[None, :] == blk[:, None]
    earlier_block = blk[None, :] < blk[:, None]
    top = torch.cat([causal & same_block, earlier_block], dim=1)  # noisy queries
    bottom = torch.cat([torch.zeros_like(causal), causal], dim=1)  # clean queries
    return torch.cat([top, bottom], dim=0)


def noisy_copy(x, y, mask_id):
    """Replace every response token of the input x with <|mask|>; prompt tokens stay. Position
    q holds a response token when the target of q-1 does (y is x shifted left, -1 elsewhere)."""
    is_response = torch.zeros_like(x, dtype=torch.bool)
    is_response[:, 1:] = y[:, :-1] != -1
    return torch.where(is_response, torch.full_like(x, mask_id), x)


@functools.lru_cache(maxsize=256)
def training_mask(T, B, device):
    """mars_attention_mask(T, B) on device, built once per shape, not at every step."""
    return mars_attention_mask(T, B).to(device)


def idle_noisy_positions(y, B):
    """How many leading noisy positions feed nothing: those before the block of the batch's
    first target. They hold prompt tokens, carry no loss, and no other position attends to them
    (noisy -> noisy stays within a block; clean never sees noisy): the loss is the same without
    them, only cheaper."""
    first_target = int((y != -1).int().argmax(1).min())
    return first_target // B * B


def mars_input(x, y, mask_id, B):
    """The MARS forward's input for x and its targets y (b, T), y = -1 off the response: ids
    [noisy | clean], both streams at positions 0..T-1, targets [y | y] (position q of either stream
    predicts y[q]) and the MARS mask; the noisy positions that feed nothing left out (a saving)."""
    T = x.shape[1]
    ids = torch.cat([noisy_copy(x, y, mask_id), x], dim=1)  # [noisy | clean]
    pos = torch.arange(T, device=x.device).repeat(2)  # both streams at 0..T-1
    targets = torch.cat([y, y], dim=1)  # position q of either stream predicts y[q]
    attn_mask = training_mask(T, B, x.device)
    skip = idle_noisy_positions(y, B)  # only a saving
    return ids[:, skip:], pos[skip:], targets[:, skip:], attn_mask[skip:, skip:]


def mars_loss(model, x, y, mask_id, B, ar_weight=1.0):
    """Returns (loss, noisy_loss, clean_loss): one forward over [noisy | clean] under the MARS
    mask. The loss is, per sequence, the mean over its response tokens of CE(noisy) + ar_weight *
    CE(clean), then the mean over sequences: a short answer weighs as much as a long one (the
    official trainer's normalisation)."""
    ids, pos, targets, attn_mask = mars_input(x, y, mask_id, B)
    ce = model(ids, targets, positions=pos, attn_mask=attn_mask)  # (b, 2T - skip), 0 off target
    T, n = x.shape[1], (y != -1).sum(1).clamp_min(1)  # response tokens per sequence
    noisy, clean = ce[:, :-T].sum(1) / n, ce[:, -T:].sum(1) / n  # clean: the last T positions
    loss = (noisy + ar_weight * clean).mean()  # CE(noisy) + alpha * CE(clean)
    return loss, noisy.mean(), clean.mean()


def ar_loss(model, x, y, per_sequence=False):
    """Next-token cross-entropy on the response tokens: the token mean for stage 1 (as the
    official SFT trainer averages), or per_sequence, exactly mars_loss's clean term (the
    like-for-like control)."""
    ce, where = model(x, y), y != -1
    return (ce.sum(1) / where.sum(1).clamp_min(1)).mean() if per_sequence else ce[where].mean()


# ---------------------------------------------------------------------------
# Inference (paper section "Inference"): which predictions of a window to commit

def choose(logits):
    """The paper's greedy rule, for logits (..., vocab): each position's argmax, and its
    probability as the confidence."""
    logits = logits.float()
    tokens = logits.argmax(-1)
    return tokens, logits.softmax(-1).gather(-1, tokens[..., None])[..., 0]


def masks_to_feed(B, tau):
    """How many <|mask|> tokens a window feeds after the real tokens: B - 1 (B predictions in
    all), or none at tau >= 1, where only the AR token is committed (accept below), so that
    tau = 1.0 costs what AR costs."""
    return B - 1 if tau < 1 else 0


def accept(conf, tau):
    """How many predictions of each window to commit: (b, B) confidences -> (b,). The first
    prediction (the last real token's, i.e. the AR prediction) is always committed; then
    predictions 2, 3, ... left to right while conf >= tau, stopping at the first that falls short.
    tau >= 1 commits exactly one token: a float32 probability can round to 1.0, and conf >= 1.0
    would take more. tau: a number, or (b, 1), one per row."""
    tau = torch.as_tensor(tau, dtype=conf.dtype, device=conf.device)  # in conf's precision
    ok = (conf >= tau) & (tau < 1)
    ok[:, 0] = True
    return ok.long().cumprod(dim=1).sum(dim=1)


def banned(logits, mask_id, n_vocab):
    """logits with what is never an output at -inf: the <|mask|> placeholder, and ids from
    n_vocab on (a real checkpoint's padding rows)."""
    logits[..., mask_id] = float("-inf")
    if n_vocab is not None:
        logits[..., n_vocab:] = float("-inf")
    return logits


def through_eot(tokens, eot_id):
    """tokens up to and including the first <|endoftext|>: the answer ends there."""
    return tokens[:tokens.index(eot_id) + 1] if eot_id in tokens else tokens


def cache_slots(longest, B):
    """KV-cache slots a row can need: it caches at most longest - 1 positions (longest: prompt
    and answer), then a forward writes the widest window, 2B - 1 (fresh tokens, B - 1 masks)."""
    return longest - 1 + 2 * B - 1
