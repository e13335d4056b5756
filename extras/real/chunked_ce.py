"""A real vocabulary's cross-entropy, a chunk of rows at a time: the logits of many rows
would not fit at once, so past CE_CHUNK logit elements the loss takes its rows a chunk at
a time and recomputes each chunk's logits in the backward (checkpoint): the same loss and
gradients, one chunk's logits in memory. It also takes soft targets (teacher.py).

The loss is computed inside the model's forward (ChunkedGPT), so that a DDP wrapper, which
syncs gradients only through its own forward, wraps the whole of it.
"""
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from model import GPT

CE_CHUNK = 2**25  # logit elements the loss holds at once (128 MiB in float32)


def cross_entropy(head, x, targets):
    """Cross-entropy (n,) of the logits head(x), in float32, against targets (ids, or one
    distribution per row). Below CE_CHUNK elements, one call."""
    rows = max(1, CE_CHUNK // head.out_features)

    def ce(h, t):
        return F.cross_entropy(head(h).float(), t, reduction="none")
    if len(x) <= rows:
        return ce(x, targets)
    chunks = zip(x.split(rows), targets.split(rows))
    return torch.cat([checkpoint(ce, h, t, use_reentrant=False) for h, t in chunks])


class ChunkedGPT(GPT):
    """GPT whose loss forward takes its logits in chunks, with optional soft targets: a
    distribution (n, vocab) per target, in the order of targets[targets != -1]."""

    def forward(self, idx, targets=None, positions=None, attn_mask=None, cache=None,
                soft=None):
        if targets is None:
            return super().forward(idx, None, positions, attn_mask, cache)
        where = targets != -1
        ce = torch.zeros(targets.shape, device=targets.device)
        x = self.hidden(idx, positions, attn_mask, cache)[where]
        ce[where] = cross_entropy(self.lm_head, x, targets[where] if soft is None else soft)
        return ce


def chunked(model):
    """The GPT model itself, now a ChunkedGPT: the same parameters (the subclass adds no
    state), so its checkpoints and every caller stay as they were."""
    model.__class__ = ChunkedGPT
    return model
