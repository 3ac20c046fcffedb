"""The serving export: a CosyVoice-layout LM as the HF causal-LM dir that serving engines load."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen2ForCausalLM

from ssd.models.cosyvoice2 import CosyVoice2LM
from ssd.models.export import BIASED_ARCHITECTURE, export_vllm


def test_the_export_loads_with_transformers_and_computes_the_same_logits(tiny_cosyvoice2_dir, tmp_path):
    model = CosyVoice2LM.from_dir(tiny_cosyvoice2_dir).eval()
    with torch.no_grad():
        model.llm_decoder.bias.normal_(
            0, 1.0, generator=torch.Generator().manual_seed(0)
        )  # a bias that shows
    out = export_vllm(model, tmp_path / "serve")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [BIASED_ARCHITECTURE] and config["use_bias"] is True
    assert config["vocab_size"] == model.vocab_size and config["tie_word_embeddings"] is False
    assert config["stop_token_ids"] == list(model.stop_tokens)
    tensors = load_file(out / "model.safetensors")
    torch.testing.assert_close(tensors["lm_head.bias"], model.llm_decoder.bias.detach())
    torch.testing.assert_close(tensors["model.embed_tokens.weight"], model.speech_embedding.weight.detach())
    # transformers' own Qwen2 classes read it (its Qwen2 head has no bias: upstream's vLLM class adds it)
    hf = Qwen2ForCausalLM.from_pretrained(out).eval()
    prompt = model.make_prompt(["set red at zero"], ["lay green"], [[1, 2, 3]])
    with torch.no_grad():
        embeds, _ = model.embed_prompt(prompt)
        theirs = hf(inputs_embeds=embeds).logits[:, -1] + tensors["lm_head.bias"]
        ours = model.prefill(prompt, 1)[1]
        speech = torch.tensor([[5, 9]])
        cache, _ = model.prefill(prompt, 4)
        ours_next = model.extend(cache, speech)[0, -1]
        theirs_next = hf(inputs_embeds=torch.cat([embeds, model.embed_speech(speech)], 1)).logits[0, -1]
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=0)
    torch.testing.assert_close(theirs_next + tensors["lm_head.bias"], ours_next, atol=1e-4, rtol=0)
    assert (theirs - tensors["lm_head.bias"] - ours).abs().max() > 0.1  # negative control: the bias matters


def test_an_export_never_replaces_a_directory(tiny_cosyvoice2_dir, tmp_path):
    model = CosyVoice2LM.from_dir(tiny_cosyvoice2_dir)
    (tmp_path / "serve").mkdir()
    (tmp_path / "serve" / "mine.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="new directory"):
        export_vllm(model, tmp_path / "serve")
    assert (tmp_path / "serve" / "mine.txt").read_text() == "keep"
