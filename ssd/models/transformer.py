"""One decoder backbone for Qwen2 and LLaMA, driven by `inputs_embeds`, with a static KV cache.

Hand-written rather than HF `Qwen2Model` because (docs/cpu-physics.md) HF + DynamicCache costs
~6-9 ms extra per decode step on the 2-core CPU, and per-row rollback inside a batch is awkward
there. Here the cache is a preallocated buffer with a per-row `lengths` vector (`ssd.models.kv_cache`):
rollback is `lengths -= n`, and rows of one batch may sit at different lengths.

Parameter names equal HF's (`layers.{i}.self_attn.q_proj.weight`, `norm.weight`, ...), so a
`Qwen2Model` / `LlamaModel` state dict loads with `strict=True`.

Batch-invariant numerics (docs/algorithms.md §4.1): a CPU BLAS picks its kernel by the shape of the whole
call (a 1-row product and the rows of a 5-row one round differently), and masked attention over padded keys
takes another path than attention over a row's own keys; so a row decoded inside a batch would not be bit for
bit the row decoded alone. A model switched to batch-invariant numerics (`use_batch_invariant(model)`)
computes every sequence of a batch as its own product and attends over exactly its own keys, which is what
batch 1 computes. It is a property of the model (its `Linear` and `Backbone` modules), set explicitly.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ssd.models.backbone_config import BackboneConfig, rope_inverse_frequencies
from ssd.models.kv_cache import KVCache

STATIC_MIN_CAPACITY = (
    256  # smallest static cache: prompts + generations of a few hundred tokens share one shape
)


def use_batch_invariant(model: nn.Module, enabled: bool = True) -> nn.Module:
    """Switch every `Linear` and `Backbone` of `model` to (or from) batch-invariant numerics; returns it."""
    for module in model.modules():
        if isinstance(module, Linear | Backbone):
            module.batch_invariant = enabled
    return model


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, per_row: bool = False
           ) -> torch.Tensor:  # fmt: skip
    """F.linear; with `per_row` each sequence of the batch (x[b:b+1], x's leading dim) is its own F.linear
    call, the very call that sequence makes decoded alone, so its result is bit-for-bit batch 1's whichever
    kernels the BLAS picks (tests/test_batch_invariance.py). Batch 1 itself runs the plain product: a latency
    timed at batch 1 is what a deployment computes. (A batched matmul over rows with the weight broadcast is
    faster, but its rows matched the 1-row products on two AMD EPYCs, AVX2 and AVX-512, and not on an Intel
    Xeon.)"""
    if not per_row or x.dim() < 2 or x.shape[0] <= 1:
        return F.linear(x, weight, bias)
    return torch.cat([F.linear(sequence, weight, bias) for sequence in x.split(1)])


class Linear(nn.Linear):
    """nn.Linear (same parameters and state-dict names) computed by `linear`."""

    batch_invariant = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.batch_invariant)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 and scale in the input dtype, as HF does (matters for bf16/fp16).
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: BackboneConfig) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        self.q_proj = Linear(h, config.num_heads * d, bias=config.qkv_bias)
        self.k_proj = Linear(h, config.num_kv_heads * d, bias=config.qkv_bias)
        self.v_proj = Linear(h, config.num_kv_heads * d, bias=config.qkv_bias)
        self.o_proj = Linear(config.num_heads * d, h, bias=config.o_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Any) -> torch.Tensor:
        """x [B, T, H]; cos/sin [B or 1, 1, T, D]; attend(q [B, h, T, D], k, v [B, n_kv, T, D]) -> [B, h, T, D]:
        the cache path's attention (it stores k, v and attends over what it holds), or `sdpa` with a mask."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        out = attend(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Scaled dot-product attention; mask [B or 1, 1, T, S]: bool (True = attend) or additive (`additive`),
    None = every key (one query) or causal (T queries over T keys)."""
    gqa = q.shape[1] != k.shape[1]
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask (True = attend) as the additive one (0 / -inf) sdpa would otherwise make of it again in every
    layer: a stack makes it once per call."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, float("-inf")
    )


def block_mask(start: torch.Tensor | int, k: int, span: int, device: Any, dtype: torch.dtype) -> torch.Tensor:
    """[B or 1, 1, k, span], additive: query j of a block written at position start (+ j) sees keys 0..start + j."""
    positions = torch.as_tensor(start, device=device).reshape(-1, 1) + torch.arange(k, device=device)
    return additive((torch.arange(span, device=device) <= positions[..., None])[:, None], dtype)


class MLP(nn.Module):
    def __init__(self, config: BackboneConfig) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = Linear(h, i, bias=config.mlp_bias)
        self.up_proj = Linear(h, i, bias=config.mlp_bias)
        self.down_proj = Linear(i, h, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: BackboneConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, attend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attend)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """Qwen2 / LLaMA decoder stack: embed_tokens, layers, final norm (no LM head)."""

    batch_invariant = False  # each sequence attends over exactly its own keys (use_batch_invariant)

    def __init__(self, config: BackboneConfig) -> None:
        super().__init__()
        self.config = config
        # vocab_size 0: a stack fed with embeddings only (the feature and block drafters embed with the target's table)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size) if config.vocab_size else None
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.init_rope()
        # The switch between the two cache paths (docs/gpu.md): False = eager (attend over the used
        # prefix; cheaper on CPU), True = static (full-capacity attention with a length mask, no host
        # sync, capturable by CUDA graphs). It decides what new_cache makes; each cache keeps its path.
        self.static_step = False
        self._static_buffers: dict[tuple, tuple[list[torch.Tensor], list[torch.Tensor], int]] = {}

    def init_rope(self, device: Any = None) -> None:
        """(Re)compute the RoPE frequencies: a non-persistent buffer, so a model built on the meta
        device and filled by load_state_dict(assign=True) must call this with its real device."""
        inv_freq, self.attention_scaling = rope_inverse_frequencies(self.config)
        self.register_buffer(
            "inv_freq", inv_freq.to(device) if device is not None else inv_freq, persistent=False
        )

    def reset_parameters(self, generator: torch.Generator | None = None, std: float = 0.02) -> None:
        """HF-style init: normal(0, std) weights, zero biases, unit norms."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, 0.0, std, generator=generator)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, 0.0, std, generator=generator)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, 1, T, D] for integer positions [B, T] (computed in float32, as HF does)."""
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)

    def forward(self, inputs_embeds: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Full-sequence forward without cache (training). inputs_embeds [B, T, H] right-padded;
        lengths [B] (None = all T valid). Returns final-normed hidden states [B, T, H]; outputs at
        padded positions are meaningless."""
        return self.forward_features(inputs_embeds, lengths)[0]

    def forward_features(
        self, inputs_embeds: torch.Tensor, lengths: torch.Tensor | None = None, taps: tuple[int, ...] = ()
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward`, plus the hidden states after `taps` layers [B, T, len(taps), H] (None without taps)."""
        taps, t = self.check_taps(taps), inputs_embeds.shape[1]
        positions = torch.arange(t, device=inputs_embeds.device)[None]
        cos, sin = self._rope(positions, inputs_embeds.dtype)
        mask = None
        if lengths is not None:
            keys = torch.arange(t, device=inputs_embeds.device)
            causal = keys[None, :] <= keys[:, None]  # [T, T]
            allowed = causal[None] & (keys[None, None, :] < lengths.to(keys.device)[:, None, None])
            mask = additive(allowed[:, None], inputs_embeds.dtype)
        return self._stack(inputs_embeds, cos, sin, lambda layer: lambda q, k, v: sdpa(q, k, v, mask), taps)

    def check_taps(self, taps) -> tuple[int, ...]:
        """Taps as layer counts 0..num_layers (negative ones count from the top: -1 = the last layer's output)."""
        n = len(self.layers)
        if any(not -n - 1 <= int(t) <= n for t in taps):
            raise ValueError(f"taps {list(taps)}: hidden states exist after 0..{n} layers (or -1..-{n + 1})")
        return tuple(int(t) % (n + 1) for t in taps)

    def new_cache(
        self, batch_size: int, capacity: int, dtype: torch.dtype | None = None, device: Any = None, taps=()
    ) -> KVCache:
        """An empty cache for `capacity` positions per row. On the static path (`static_step`) the
        capacity is rounded up to a power of two (at least STATIC_MIN_CAPACITY) and the buffers of one
        shape are reused by every later cache of that shape, so a compiled step sees few distinct
        shapes and the same addresses (CUDA graphs replay instead of re-recording); a cache is then
        valid only until the next new_cache of its shape on this backbone."""
        c = self.config
        weight = self.norm.weight
        dtype = dtype or weight.dtype
        device = torch.device(device or weight.device)
        zeros = torch.zeros(batch_size, dtype=torch.long, device=device)

        def allocate(capacity: int) -> list[torch.Tensor]:
            shape = (batch_size, c.num_kv_heads, capacity, c.head_dim)
            return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(c.num_layers)]

        if not self.static_step:
            return KVCache(k=allocate(capacity), v=allocate(capacity), lengths=zeros, prompt_lengths=zeros.clone(),
                           taps=self.check_taps(taps))  # fmt: skip
        capacity = max(STATIC_MIN_CAPACITY, 1 << (max(capacity, 1) - 1).bit_length())
        key = (batch_size, capacity, dtype, device)
        if key in self._static_buffers:
            k, v, generation = self._static_buffers[key]
            for t in (*k, *v):  # stale keys are masked out, but a non-finite stale value would poison 0 * v
                t.zero_()
            generation += 1
        else:
            k, v, generation = allocate(capacity), allocate(capacity), 0
            for t in (*k, *v):  # the step mutates these in place; static addresses let CUDA graphs do so
                torch._dynamo.mark_static_address(t)
        self._static_buffers[key] = (k, v, generation)
        return KVCache(k=k, v=v, lengths=zeros, prompt_lengths=zeros.clone(), static=True, generation=generation,
                       taps=self.check_taps(taps))  # fmt: skip

    def forward_cached(
        self, inputs_embeds: torch.Tensor, cache: KVCache, num_new: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Append a block [B, k, H] at each row's own positions lengths[b] + j, then advance lengths by
        num_new [B] (default k: a right-padded block whose rows have fewer valid entries passes their
        counts). Returns final-normed hidden states [B, k, H].

        An eager cache attends over the slice [: max(lengths) + k] (one host sync per step) and grows
        when needed; a static cache (see `static_forward`) attends over its full capacity."""
        k = inputs_embeds.shape[1]
        if cache.static:
            self.check_static_cache(cache, k)
            hidden, features = self.static_forward(inputs_embeds, cache.k, cache.v, cache.lengths, cache.taps)
        else:
            hidden, features = self._eager_forward(inputs_embeds, cache, num_new)
        cache.keep_features(features, k if num_new is None else num_new)
        cache.advance(k if num_new is None else num_new)
        return hidden

    def check_static_cache(self, cache: KVCache, k: int) -> None:
        """A static step's preconditions, without a host sync: the cache is the current one of its
        buffers, and k more positions fit (on CUDA a device-side assert, surfacing at the next sync)."""
        first = cache.k[0]
        key = (first.shape[0], first.shape[2], first.dtype, first.device)
        current = self._static_buffers.get(key)
        if current is None or current[0] is not cache.k or current[2] != cache.generation:
            raise RuntimeError(
                "this static KV cache was superseded: a later prefill on the same model reused its buffers "
                "(the static path keeps one buffer per shape; finish one batch before prefilling the next)"
            )
        torch._assert_async(
            (cache.lengths + k <= cache.capacity).all(),
            f"static KV cache overflow: a row needs more than its capacity of {cache.capacity} positions; "
            "reserve more room at prefill (max_new_tokens)",
        )

    def static_forward(
        self,
        inputs_embeds: torch.Tensor,
        k_cache: list[torch.Tensor],
        v_cache: list[torch.Tensor],
        lengths: torch.Tensor,
        taps: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The static step: no Python-int slicing and no host sync, fixed shapes for a given block
        length (so torch.compile with CUDA graphs can capture it). Row b's block goes to positions
        lengths[b] + j by indexed assignment (in place under inductor); attention runs over the whole
        capacity with a mask built from lengths. The caller advances lengths (stale entries past them
        stay masked). Returns (final-normed hidden states, features at `taps` or None)."""
        b, k, _ = inputs_embeds.shape
        device = inputs_embeds.device
        positions = lengths[:, None] + torch.arange(k, device=device)  # [B, k]
        mask = block_mask(lengths, k, k_cache[0].shape[2], device, inputs_embeds.dtype)  # [B, 1, k, C]
        rows = torch.arange(b, device=device)[:, None]

        def attend_at(layer: int):
            def attend(q, key, value):
                # key [B, n_kv, k, D] -> indexed target [B, k, n_kv, D]
                k_cache[layer][rows, :, positions] = key.transpose(1, 2)
                v_cache[layer][rows, :, positions] = value.transpose(1, 2)
                return sdpa(q, k_cache[layer], v_cache[layer], mask)

            return attend

        return self._layers(inputs_embeds, positions, attend_at, taps)

    def _eager_forward(
        self, inputs_embeds: torch.Tensor, cache: KVCache, num_new: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.batch_invariant and num_new is not None:
            return self._forward_rows(inputs_embeds, cache, num_new)
        b, k, _ = inputs_embeds.shape
        starts = cache.host_lengths()  # the cache is sliced by Python ints (a host sync only if untracked)
        lo, hi = min(starts), max(starts)
        span = hi + k
        cache.ensure_capacity(span)
        device = inputs_embeds.device
        steps = torch.arange(k, device=device)
        if lo == hi:  # all rows aligned (always so at batch size 1): plain slice writes
            positions = (steps + lo)[None]  # [1, k]

            def write(layer, key, value):
                cache.k[layer][:, :, lo:span] = key
                cache.v[layer][:, :, lo:span] = value
        else:
            positions = cache.lengths[:, None] + steps  # [B, k]
            rows = torch.arange(b, device=device)[:, None]

            def write(layer, key, value):
                # key [B, n_kv, k, D] -> indexed target [B, k, n_kv, D]
                cache.k[layer][rows, :, positions] = key.transpose(1, 2)
                cache.v[layer][rows, :, positions] = value.transpose(1, 2)

        if self.batch_invariant and b > 1:  # row r attends over its own start_r + k keys, with batch 1's mask
            row_mask = [
                None if k == 1 else block_mask(start, k, start + k, device, inputs_embeds.dtype)
                for start in starts
            ]

            def attend_at(layer: int):
                def attend(q, key, value):
                    write(layer, key, value)
                    keys, values = cache.k[layer], cache.v[layer]
                    return torch.cat([
                        sdpa(q[r : r + 1], keys[r : r + 1, :, : start + k], values[r : r + 1, :, : start + k],
                             row_mask[r])
                        for r, start in enumerate(starts)
                    ])  # fmt: skip

                return attend
        else:  # one attention over the batch: aligned rows slice, ragged ones mask [B, 1, k, S]
            mask = (
                None
                if lo == hi and k == 1
                else block_mask(lo if lo == hi else cache.lengths, k, span, device, inputs_embeds.dtype)
            )

            def attend_at(layer: int):
                def attend(q, key, value):
                    write(layer, key, value)
                    return sdpa(q, cache.k[layer][:, :, :span], cache.v[layer][:, :, :span], mask)

                return attend

        return self._layers(inputs_embeds, positions, attend_at, cache.taps)

    def _forward_rows(
        self, inputs_embeds: torch.Tensor, cache: KVCache, num_new: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A right-padded block (prefill) in batch-invariant mode: each row's own n_r positions go through
        the stack alone (a batch of one runs the plain kernels), i.e. exactly batch 1's prefill. Writes into
        the cache's rows; the outputs past a row's n_r positions are zeros."""
        b, k, _ = inputs_embeds.shape
        counts = num_new.tolist()
        cache.ensure_capacity(int(cache.lengths.max()) + k)  # before taking row views of the buffers
        hidden = inputs_embeds.new_zeros(inputs_embeds.shape)
        features = (
            inputs_embeds.new_zeros(b, k, len(cache.taps), inputs_embeds.shape[2]) if cache.taps else None
        )
        for r, n in enumerate(counts):
            if n == 0:
                continue
            row = KVCache(k=[t[r : r + 1] for t in cache.k], v=[t[r : r + 1] for t in cache.v], taps=cache.taps,
                          lengths=cache.lengths[r : r + 1], prompt_lengths=cache.prompt_lengths[r : r + 1])  # fmt: skip
            hidden_r, features_r = self._eager_forward(inputs_embeds[r : r + 1, :n], row, None)
            hidden[r : r + 1, :n] = hidden_r
            if features is not None:
                features[r : r + 1, :n] = features_r
        return hidden, features

    def _layers(
        self, inputs_embeds, positions, attend_at, taps=()
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decoder stack over a cached block: the part both cache paths share."""
        cos, sin = self._rope(positions, inputs_embeds.dtype)
        return self._stack(inputs_embeds, cos, sin, attend_at, taps)

    def _stack(self, x, cos, sin, attend_at, taps) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(final-normed output, the residual stream after `taps` layers [B, T, len(taps), H] or None)."""
        kept = {0: x} if 0 in taps else {}
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, attend_at(i))
            if i + 1 in taps:
                kept[i + 1] = x
        return self.norm(x), torch.stack([kept[t] for t in taps], 2) if taps else None
