"""The architecture numbers of a Qwen2 / LLaMA decoder and its RoPE frequencies (transformers' variants)."""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Any

import torch

SUPPORTED_MODEL_TYPES = ("qwen2", "llama")


@dataclass(frozen=True)
class BackboneConfig:
    """The architecture numbers of a Qwen2 / LLaMA decoder (read from an HF config.json)."""

    model_type: str  # "qwen2" or "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    rope_parameters: dict[str, Any] = field(
        default_factory=lambda: {"rope_type": "default", "rope_theta": 1e4}
    )
    qkv_bias: bool = True  # Qwen2: always on; LLaMA: config.attention_bias
    o_bias: bool = False  # LLaMA's attention_bias also covers o_proj
    mlp_bias: bool = False
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {self.model_type!r} is not supported; use one of {SUPPORTED_MODEL_TYPES}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads ({self.num_kv_heads})"
            )

    @classmethod
    def from_hf(cls, config: Any) -> BackboneConfig:
        """From a transformers `Qwen2Config` / `LlamaConfig` (or anything with the same attributes)."""
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"config model_type {model_type!r} is not supported; use one of {SUPPORTED_MODEL_TYPES}"
            )
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only 'silu', as Qwen2 and LLaMA use)")
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        attention_bias = bool(getattr(config, "attention_bias", False))
        # transformers 5 holds RoPE in rope_parameters; 4.x in rope_theta + rope_scaling ({"type": ...} in old files)
        rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
        rope.setdefault("rope_type", rope.pop("type", "default"))
        rope.setdefault("rope_theta", getattr(config, "rope_theta", 1e4))
        return cls(
            model_type=model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            max_position_embeddings=config.max_position_embeddings,
            rope_parameters=rope,
            qkv_bias=True if model_type == "qwen2" else attention_bias,
            o_bias=False if model_type == "qwen2" else attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        )

    def to_hf(self) -> Any:
        """The equivalent transformers config (used for RoPE variants and for comparisons with HF)."""
        from transformers import LlamaConfig, Qwen2Config

        common = dict(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
        )
        if "rope_parameters" in inspect.signature(Qwen2Config.__init__).parameters:  # transformers 5
            common["rope_parameters"] = dict(self.rope_parameters)
        else:  # transformers 4.x: rope_theta, and rope_scaling for every variant but the default
            scaling = {k: v for k, v in self.rope_parameters.items() if k != "rope_theta"}
            common["rope_theta"] = self.rope_parameters["rope_theta"]
            common["rope_scaling"] = None if scaling.get("rope_type", "default") == "default" else scaling
        if self.model_type == "qwen2":
            return Qwen2Config(**common)
        return LlamaConfig(**common, attention_bias=self.qkv_bias, mlp_bias=self.mlp_bias)

    def with_layers(self, num_layers: int) -> BackboneConfig:
        return dataclasses.replace(self, num_layers=num_layers)


def rope_inverse_frequencies(config: BackboneConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim/2], attention_scaling), using transformers' RoPE variants (llama3, yarn, ...)."""
    rope_type = config.rope_parameters.get("rope_type", "default")
    if rope_type == "default":
        dim = config.head_dim
        base = float(config.rope_parameters["rope_theta"])
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(
            f"rope_type {rope_type!r} is unknown to transformers ({sorted(ROPE_INIT_FUNCTIONS)})"
        )
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config.to_hf(), None)
    return inv_freq.float(), float(scaling)
