"""A GPT in one file: the transformer of Qwen2 and Llama (RMSNorm, SwiGLU MLP, rotary positions,
grouped-query attention) and a static KV cache; one class for our presets and real checkpoints
(extras/checkpoints/hf.py maps the Hugging Face names onto it). MARS needs two things a plain GPT hides, here
ordinary arguments: position ids (the noisy and clean streams share positions 0..T-1) and any boolean
attention mask (the [noisy | clean] mask). Positions enter only through the rotary embedding, so
attention sees relative distances, never absolute places.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass
class GPTConfig:
    vocab_size: int = 1024  # token embeddings (a real checkpoint may have more than its tokenizer has tokens)
    max_seq_len: int = 128  # the context length (never called block_size here: that is MARS's B)
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256
    n_kv_head: int = 0  # grouped-query attention: key/value heads (0 = n_head)
    head_dim: int = 0  # 0 = n_embd // n_head
    intermediate_size: int = 0  # SwiGLU width (0 = 8/3 n_embd, rounded up to a multiple of 64)
    rope_base: float = 10000.0
    norm_eps: float = 1e-6
    qkv_bias: bool = False  # Qwen2 has biases on q, k and v (never on the output projection)
    tie_embeddings: bool = True  # the output head reuses the token embedding

    def __post_init__(self):
        self.n_kv_head = self.n_kv_head or self.n_head
        self.head_dim = self.head_dim or self.n_embd // self.n_head
        self.intermediate_size = self.intermediate_size or 64 * math.ceil(8 * self.n_embd / 3 / 64)
        if self.n_head % self.n_kv_head or self.head_dim % 2:
            raise ValueError("n_head must be a multiple of n_kv_head, and head_dim even (rotary rotates pairs)")


class KVCache:
    """Preallocated keys and values (key/value heads only) for every layer, with a length per batch row.
    A forward appends at slots lengths[b]..; the caller keeps what it wants with `rollback` (MARS drops
    its <|mask|> tokens' entries after every step). Slots beyond a row's length are stale and never attended."""

    def __init__(self, config, batch_size, max_len, dtype, device):
        shape = (config.n_layer, batch_size, config.n_kv_head, max_len, config.head_dim)
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

    def write_plan(self, positions):
        """Where a forward of t new tokens (positions: (t,) or (b, t)) writes, which keys it reads, and its attention
        mask: query i of row b sits at slot lengths[b] + i and may attend every slot up to its own (causal over the
        cache)."""
        t, device = positions.shape[-1], positions.device
        lo, hi = min(self.lengths), max(self.lengths)
        if hi + t > self.max_len:
            raise ValueError(f"KV cache overflow: {hi + t} > {self.max_len} slots")
        n_keys = hi + t
        if lo == hi:  # every row at the same length: a plain slice
            where = slice(lo, lo + t)
            visible = None if t == 1 else torch.ones(t, n_keys, dtype=torch.bool, device=device).tril(lo)
            return where, n_keys, visible
        cached = torch.tensor(self.lengths, device=device)[:, None]
        slots = cached + torch.arange(t, device=device)  # (b, t)
        rows = torch.arange(len(self.lengths), device=device)[:, None]
        visible = torch.arange(n_keys, device=device)[None, None, :] <= slots[:, :, None]  # (b, t, n_keys)
        return (rows, slots), n_keys, visible[:, None]

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

    def advance(self, t):
        """After a forward of t tokens: every row holds them."""
        self.lengths = [n + t for n in self.lengths]


class StaticKVCache(KVCache):
    """A KV cache of fixed shapes, for CUDA graphs (engine.CudaGraphs): batch_size rows allocated once, the running
    rows first (keep_rows moves them up in place: a captured graph holds these tensors), and position p's keys and
    values in slot p, so that a forward's writes and its mask follow from its positions on the device alone. Every
    query attends the first `keys` slots (the caller sets it above every position it feeds), those past its own
    masked. `lengths` is the caller's bookkeeping only."""

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

    def write_plan(self, positions):  # positions (b, t): the rows are the first b
        visible = torch.arange(self.keys, device=positions.device) <= positions[..., None]  # (b, t, keys)
        return positions, self.keys, visible[:, None]

    def update(self, layer, k, v, slots, n_keys):
        b, index = k.shape[0], slots[:, None, :, None].expand_as(k)
        self.k[layer, :b].scatter_(2, index, k)
        self.v[layer, :b].scatter_(2, index, v)
        return self.k[layer, :b, :, :n_keys], self.v[layer, :b, :, :n_keys]

    def advance(self, t):
        pass  # its forwards read positions, not lengths (and a graph's replay runs no Python)


def check_room(prompt, max_seq):
    """A prompt must leave its answer room in a context of max_seq tokens: else a ValueError (the command line's
    one-line error), for sample.py's loop and the engine alike."""
    if len(prompt) >= max_seq:
        raise ValueError(f"prompt of {len(prompt)} tokens does not fit the model's context of {max_seq}")


def rotary(positions, head_dim, base, dtype):
    """cos and sin (b or 1, 1, t, head_dim/2) of the angles position * base^(-2i/d).

    Computed in float32 as Hugging Face does (in float64 when the model is: tests check exact identities)."""
    dtype = torch.float64 if dtype == torch.float64 else torch.float32
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=dtype) / head_dim)
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


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):  # normalise in float32, cast back, then scale (as Qwen2 and Llama do)
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

    def forward(self, x, rope, attn_mask, cache, index, plan):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, t, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, t, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)  # keys are cached rotated
        if cache is not None:
            k, v = cache.update(index, k, v, *plan)
        # grouped-query attention: query head h reads key/value head h // (n_head / n_kv_head)
        gqa = self.n_kv_head != self.n_head
        if attn_mask is None and cache is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=gqa)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

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

    def forward(self, x, rope, attn_mask, cache, index, plan):
        x = x + self.attn(self.norm1(x), rope, attn_mask, cache, index, plan)
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
        for name, p in self.named_parameters():  # GPT-2's init; residual projections scaled by depth
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() == 2:
                std = 0.02 / math.sqrt(2 * config.n_layer) if name.endswith(("o.weight", "down.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def new_cache(self, batch_size, max_len=None):
        p = self.wte.weight
        return KVCache(self.config, batch_size, max_len or self.config.max_seq_len, p.dtype, p.device)

    def forward(self, idx, positions=None, attn_mask=None, cache=None, logits_at=None, targets=None):
        """Logits for token ids idx (b, t).
        positions: (t,) or (b, t); default 0..t-1, or each row's cache length onwards (only differences matter).
        attn_mask: bool (t, t) or (b, t, t), True = may attend; default causal; never with a cache.
        cache: a KVCache (or a StaticKVCache, positions (b, t) given); this forward appends its keys and values.
        logits_at: bool (b, t): return logits (n, vocab) only where True, in the order of idx[logits_at]
            (a loss needs few: computing them all would cost a large vocabulary's memory); or long (b, r):
            the logits (b, r, vocab) of these columns of each row.
        targets: with a bool logits_at, the loss's targets there, ids (n,) or distributions (n, vocab): return the
            cross-entropy (n,) instead of the logits (cross_entropy)."""
        b, t = idx.shape
        if positions is None:
            start = [0] if cache is None else cache.lengths
            if max(start) + t > self.config.max_seq_len:
                raise ValueError(f"sequence longer than the model's context ({self.config.max_seq_len})")
            positions = torch.arange(t, device=idx.device)
            if cache is not None:  # each row's cache length onwards
                positions = torch.tensor(start, device=idx.device)[:, None] + positions
        plan = None
        if cache is not None:
            assert attn_mask is None, "a cached forward is causal over the cache"
            where, n_keys, attn_mask = cache.write_plan(positions)
            plan = (where, n_keys)
        if attn_mask is not None and attn_mask.dim() == 3 and cache is None:
            attn_mask = attn_mask[:, None]  # broadcast over heads
        x = self.wte(idx)
        rope = rotary(positions, self.config.head_dim, self.config.rope_base, x.dtype)
        for index, layer in enumerate(self.layers):
            x = layer(x, rope, attn_mask, cache, index, plan)
        if cache is not None:
            cache.advance(t)
        x = self.norm_f(x)
        if logits_at is not None and logits_at.dtype == torch.bool:
            x = x[logits_at]
        elif logits_at is not None:  # columns: fixed shapes, no host sync (a CUDA graph captures it)
            x = x.gather(1, logits_at[..., None].expand(-1, -1, x.shape[-1]))
        return self.lm_head(x) if targets is None else cross_entropy(self.lm_head, x, targets)


CE_CHUNK = 2**25  # logit elements the loss holds at once (128 MiB in float32)


def cross_entropy(head, x, targets):
    """Cross-entropy (n,) of the logits head(x), in float32, against targets (ids or distributions). Past CE_CHUNK
    elements (a real vocabulary on many rows) it takes the rows a chunk at a time and recomputes each chunk's logits
    in the backward (checkpoint), so that one chunk's logits exist rather than all of them; below, it is one call."""
    rows = max(1, CE_CHUNK // head.out_features)

    def ce(h, t):
        return F.cross_entropy(head(h).float(), t, reduction="none")
    if len(x) <= rows:
        return ce(x, targets)
    return torch.cat([checkpoint(ce, h, t, use_reentrant=False) for h, t in zip(x.split(rows), targets.split(rows))])
