"""A CosyVoice-layout LM (CosyVoice 2, CosyVoice 3, the toy target) as the plain HF causal LM that serving
engines load: upstream CosyVoice's vLLM export layout. The Qwen2 backbone keeps its weights; `embed_tokens` is
the speech embedding, `lm_head` the speech head and `vocab_size` the head's size, untied. A head with a bias
(CosyVoice 2's) is saved with it and named `CosyVoice2ForCausalLM` (upstream's vLLM model class, which adds
the bias to Qwen2's head); without one the dir is a plain `Qwen2ForCausalLM`. Text and prompt positions reach
such a server as prompt embeddings (the model's `embed_prompt`), as upstream feeds them.

    python scripts/export_vllm.py --out /models/cv2_vllm target=cosyvoice2 target.model.model_dir=...
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from ssd.files import write_atomic

BIASED_ARCHITECTURE = "CosyVoice2ForCausalLM"


def hf_causal_lm(model: Any) -> Any:
    """transformers' Qwen2ForCausalLM over the speech vocabulary holding `model`'s own tensors (its lm_head a
    biased Linear when the model's speech head has a bias)."""
    from transformers import Qwen2ForCausalLM

    hf_config = model.backbone.config.to_hf()
    hf_config.vocab_size = model.vocab_size
    hf_config.tie_word_embeddings = False  # speech embedding and speech head are different tensors
    hf_config._attn_implementation = "sdpa"
    with torch.device(model.device):  # initialising 0.5 B parameters is quicker on the GPU
        hf = Qwen2ForCausalLM(hf_config).to(dtype=model.dtype).eval()
    head = model.llm_decoder
    if head.bias is not None:
        hf.lm_head = torch.nn.Linear(head.in_features, head.out_features, bias=True, device=model.device,
                                     dtype=model.dtype)  # fmt: skip
    state = {f"model.{k}": v for k, v in model.backbone.state_dict().items() if k != "embed_tokens.weight"}
    state["model.embed_tokens.weight"] = model.speech_embedding.weight
    state["lm_head.weight"] = head.weight
    if head.bias is not None:
        state["lm_head.bias"] = head.bias
    hf.load_state_dict(state, strict=True)
    return hf


def export_vllm(model: Any, out_dir: str | Path) -> Path:
    """Write the serving dir (config.json + model.safetensors); refuses an existing `out_dir` (written to a
    temporary dir beside it and renamed when complete)."""
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} exists: export into a new directory")
    hf = hf_causal_lm(model)
    biased = hf.lm_head.bias is not None
    hf.config.use_bias = biased  # what upstream's CosyVoice2ForCausalLM reads
    for key in (
        "bos_token_id",
        "eos_token_id",
    ):  # speech has no BOS; its stop ids are the model's stop_tokens
        setattr(hf.config, key, None)
    hf.config.stop_token_ids = list(model.stop_tokens)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        hf.save_pretrained(staging, safe_serialization=True)
        config = json.loads((staging / "config.json").read_text())  # save_pretrained names its own class
        config["architectures"] = [BIASED_ARCHITECTURE if biased else "Qwen2ForCausalLM"]
        write_atomic(staging / "config.json", json.dumps(config, indent=2, sort_keys=True))
        staging.rename(out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir
