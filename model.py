"""A small GPT in one file: pre-norm decoder, rotary positions, tied weights,
explicit position ids and attention masks, and a static KV cache.

MARS needs two things a plain GPT hides: position ids (the noisy and clean
streams share positions 0..T-1) and an arbitrary boolean attention mask (the
structured [noisy | clean] mask). Both are ordinary arguments here. Positions
enter only through the rotary embedding of queries and keys (as in the paper's
Qwen2.5 models), so attention sees relative distances, never absolute places.
Nothing in this file knows about MARS or tokenizers.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 1024
    max_seq_len: int = 128  # the context length (never called block_size here: that is MARS's B)
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256
    rope_base: float = 10000.0


class KVCache:
    """Preallocated keys and values for every layer, with a length per batch row.

    The model appends a forward's keys and values at slots lengths[b]..; the
    caller then keeps what it wants with `rollback` (MARS drops the entries of
    its mask tokens after every step). Slots beyond a row's length are stale
    and never attended."""

    def __init__(self, config, batch_size, max_len, dtype, device):
        shape = (config.n_layer, batch_size, config.n_head, max_len, config.n_embd // config.n_head)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = [0] * batch_size  # host-side: bookkeeping never waits for the device
        self.max_len = max_len

    def rollback(self, lengths):
        self.lengths = list(lengths)

    def keep_rows(self, rows):
        """Drop finished rows from the batch."""
        self.k, self.v = self.k[:, rows], self.v[:, rows]
        self.lengths = [self.lengths[i] for i in rows]

    def add_rows(self, n):
        """Append n empty rows (new requests joining a running batch)."""
        empty = self.k.new_zeros(self.k.shape[0], n, *self.k.shape[2:])
        self.k, self.v = torch.cat([self.k, empty], dim=1), torch.cat([self.v, empty], dim=1)
        self.lengths = self.lengths + [0] * n

    def write_plan(self, t, device):
        """Where a forward of t new tokens writes, which keys it reads, and its mask.

        Query i of row b sits at slot lengths[b] + i and may attend every slot up
        to and including its own (causal attention over the cache)."""
        lo, hi = min(self.lengths), max(self.lengths)
        if hi + t > self.max_len:
            raise ValueError(f"KV cache overflow: {hi + t} > {self.max_len} slots")
        n_keys = hi + t
        if lo == hi:  # every row at the same length: a plain slice
            where = slice(lo, lo + t)
            mask = None if t == 1 else torch.ones(t, n_keys, dtype=torch.bool, device=device).tril(lo)
            return where, n_keys, mask
        start = torch.tensor(self.lengths, device=device)[:, None]
        slots = start + torch.arange(t, device=device)  # (b, t)
        rows = torch.arange(len(self.lengths), device=device)[:, None]
        mask = torch.arange(n_keys, device=device)[None, None, :] <= slots[:, :, None]  # (b, t, n_keys)
        return (rows, slots), n_keys, mask[:, None]

    def update(self, layer, k, v, where, n_keys):
        """Write this layer's new keys and values; return all keys and values to attend."""
        if isinstance(where, slice):
            self.k[layer, :, :, where] = k
            self.v[layer, :, :, where] = v
        else:  # ragged rows: advanced indexing puts (b, t) first, then heads
            rows, slots = where
            self.k[layer][rows, :, slots] = k.transpose(1, 2)
            self.v[layer][rows, :, slots] = v.transpose(1, 2)
        return self.k[layer, :, :, :n_keys], self.v[layer, :, :, :n_keys]


def rotary(positions, head_dim, base):
    """cos and sin (b or 1, 1, t, head_dim/2) of the rotation angles position * base^(-2i/d)."""
    dtype = torch.float32 if positions.device.type == "mps" else torch.float64  # exact angles; MPS has no float64
    inv_freq = base ** (-torch.arange(0, head_dim, 2, device=positions.device, dtype=dtype) / head_dim)
    angles = positions.to(dtype)[..., None] * inv_freq
    if angles.dim() == 2:
        angles = angles[None]
    return angles.cos()[:, None], angles.sin()[:, None]


def apply_rotary(x, cos, sin):
    """Rotate pairs (x1[i], x2[i]) of the two halves of each head by the position's angles.
    The dot product of a rotated query at p and a rotated key at p' depends on p - p' only."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=False)

    def forward(self, x, rope, attn_mask, cache, layer, plan):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, c // self.n_head).permute(2, 0, 3, 1, 4)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)  # keys are cached rotated
        if cache is not None:
            k, v = cache.update(layer, k, v, *plan)
        if attn_mask is None and cache is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.n_embd, bias=False)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.n_embd, bias=False)
        self.mlp = nn.Sequential(nn.Linear(config.n_embd, 4 * config.n_embd, bias=False), nn.GELU(),
                                 nn.Linear(4 * config.n_embd, config.n_embd, bias=False))

    def forward(self, x, rope, attn_mask, cache, layer, plan):
        x = x + self.attn(self.ln1(x), rope, attn_mask, cache, layer, plan)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=False)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2: scale the residual projections by depth
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)

    def new_cache(self, batch_size, max_len=None):
        p = self.wte.weight
        return KVCache(self.config, batch_size, max_len or self.config.max_seq_len, p.dtype, p.device)

    def forward(self, idx, positions=None, attn_mask=None, cache=None, logits_at=None):
        """Logits for token ids idx (b, t).

        positions: (t,) or (b, t) position ids; default 0..t-1, or each row's
            cache length onwards when a cache is given. Only differences matter:
            adding a constant to every position leaves the logits unchanged.
        attn_mask: bool (t, t) or (b, t, t), True = may attend; default causal.
            Not combined with a cache (a cached forward is causal over its slots).
        cache: a KVCache; this forward appends its keys and values to it.
        logits_at: bool (b, t); when given, return logits (n, vocab) only where it
            is True (row-major order), since training and sampling need few of them.
        """
        b, t = idx.shape
        plan = None
        if cache is not None:
            assert attn_mask is None, "a cached forward is causal over the cache"
            if positions is None:
                if max(cache.lengths) + t > self.config.max_seq_len:
                    raise ValueError(f"sequence longer than the model's context ({self.config.max_seq_len})")
                positions = torch.tensor(cache.lengths, device=idx.device)[:, None] + torch.arange(t, device=idx.device)
            where, n_keys, attn_mask = cache.write_plan(t, idx.device)
            plan = (where, n_keys)
        elif positions is None:
            if t > self.config.max_seq_len:
                raise ValueError(f"sequence longer than the model's context ({self.config.max_seq_len})")
            positions = torch.arange(t, device=idx.device)
        if attn_mask is not None and attn_mask.dim() == 3 and cache is None:
            attn_mask = attn_mask[:, None]  # broadcast over heads
        rope = rotary(positions, self.config.n_embd // self.config.n_head, self.config.rope_base)
        x = self.wte(idx)
        for layer, block in enumerate(self.blocks):
            x = block(x, rope, attn_mask, cache, layer, plan)
        if cache is not None:
            cache.lengths = [n + t for n in cache.lengths]
        x = self.ln_f(x)
        if logits_at is not None:
            x = x[logits_at]
        return self.lm_head(x)
