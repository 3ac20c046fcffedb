"""Random-weight model directories in the exact distributed formats (tests, the toy world)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ssd.files import write_tree
from ssd.models.backbone_config import BackboneConfig
from ssd.models.cosyvoice2 import CosyVoice2LM
from ssd.models.text_tokenizer import add_special_tokens, load_text_tokenizer


def _as_tokenizer(tokenizer: Any, extra_special_tokens=()) -> Any:
    if isinstance(tokenizer, (str, Path)):
        return load_text_tokenizer(tokenizer, extra_special_tokens=extra_special_tokens)
    missing = [t for t in extra_special_tokens if t not in tokenizer.get_vocab()]
    if missing:
        add_special_tokens(tokenizer, missing)
    return tokenizer


def _backbone_config(config_kwargs: dict[str, Any], min_vocab: int, model_type: str) -> BackboneConfig:
    from transformers import LlamaConfig, Qwen2Config

    kwargs = dict(config_kwargs)
    kwargs.setdefault("vocab_size", min_vocab)
    if kwargs["vocab_size"] < min_vocab:
        raise ValueError(
            f"vocab_size {kwargs['vocab_size']} is smaller than the tokenizer ({min_vocab} tokens)"
        )
    cls = Qwen2Config if model_type == "qwen2" else LlamaConfig
    return BackboneConfig.from_hf(cls(**kwargs))


def write_cosyvoice2_dir(
    out_dir: str | Path,
    qwen_config_kwargs: dict[str, Any],
    speech_token_size: int,
    tokenizer: Any,
    seed: int = 0,
) -> Path:
    """Write a random-weight CosyVoice 2 model dir: llm.pt (real keys) + CosyVoice-BlankEN/.

    qwen_config_kwargs: `transformers.Qwen2Config` arguments (hidden_size, num_hidden_layers, ...);
    vocab_size defaults to the tokenizer's size (with CosyVoice's text special tokens) and
    tie_word_embeddings to True, as in the real model. tokenizer: a transformers tokenizer or the
    path of a tokenizer dir. Weights: normal(0, initializer_range), zero biases, unit norms.
    """
    return _write_cosyvoice_dir(CosyVoice2LM, out_dir, qwen_config_kwargs, speech_token_size, tokenizer, seed)


def write_cosyvoice3_dir(
    out_dir: str | Path,
    qwen_config_kwargs: dict[str, Any],
    speech_token_size: int,
    tokenizer: Any,
    seed: int = 0,
) -> Path:
    """Write a random-weight CosyVoice 3 model dir (upstream CosyVoice3LM's llm.pt keys: speech_embedding
    and a bias-free llm_decoder of speech_token_size + 200 rows, no llm_embedding) + CosyVoice-BlankEN/
    with CosyVoice 3's text special tokens. Arguments and weights as write_cosyvoice2_dir."""
    from ssd.models.cosyvoice3 import CosyVoice3LM

    return _write_cosyvoice_dir(CosyVoice3LM, out_dir, qwen_config_kwargs, speech_token_size, tokenizer, seed)


def _write_cosyvoice_dir(
    model_class: type[CosyVoice2LM],
    out_dir: str | Path,
    qwen_config_kwargs: dict[str, Any],
    speech_token_size: int,
    tokenizer: Any,
    seed: int,
) -> Path:
    tokenizer = _as_tokenizer(tokenizer, model_class.text_special_tokens)
    kwargs = {"tie_word_embeddings": True, **qwen_config_kwargs}
    config = _backbone_config(kwargs, len(tokenizer), "qwen2")
    std = float(kwargs.get("initializer_range", 0.02))
    generator = torch.Generator().manual_seed(seed)
    model = model_class(config, speech_token_size, tokenizer=tokenizer)
    with torch.no_grad():
        model.backbone.reset_parameters(generator, std)
        for module in (model.llm_embedding, model.speech_embedding, model.llm_decoder, model.text_lm_head):
            if module is not None:
                module.weight.normal_(0.0, std, generator=generator)
        if model.llm_decoder.bias is not None:
            model.llm_decoder.bias.zero_()
    return model.save_dir(out_dir)


# A compact Llama-3-style chat template (the real LLaSA tokenizer ships Llama 3's own).
LLASA_TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
)


def write_llasa_dir(
    out_dir: str | Path,
    llama_config_kwargs: dict[str, Any],
    num_speech_tokens: int,
    tokenizer: Any,
    seed: int = 0,
) -> Path:
    """Write a random-weight LLaSA dir: config.json, model.safetensors (HF keys; no lm_head when
    tied) and the tokenizer extended as LLaSA does (8 special tokens, then <|s_0|>..<|s_{n-1}|>),
    with a chat template. tokenizer: a transformers tokenizer or a tokenizer dir (its own ids first)."""
    from safetensors.torch import save_file

    from ssd.models.llasa import SPECIAL_TOKENS, speech_token

    tokenizer = _as_tokenizer(tokenizer)
    add_special_tokens(tokenizer, ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"])
    from tokenizers import AddedToken

    added = list(SPECIAL_TOKENS) + [speech_token(i) for i in range(num_speech_tokens)]
    tokenizer.add_tokens([AddedToken(t, normalized=False) for t in added])
    tokenizer.chat_template = LLASA_TINY_CHAT_TEMPLATE
    kwargs = {"tie_word_embeddings": True, **llama_config_kwargs}
    config = _backbone_config(kwargs, len(tokenizer), "llama")
    std = float(kwargs.get("initializer_range", 0.02))
    generator = torch.Generator().manual_seed(seed)
    from ssd.models.transformer import Backbone

    backbone = Backbone(config)
    with torch.no_grad():
        backbone.reset_parameters(generator, std)
    state = {"model." + k: v.contiguous() for k, v in backbone.state_dict().items()}
    if not config.tie_word_embeddings:
        state["lm_head.weight"] = (
            torch.randn(config.vocab_size, config.hidden_size, generator=generator) * std
        )
    hf_config = config.to_hf()
    hf_config.architectures = ["LlamaForCausalLM"]

    def build(staging: Path) -> None:
        save_file(state, str(staging / "model.safetensors"), metadata={"format": "pt"})
        hf_config.save_pretrained(staging)
        tokenizer.save_pretrained(str(staging))

    return write_tree(out_dir, build)
