"""The chunked cross-entropy: a real vocabulary's logits on many rows would not fit at once, so past CE_CHUNK
logit elements the loss takes its rows a chunk at a time and recomputes each chunk's logits in the backward
(checkpoint): the same loss and gradients (tests/test_model.py), one chunk's logits in memory. Training reaches
it through its hook for real models (token_ce below has mars.token_ce's contract, plus soft targets)."""
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

CE_CHUNK = 2**25  # logit elements the loss holds at once (128 MiB in float32)


def cross_entropy(head, x, targets):
    """Cross-entropy (n,) of the logits head(x), in float32, against targets (ids or distributions). Past CE_CHUNK
    elements it takes the rows a chunk at a time and recomputes each chunk's logits in the backward (checkpoint),
    so that one chunk's logits exist rather than all of them; below, it is one call."""
    rows = max(1, CE_CHUNK // head.out_features)

    def ce(h, t):
        return F.cross_entropy(head(h).float(), t, reduction="none")
    if len(x) <= rows:
        return ce(x, targets)
    return torch.cat([checkpoint(ce, h, t, use_reentrant=False) for h, t in zip(x.split(rows), targets.split(rows))])


def token_ce(model, ids, targets, positions=None, attn_mask=None, soft=None):
    """mars.token_ce, chunked: the cross-entropy (b, t) in float32, 0 where the target is -1. soft: a distribution
    (n, vocab) per target, in the order of targets[targets != -1], to be the target instead of the token."""
    where = targets != -1
    ce = torch.zeros(targets.shape, device=targets.device)
    x = model.hidden(ids, positions, attn_mask)[where]
    ce[where] = cross_entropy(model.lm_head, x, targets[where] if soft is None else soft)
    return ce
