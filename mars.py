"""MARS (Mask AutoRegression) in one file: the training input, the structured
attention mask, the two-part loss, and the acceptance rule used at inference.

Paper: "MARS: Enabling Autoregressive Models Multi-Token Generation", Jin et
al., arXiv 2604.07023. Conventions: the hidden state at position q predicts
token q+1 for real tokens and masks alike ("right-shifted logits"); B is the
MARS block size; tau the acceptance threshold; ar_weight the paper's alpha.
"""
import functools
import math

import torch
import torch.nn.functional as F


# ---------------------------------------------------------------------------
# Training (paper section "Training")

def mars_attention_mask(seq_len, B, offset=0):
    """Boolean (2T, 2T) mask over the [noisy | clean] input, True = may attend. With logical
    position p and block(p) = (p + offset) // B, query i may attend key j when
      clean -> clean: pos_j <= pos_i                         (a plain AR model)
      noisy -> noisy: same block and pos_j <= pos_i          (causal within a block)
      noisy -> clean: block(j) < block(i)                    (earlier blocks only)
      clean -> noisy: never
    The paper's grid is offset 0 (blocks at multiples of B from the sequence start); a nonzero
    offset shifts every boundary (an ablation: train.py --block_offset random)."""
    pos = torch.arange(seq_len)
    blk = (pos + offset) // B
    causal = pos[None, :] <= pos[:, None]
    same_block = blk[None, :] == blk[:, None]
    earlier_block = blk[None, :] < blk[:, None]
    top = torch.cat([causal & same_block, earlier_block], dim=1)  # noisy queries
    bottom = torch.cat([torch.zeros_like(causal), causal], dim=1)  # clean queries
    return torch.cat([top, bottom], dim=0)


def noisy_copy(x, y, mask_id):
    """Replace every response token of the input x with <|mask|>; prompt tokens stay. Position q
    holds a response token when the target of q-1 does (y is x shifted left, -1 outside the response)."""
    is_response = torch.zeros_like(x, dtype=torch.bool)
    is_response[:, 1:] = y[:, :-1] != -1
    return torch.where(is_response, torch.full_like(x, mask_id), x)


def per_sequence_mean(ce, where):
    """(b,) mean of each sequence's values ce (those of where's True entries, row-major) over where (b, T)."""
    per_token = torch.zeros(where.shape, dtype=ce.dtype, device=ce.device)
    per_token[where] = ce
    return per_token.sum(1) / where.sum(1).clamp_min(1)


@functools.lru_cache(maxsize=256)
def training_mask(T, B, offset, start, device):
    """mars_attention_mask(T, B, offset) without the noisy rows and columns before `start`, on device:
    built once per shape, not at every step."""
    keep = torch.cat([torch.arange(start, T), torch.arange(T, 2 * T)])
    return mars_attention_mask(T, B, offset)[keep][:, keep].to(device)


def mars_loss(model, x, y, mask_id, B, ar_weight=1.0, offset=0, noisy_weight=None):
    """Returns (loss, noisy_loss, clean_loss) for inputs x and targets y (b, T).
    One forward over [noisy | clean] with shared positions. The loss is, per
    sequence, the mean over its response tokens of CE(noisy) + ar_weight *
    CE(clean), then the mean over sequences: a short answer weighs as much as a
    long one (the official trainer's "sequence" normalisation). Logits are
    computed only where there is a target. The noisy stream starts at the block
    of the batch's first target: earlier noisy positions (prompt only) feed no
    loss and no other position, so leaving them out changes nothing but the cost.
    noisy_weight (b,), optional: a weight per sequence on the noisy loss (the paper's
    "w/o SFT loss" ablation: ar_weight = 0 with the weights of `no_sft_weights`)."""
    b, T = x.shape
    first = int((y != -1).int().argmax(1).min())
    start = max(0, (first + offset) // B * B - offset)
    ids = torch.cat([noisy_copy(x, y, mask_id)[:, start:], x], dim=1)
    pos = torch.cat([torch.arange(start, T), torch.arange(T)]).to(x.device)
    targets = torch.cat([y[:, start:], y], dim=1)
    where = targets != -1
    logits = model(ids, positions=pos, attn_mask=training_mask(T, B, offset, start, x.device), logits_at=where)
    ce = F.cross_entropy(logits.float(), targets[where], reduction="none")
    n = T - start  # noisy positions
    is_noisy = torch.arange(n + T, device=x.device).expand(b, -1)[where] < n
    noisy = per_sequence_mean(ce[is_noisy], where[:, :n])
    clean = per_sequence_mean(ce[~is_noisy], where[:, n:])
    weight = 1.0 if noisy_weight is None else noisy_weight
    return (weight * noisy + ar_weight * clean).mean(), noisy.mean(), clean.mean()


def no_sft_weights(b, generator=None, device="cpu", eps=1e-3):
    """1/t per sequence, t ~ U[eps, 1): the noisy-loss weights of the paper's
    "w/o SFT loss" trainer, the masked-diffusion weighting it inherits (its
    noisy stream is always fully masked, so t only sets the weight)."""
    t = eps + (1 - eps) * torch.rand(b, generator=generator)
    return (1 / t).to(device)


def ar_loss(model, x, y, per_sequence=False):
    """Next-token cross-entropy on the response tokens: the token mean for stage 1 (as the official SFT
    trainer averages), or per_sequence, exactly the clean term of mars_loss (the like-for-like control)."""
    where = y != -1
    ce = F.cross_entropy(model(x, logits_at=where).float(), y[where], reduction="none")
    return per_sequence_mean(ce, where).mean() if per_sequence else ce.mean()


# ---------------------------------------------------------------------------
# Inference (paper section "Inference"): which predictions of a window to commit

METRICS = ("prob", "entropy", "margin")


def choose(logits, temperature=0.0, metric="prob", generator=None):
    """Tokens and their confidence in [0, 1] for logits (..., vocab): greedy at temperature 0, else
    Gumbel-max sampling of softmax(logits / T). The confidence comes from the untempered softmax, as in
    the official sampler: the temperature changes which token is drawn, not the scale tau is read on:
      prob:    probability of the chosen token
      margin:  top-1 minus top-2 probability
      entropy: 1 - H(p) / log(vocab), so that one rule, conf >= tau, serves all
    """
    logits = logits.float()
    if temperature > 0:
        u = torch.rand(logits.shape, generator=generator, device=logits.device)
        tokens = (logits / temperature - torch.log(-torch.log(u.clamp_min(1e-20)))).argmax(-1)
    else:
        tokens = logits.argmax(-1)
    probs = logits.softmax(-1)
    if metric == "prob":
        conf = probs.gather(-1, tokens[..., None])[..., 0]
    elif metric == "margin":
        top2 = probs.topk(2, dim=-1).values
        conf = top2[..., 0] - top2[..., 1]
    elif metric == "entropy":
        h = -(probs * probs.clamp_min(1e-30).log()).sum(-1)
        conf = 1 - h / math.log(logits.shape[-1])
    else:
        raise ValueError(f"unknown confidence metric {metric!r}; choose from {METRICS}")
    return tokens, conf


def accept(conf, tau, max_accept=None):
    """How many predictions of each window to commit: (b, B) confidences -> (b,). The first
    prediction (the last real token's, i.e. the AR prediction) is always committed; then
    predictions 2, 3, ... left to right while conf >= tau, stopping at the first that falls short.
    tau >= 1 commits exactly one token: a float32 probability can round to 1.0, and conf >= 1.0
    would take more. tau is a number or one per row (a threshold per request)."""
    b, B = conf.shape
    tau = torch.as_tensor(tau, dtype=conf.dtype, device=conf.device).expand(b)
    ok = (conf >= tau[:, None]) & (tau[:, None] < 1)
    ok[:, 0] = True
    n = ok.long().cumprod(dim=1).sum(dim=1)
    return n if max_accept is None else n.clamp(max=max_accept)
