"""The static KV cache that CUDA graphs replay over (engine.CudaGraphs), gpt-fast's recipe: shapes fixed once,
writes and the mask computed on the device from the positions alone."""
import torch

from model import KVCache


class StaticKVCache(KVCache):
    """A KV cache of fixed shapes: batch_size rows allocated once, the running rows first (keep_rows moves them up
    in place: a captured graph holds these tensors), and position p's keys and values in slot p, so that a
    forward's writes and its mask follow from its positions on the device alone. Every query attends the first
    `keys` slots (the caller sets it above every position it feeds), those past its own masked. `lengths` is the
    caller's bookkeeping only."""

    def __init__(self, config, batch_size, max_len, dtype, device):
        super().__init__(config, batch_size, max_len, dtype, device)
        self.lengths, self.keys = [], max_len  # no row runs yet

    def keep_rows(self, rows):
        moved = [(i, j) for i, j in enumerate(rows) if i != j]
        if moved:
            to, source = (list(x) for x in zip(*moved))
            self.k[:, to], self.v[:, to] = self.k[:, source], self.v[:, source]
        self.lengths = [self.lengths[i] for i in rows]

    def add_rows(self, n):
        if len(self.lengths) + n > self.k.shape[1]:
            raise ValueError(f"static KV cache full: {len(self.lengths) + n} > {self.k.shape[1]} rows")
        self.lengths = self.lengths + [0] * n

    def append(self, positions):  # positions (b, t): the rows are the first b; lengths are left alone
        self.where = positions
        visible = torch.arange(self.keys, device=positions.device) <= positions[..., None]  # (b, t, keys)
        return visible[:, None]

    def update(self, layer, k, v):
        b, index = k.shape[0], self.where[:, None, :, None].expand_as(k)
        self.k[layer, :b].scatter_(2, index, k)
        self.v[layer, :b].scatter_(2, index, v)
        return self.k[layer, :b, :, :self.keys], self.v[layer, :b, :, :self.keys]
