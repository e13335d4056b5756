"""train.py's options beyond the paper, and a real model's loss: what train.beyond_the_paper (the loop's one hook)
returns when a run asks for any of them. The paper's loss is mars.mars_loss; this composes the same pieces
(mars.mars_input, the per-sequence means) with:

- --block_offset random: every block boundary shifted by a random offset each step (an ablation);
- --no_sft: the paper's "w/o SFT loss" ablation: no clean-stream loss, each sequence's noisy loss weighted 1/t;
- --clean_padding drop: the clean stream without the end-of-turn padding to B's multiple as targets;
- --targets soft: the frozen start model's distribution as targets (extras/real/teacher.py);
- a real model (--init_from DIR): its large vocabulary's cross-entropy a chunk of rows at a time
  (extras/real/chunked_ce.py), from the model's hidden states.
"""
import os

import torch

import mars
from common import load_checkpoint, model_from_checkpoint
from extras.real.teacher import Teacher, end_padding


def no_sft_weights(b, generator=None, device="cpu", eps=1e-3):
    """1/t per sequence, t ~ U[eps, 1): the noisy-loss weights of the paper's "w/o SFT loss" trainer, the
    masked-diffusion weighting it inherits (its noisy stream is always fully masked, so t only sets the weight)."""
    t = eps + (1 - eps) * torch.rand(b, generator=generator)
    return (1 / t).to(device)


def start(name, cfg, model, tok, state):
    """The Options of stage `name`; --targets soft: the frozen model stage 2 starts from (a resumed stage
    reloads it from where it started)."""
    if cfg.targets == "hard" or name == "ar":
        return Options(name, cfg, tok)
    if state is not None:
        source = cfg.init_from if cfg.init_from and cfg.stage != "all" else os.path.join(cfg.out_dir, "ar.pt")
        model, tok = model_from_checkpoint(load_checkpoint(source, cfg.device), cfg.device)
    return Options(name, cfg, tok, Teacher(model, tok))


class Options:
    """A stage's loss under the options (cfg's flags) and, for a real model, the chunked cross-entropy.
    teacher: the frozen model stage 2 starts from, for --targets soft (None otherwise)."""

    def __init__(self, name, cfg, tok, teacher=None):
        self.name, self.cfg, self.tok, self.teacher = name, cfg, tok, teacher

    def draws(self, rng, n, validation=False):
        """A step's random draws for n sequences: the block offset, and the --no_sft weights (1/t per
        sequence; none in validation, whose loss is unweighted and on the data's tokens)."""
        a = self.cfg
        offset = int(torch.randint(a.B, (1,), generator=rng)) if a.block_offset == "random" else 0
        weights = no_sft_weights(n, rng, a.device) if a.no_sft else None
        return {"offset": offset, "weights": None if validation else weights, "soft": not validation}

    def clean_targets(self, y):
        """y, or with --clean_padding drop, y without the end-of-turn padding to B's multiple."""
        if self.name == "ar" or self.cfg.clean_padding == "keep":
            return y
        return y.masked_fill(end_padding(y, self.tok.eot), -1)

    def ce(self, model, ids, targets, positions=None, attn_mask=None, soft=None):
        """mars.token_ce, or a chunk of rows at a time from the hidden states (a real model's
        vocabulary; soft targets): extras/real/chunked_ce.py."""
        if soft is None and not self.cfg.from_hf:
            return mars.token_ce(model, ids, targets, positions, attn_mask)
        from extras.real import chunked_ce
        return chunked_ce.token_ce(model, ids, targets, positions, attn_mask, soft)

    def loss(self, model, x, y, draws, rows=None):
        """The stage's loss and what to log, as train.Stage.loss gives them; rows: this micro-batch's share
        of the step's sequences (for the --no_sft weights)."""
        clean_y = self.clean_targets(y)
        teach = self.teacher is not None and draws["soft"]
        if self.name != "mars":
            soft = self.teacher.targets(x, y, clean_y, noisy=False) if teach else None
            ce, n = self.ce(model, x, clean_y, soft=soft), (clean_y != -1).sum(1).clamp_min(1)
            loss = (ce.sum(1) / n).mean() if self.name == "control" else ce[clean_y != -1].mean()
            return loss, {"loss": loss}
        ids, pos, targets, attn_mask = mars.mars_input(x, y, self.tok.mask, self.cfg.B, draws["offset"])
        T = x.shape[1]
        targets = torch.cat([targets[:, :-T], clean_y], dim=1)
        soft = self.teacher.targets(x, y, clean_y) if teach else None
        ce = self.ce(model, ids, targets, pos, attn_mask, soft)
        n, n_clean = ((t != -1).sum(1).clamp_min(1) for t in (y, clean_y))
        noisy, clean = ce[:, :-T].sum(1) / n, ce[:, -T:].sum(1) / n_clean
        weight = 1.0 if draws["weights"] is None else draws["weights"][rows]
        loss = (weight * noisy + self.cfg.ar_weight * clean).mean()
        return loss, {"loss": loss, "noisy": noisy.mean(), "clean": clean.mean()}
