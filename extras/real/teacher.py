"""Targets that keep the model itself (python -m extras.real.train --targets soft;
beyond the paper, whose targets are the data's tokens): every response position of both
streams learns the frozen base model's next-token distribution there, the clean stream
by soft-target cross-entropy (its KL to the base plus the base's entropy, a constant),
the noisy stream likewise at the position it predicts. Medusa-2 keeps its backbone's
quality with the same KL when it fine-tunes backbone and heads together.

The base is a frozen copy in memory, run once per micro-batch on the clean sequence (a
forward, no backward), rather than top-k probabilities stored at distillation: exact at
no storage, any data file works, and its cost is measured (docs/real_models.md). Targets
past a sequence's first end of turn (the padding to B's multiple) stay its end of turn,
one-hot: the base, fed an end of turn, writes anything, and masks past the end learn to
predict it.
"""
import copy

import torch
import torch.nn.functional as F

import mars


def end_padding(y, eot_id):
    """Where y's targets come after each sequence's first end of turn: the padding to B's
    multiple, which --clean_padding drop leaves out of the clean stream and --targets soft
    keeps one-hot."""
    eot = y == eot_id
    return eot & (eot.cumsum(1) > 1)


class Teacher:
    """The frozen base model (a copy of `model` as it is now) and its soft targets."""

    def __init__(self, model, tok):
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        self.tok = tok

    @torch.no_grad()
    def targets(self, x, y, clean_y, noisy=True):
        """(n, vocab) probabilities, one per target of the MARS loss's [y | clean_y] (noisy)
        or of clean_y alone, in the order of its targets != -1, row by row (clean_y: y, or y
        without its padding's targets)."""
        hidden = self.model.hidden(x)[y != -1]
        # never a target: the placeholder, and a real model's rows past its tokenizer
        logits = self.model.lm_head(hidden).float()
        logits = mars.banned(logits, self.tok.mask, self.tok.n_vocab)
        probs = logits.softmax(-1)
        padding = end_padding(y, self.tok.eot)[y != -1]
        probs[padding] = F.one_hot(torch.tensor(self.tok.eot), probs.shape[1]).to(probs)
        row = ((y != -1).flatten().cumsum(0) - 1).view_as(y)  # a response position's row
        both = torch.cat([y, clean_y], 1) != -1
        index = torch.cat([row, row], 1)[both] if noisy else row[clean_y != -1]
        return probs[index]
