"""A GPT in one file (Qwen2's and Llama's transformer) and a plain KV cache. MARS needs two
things a plain GPT hides, here ordinary arguments: position ids (the noisy and clean streams
share positions 0..T-1) and any boolean attention mask (the [noisy | clean] mask).
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 1024  # a real checkpoint's may exceed its tokenizer's ids
    max_seq_len: int = 128  # the context (not block_size: MARS's B is a block)
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256
    n_kv_head: int = 0  # grouped-query attention: key/value heads (0 = n_head)
    head_dim: int = 0  # 0 = n_embd // n_head
    intermediate_size: int = 0  # SwiGLU width (0 = 8/3 n_embd, rounded up to a multiple of 64)
    rope_base: float = 10000.0
    norm_eps: float = 1e-6
    qkv_bias: bool = False  # Qwen2: biases on q, k and v (never on o)
    tie_embeddings: bool = True  # lm_head shares wte's weight

    def __post_init__(self):
        self.n_kv_head = self.n_kv_head or self.n_head
        self.head_dim = self.head_dim or self.n_embd // self.n_head
        self.intermediate_size = self.intermediate_size or 64 * math.ceil(8 * self.n_embd / 3 / 64)
        if self.n_head % self.n_kv_head or self.head_dim % 2:
            raise ValueError("n_head must be a multiple of n_kv_head, and head_dim even "
                             "(rotary rotates pairs)")


def rotary(positions, head_dim, base, dtype):
    """cos and sin (b or 1, 1, t, head_dim/2) of position * base^(-2i/d), in float32 as
    Hugging Face does (float64 for a float64 model)."""
    dtype = torch.float64 if dtype == torch.float64 else torch.float32
    i = torch.arange(0, head_dim, 2, device=positions.device, dtype=dtype)
    inv_freq = 1.0 / base ** (i / head_dim)
    angles = positions.to(dtype)[..., None] * inv_freq
    if angles.dim() == 2:
        angles = angles[None]
    return angles.cos()[:, None], angles.sin()[:, None]


def apply_rotary(x, cos, sin):
    """Rotate each head's pairs (x1[i], x2[i]) by the position's angles: the dot product of a
    query at p and a key at p' then depends on p - p' only."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):  # in float32, cast back, then scale (as Qwen2 and Llama do)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = c.n_head, c.n_kv_head, c.head_dim
        self.q = nn.Linear(c.n_embd, c.n_head * c.head_dim, bias=c.qkv_bias)
        self.k = nn.Linear(c.n_embd, c.n_kv_head * c.head_dim, bias=c.qkv_bias)
        self.v = nn.Linear(c.n_embd, c.n_kv_head * c.head_dim, bias=c.qkv_bias)
        self.o = nn.Linear(c.n_head * c.head_dim, c.n_embd, bias=False)

    def forward(self, x, rope, attn_mask, cache, index):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, t, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, t, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)  # keys are cached rotated
        if cache is not None:
            k, v = cache.update(index, k, v)
        # grouped-query: query head h reads key/value head h // (n_head / n_kv_head)
        gqa, repeat = self.n_kv_head != self.n_head, self.n_head // self.n_kv_head
        causal = attn_mask is None and cache is None  # else a mask, or one query reading all keys
        if attn_mask is not None and gqa:  # the memory-efficient kernel: a mask, not enable_gqa
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
            gqa = False
        y = F.scaled_dot_product_attention(q, k, v, attn_mask, is_causal=causal, enable_gqa=gqa)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate = nn.Linear(c.n_embd, c.intermediate_size, bias=False)
        self.up = nn.Linear(c.n_embd, c.intermediate_size, bias=False)
        self.down = nn.Linear(c.intermediate_size, c.n_embd, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Layer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.norm1 = RMSNorm(config.n_embd, config.norm_eps)
        self.attn = Attention(config)
        self.norm2 = RMSNorm(config.n_embd, config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, rope, attn_mask, cache, index):
        x = x + self.attn(self.norm1(x), rope, attn_mask, cache, index)
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.layers = nn.ModuleList(Layer(config) for _ in range(config.n_layer))
        self.norm_f = RMSNorm(config.n_embd, config.norm_eps)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        for name, p in self.named_parameters():  # GPT-2's init; residual projections by depth
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() == 2:
                residual = name.endswith(("o.weight", "down.weight"))
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * config.n_layer) if residual else 0.02)

    def new_cache(self, batch_size, max_len=None):
        p, max_len = self.wte.weight, max_len or self.config.max_seq_len
        return KVCache(self.config, batch_size, max_len, p.dtype, p.device)

    def hidden(self, idx, positions=None, attn_mask=None, cache=None):
        """Final-normed hidden states (b, t, n_embd) of ids (b, t). positions (t,) or (b, t):
        default 0..t-1, or each row's cache length on. attn_mask: bool (t, t) or (b, t, t), True =
        may attend; default causal. cache: a KVCache to append to (causal over it)."""
        t = idx.shape[1]
        if positions is None:
            start = [0] if cache is None else cache.lengths
            if max(start) + t > self.config.max_seq_len:
                raise ValueError(f"sequence longer than the model's context "
                                 f"({self.config.max_seq_len})")
            positions = torch.arange(t, device=idx.device)
            if cache is not None:
                positions = torch.tensor(start, device=idx.device)[:, None] + positions
        if cache is not None:
            assert attn_mask is None, "a cached forward is causal over the cache"
            attn_mask = cache.append(positions)
        elif attn_mask is not None and attn_mask.dim() == 3:
            attn_mask = attn_mask[:, None]  # broadcast over heads
        x = self.wte(idx)
        rope = rotary(positions, self.config.head_dim, self.config.rope_base, x.dtype)
        for index, layer in enumerate(self.layers):
            x = layer(x, rope, attn_mask, cache, index)
        return self.norm_f(x)

    def forward(self, idx, targets=None, positions=None, attn_mask=None, cache=None):
        """The logits (b, t, vocab); or, given targets (b, t) (-1 = none), the cross-entropy
        (b, t) in float32, 0 where there is none, with logits only where there is a target."""
        x = self.hidden(idx, positions, attn_mask, cache)
        if targets is None:
            return self.lm_head(x)
        where = targets != -1
        ce = torch.zeros(targets.shape, device=targets.device)
        logits = self.lm_head(x[where]).float()
        ce[where] = F.cross_entropy(logits, targets[where], reduction="none")
        return ce


class KVCache:
    """Keys and values of every layer, preallocated, with a length per batch row. A forward
    appends at slots lengths[b]..; `rollback` keeps what the caller wants (MARS drops its
    masks' entries after every step); slots past a row's length are never read."""

    def __init__(self, config, batch_size, max_len, dtype, device):
        shape = (config.n_layer, batch_size, config.n_kv_head, max_len, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = [0] * batch_size  # host-side: bookkeeping never waits for the device
        self.max_len = max_len

    def rollback(self, lengths):
        self.lengths = list(lengths)

    def keep_rows(self, rows):
        self.k, self.v = self.k[:, rows], self.v[:, rows]
        self.lengths = [self.lengths[i] for i in rows]

    def append(self, positions):
        """A forward of t tokens (positions (t,) or (b, t)) begins: note where its keys go and
        return its mask (None: all keys); query i of row b, at slot lengths[b] + i, attends the
        slots up to its own."""
        t, device = positions.shape[-1], positions.device
        lo, hi = min(self.lengths), max(self.lengths)
        if hi + t > self.max_len:
            raise ValueError(f"KV cache overflow: {hi + t} > {self.max_len} slots")
        self.n_keys = hi + t
        if lo == hi:  # every row at the same length: a plain slice
            self.where = slice(lo, lo + t)
            visible = torch.ones(t, hi + t, dtype=torch.bool, device=device).tril(lo)
            visible = None if t == 1 else visible
        else:
            first = torch.tensor(self.lengths, device=device)[:, None]
            slots = first + torch.arange(t, device=device)  # (b, t)
            self.where = (torch.arange(len(self.lengths), device=device)[:, None], slots)
            visible = (torch.arange(hi + t, device=device) <= slots[..., None])[:, None]
        self.lengths = [n + t for n in self.lengths]
        return visible

    def update(self, layer, k, v):
        """Write this layer's new keys and values; return all those to attend."""
        if isinstance(self.where, slice):
            self.k[layer, :, :, self.where] = k
            self.v[layer, :, :, self.where] = v
        else:  # ragged rows: advanced indexing puts (b, t) first, then heads
            rows, slots = self.where
            self.k[layer][rows, :, slots] = k.transpose(1, 2)
            self.v[layer][rows, :, slots] = v.transpose(1, 2)
        return self.k[layer, :, :, :self.n_keys], self.v[layer, :, :, :self.n_keys]
