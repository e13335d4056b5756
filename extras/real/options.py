"""The options beyond the paper, and a real model's loss: train.Stage with a loss composed
from mars.py's pieces (python -m extras.real.train runs train.py's loop with this Stage):

- --block_offset random: every block boundary shifted by a random offset each step;
- --no_sft: the paper's "w/o SFT loss" ablation: no clean-stream loss, each sequence's
  noisy loss weighted 1/t;
- --clean_padding drop: the clean stream without the end-of-turn padding to B's multiple;
- --targets soft: the frozen start model's distribution as targets (teacher.py);
- a real model: its large vocabulary's cross-entropy in chunks (chunked_ce.py).
With none of the options, the loss is train.Stage's: the paper's.
"""
import functools
import os

import torch
import torch.nn.functional as F

import mars
import train
from extras.checkpoints import foreign
from extras.real.chunked_ce import chunked
from extras.real.teacher import Teacher, end_padding

PAPER = dict(no_sft=False, block_offset="fixed", targets="hard", clean_padding="keep")


def stage2_flags(cfg):
    """What a MARS checkpoint records of its stage-2 flags; --resume holds a run to them."""
    return {k: getattr(cfg, k) for k in ("B", "ar_weight", *PAPER)}


def no_sft_weights(b, generator=None, device="cpu", eps=1e-3):
    """1/t per sequence, t ~ U[eps, 1): the noisy-loss weights of the paper's "w/o SFT loss"
    trainer, the masked-diffusion weighting it inherits (its noisy stream is always fully
    masked, so t only sets the weight)."""
    t = eps + (1 - eps) * torch.rand(b, generator=generator)
    return (1 / t).to(device)


# ---------------------------------------------------------------------------
# The MARS input on a shifted grid, composed from mars.py's

@functools.lru_cache(maxsize=256)
def shifted_mask(T, B, offset, device):
    """The MARS mask with block(p) = (p + offset) // B: the paper's mask over T + offset
    positions, at the last T positions of each stream."""
    keep = torch.arange(offset, offset + T)
    keep = torch.cat([keep, T + offset + keep])
    return mars.mars_attention_mask(T + offset, B)[keep][:, keep].to(device)


def idle_noisy_positions(y, B, offset):
    """mars.idle_noisy_positions on the shifted grid: y behind offset positions with no
    target."""
    return max(0, mars.idle_noisy_positions(F.pad(y, (offset, 0), value=-1), B) - offset)


def mars_input(x, y, mask_id, B, offset=0):
    """mars.mars_input with every block boundary shifted by offset (0: the paper's)."""
    if offset == 0:
        return mars.mars_input(x, y, mask_id, B)
    T = x.shape[1]
    ids = torch.cat([mars.noisy_copy(x, y, mask_id), x], dim=1)
    pos = torch.arange(T, device=x.device).repeat(2)
    targets = torch.cat([y, y], dim=1)
    attn_mask = shifted_mask(T, B, offset, x.device)
    skip = idle_noisy_positions(y, B, offset)  # only a saving
    return ids[:, skip:], pos[skip:], targets[:, skip:], attn_mask[skip:, skip:]


def per_token_ce(model, ids, targets, positions=None, attn_mask=None, soft=None):
    """The model's cross-entropy (b, t); soft targets need a ChunkedGPT."""
    kwargs = {} if soft is None else {"soft": soft}
    return model(ids, targets, positions=positions, attn_mask=attn_mask, **kwargs)


class Options:
    """A stage's loss under the options (cfg's flags). teacher: the frozen model stage 2
    starts from, for --targets soft (None otherwise)."""

    def __init__(self, name, cfg, tok, teacher=None):
        self.name, self.cfg, self.tok, self.teacher = name, cfg, tok, teacher

    def clean_targets(self, y):
        """y, or with --clean_padding drop, y without the end-of-turn padding."""
        if self.name == "ar" or self.cfg.clean_padding == "keep":
            return y
        return y.masked_fill(end_padding(y, self.tok.eot), -1)

    def loss(self, model, x, y, offset=0, weights=None, teach=True):
        """(loss, what to log), as train.Stage.loss. weights: each sequence's --no_sft
        weight; teach: soft targets where there is a teacher (validation scores the data's
        tokens)."""
        clean_y = self.clean_targets(y)
        teach = teach and self.teacher is not None
        if self.name != "mars":
            soft = self.teacher.targets(x, y, clean_y, noisy=False) if teach else None
            ce, where = per_token_ce(model, x, clean_y, soft=soft), clean_y != -1
            n = where.sum(1).clamp_min(1)
            loss = (ce.sum(1) / n).mean() if self.name == "control" else ce[where].mean()
            return loss, {"loss": loss}
        ids, pos, targets, attn_mask = mars_input(x, y, self.tok.mask, self.cfg.B, offset)
        T = x.shape[1]
        targets = torch.cat([targets[:, :-T], clean_y], dim=1)
        soft = self.teacher.targets(x, y, clean_y) if teach else None
        ce = per_token_ce(model, ids, targets, pos, attn_mask, soft)
        n, n_clean = ((t != -1).sum(1).clamp_min(1) for t in (y, clean_y))
        noisy, clean = ce[:, :-T].sum(1) / n, ce[:, -T:].sum(1) / n_clean
        weight = 1.0 if weights is None else weights
        loss = (weight * noisy + self.cfg.ar_weight * clean).mean()
        return loss, {"loss": loss, "noisy": noisy.mean(), "clean": clean.mean()}


# ---------------------------------------------------------------------------
# The stage

def teacher_source(cfg):
    """Where a resumed stage 2 started: its --init_from, or the stage 1 of its run."""
    if cfg.init_from and cfg.stage != "all":
        return cfg.init_from
    return os.path.join(cfg.out_dir, "ar.pt")


class Stage(train.Stage):
    """train.Stage under the options. Each step draws the block offset and the --no_sft
    weights of the global batch from self.rng (seeded by the batch order: a resumed run
    draws them again); validation draws its offsets from its fixed seed, with no weights
    and the data's tokens as targets."""

    def __init__(self, name, model, tok, splits, cfg, rank=0, world=1, state=None):
        teacher = None
        if cfg.targets == "soft" and name != "ar":  # the model as it is before this stage
            start = foreign.load(teacher_source(cfg), cfg.device)[1] if state else model
            teacher = Teacher(start, tok)
        if cfg.from_hf or teacher:  # a real vocabulary in chunks, soft targets (chunked_ce)
            chunked(model)
        super().__init__(name, model, tok, splits, cfg, rank, world, state)
        self.options = Options(name, cfg, tok, teacher)
        self.paper = name == "ar" or all(getattr(cfg, k) == v for k, v in PAPER.items())
        self.offset, self.weights, self.rows, self.validating = 0, None, None, False

    def next_batch(self):
        seqs = super().next_batch()
        if self.cfg.block_offset == "random":
            self.offset = int(torch.randint(self.cfg.B, (1,), generator=self.rng))
        if self.cfg.no_sft:
            self.weights = no_sft_weights(len(seqs), self.rng, self.cfg.device)
        return seqs

    def micro_batches(self, seqs):
        for a, xy in enumerate(super().micro_batches(seqs)):
            self.rows = self.share(a)  # this micro-batch's rows: their weights
            yield xy

    def loss(self, model, x, y):
        if self.paper:
            return super().loss(model, x, y)
        if not self.validating:
            weights = None if self.weights is None else self.weights[self.rows]
            return self.options.loss(model, x, y, self.offset, weights)
        offset = 0
        if self.cfg.block_offset == "random":
            offset = int(torch.randint(self.cfg.B, (1,), generator=self.rng))
        if self.cfg.no_sft:  # drawn and unused: validation's draws stay those of its recorded losses
            no_sft_weights(1, self.rng)
        return self.options.loss(model, x, y, offset, teach=False)

    def val_losses(self):
        self.validating = True
        try:
            return super().val_losses()
        finally:
            self.validating = False

    def settings(self):
        return stage2_flags(self.cfg) if self.name == "mars" else super().settings()

    def checkpoint(self, step, done):
        """train.Stage's, and where a real model's run started ("hf")."""
        ckpt = super().checkpoint(step, done)
        if self.cfg.hf is not None:
            ckpt["hf"] = self.cfg.hf
        return ckpt
