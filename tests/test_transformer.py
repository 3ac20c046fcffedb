"""The hand-written backbone equals HF Qwen2/LLaMA, and its static cache behaves like a recompute."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from ssd.models.backbone_config import BackboneConfig  # noqa: E402
from ssd.models.transformer import Backbone, additive, block_mask, sdpa  # noqa: E402

torch.set_num_threads(1)


def tiny_config(model_type: str, **overrides) -> BackboneConfig:
    kwargs = dict(
        model_type=model_type,
        vocab_size=50,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6 if model_type == "qwen2" else 5e5},
        qkv_bias=model_type == "qwen2",
    )
    kwargs.update(overrides)
    return BackboneConfig(**kwargs)


def random_backbone(config: BackboneConfig, seed: int = 0) -> Backbone:
    torch.manual_seed(seed)
    model = Backbone(config)
    with torch.no_grad():  # larger than HF init so every term (biases, norms) matters
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model.eval()


def hf_model(config: BackboneConfig):
    from transformers import LlamaModel, Qwen2Model

    cls = Qwen2Model if config.model_type == "qwen2" else LlamaModel
    hf_config = config.to_hf()
    hf_config._attn_implementation = "eager"
    return cls(hf_config).eval()


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 5e5,
    "factor": 32.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 64,
}


@pytest.mark.parametrize(
    "config",
    [
        tiny_config("qwen2"),
        tiny_config("llama"),
        tiny_config("llama", rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True),
        tiny_config("qwen2", num_kv_heads=4),
    ],
    ids=["qwen2", "llama", "llama3-rope", "qwen2-mha"],
)
def test_matches_hf_and_loads_its_state_dict_strictly(config):
    ours = random_backbone(config)
    hf = hf_model(config)
    hf.load_state_dict(ours.state_dict(), strict=True)
    ours.load_state_dict(hf.state_dict(), strict=True)
    x = torch.randn(2, 11, config.hidden_size)
    with torch.no_grad():
        expected = hf(inputs_embeds=x).last_hidden_state
        assert torch.allclose(ours(x), expected, atol=1e-5, rtol=1e-4)
        cache = ours.new_cache(2, 16)
        assert torch.allclose(ours.forward_cached(x, cache), expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_incremental_decoding_equals_full_recompute(static):
    model = random_backbone(tiny_config("qwen2"))
    model.static_step = static
    x = torch.randn(2, 12, 32)
    with torch.no_grad():
        full = model(x)
        cache = model.new_cache(2, 4)  # too small on purpose: an eager cache grows, a static one rounds up
        assert cache.static == static
        pieces = [model.forward_cached(x[:, :5], cache)]
        for t in range(5, 8):
            pieces.append(model.forward_cached(x[:, t : t + 1], cache))
        pieces.append(model.forward_cached(x[:, 8:], cache))
    assert cache.lengths.tolist() == [12, 12]
    assert torch.allclose(torch.cat(pieces, dim=1), full, atol=1e-5)


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_rollback_then_reextend_equals_recompute(static):
    model = random_backbone(tiny_config("llama"))
    model.static_step = static
    x = torch.randn(1, 10, 32)
    other = torch.randn(1, 3, 32)
    with torch.no_grad():
        cache = model.new_cache(1, 16)
        model.forward_cached(x[:, :6], cache)
        cache.prompt_lengths = cache.lengths.clone()
        model.forward_cached(x[:, 6:10], cache)  # verify 4 ...
        cache.rollback(3)  # ... keep one
        got = model.forward_cached(other, cache)
        expected = model(torch.cat([x[:, :7], other], dim=1))[:, 7:]
    assert torch.allclose(got, expected, atol=1e-5)
    with pytest.raises(RuntimeError if static else ValueError, match="cut into the prompt"):
        cache.rollback(5)
    assert cache.lengths.tolist() == [10]  # a refused rollback changes nothing


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_rows_of_different_lengths_match_each_row_alone(static):
    model = random_backbone(tiny_config("qwen2"))
    model.static_step = static
    lengths = torch.tensor([7, 3, 5])
    prompts = torch.randn(3, 7, 32)
    steps = torch.randn(3, 4, 32)
    with torch.no_grad():
        cache = model.new_cache(3, 8)
        first = model.forward_cached(prompts, cache, num_new=lengths)
        assert cache.lengths.tolist() == [7, 3, 5]
        second = model.forward_cached(steps[:, :2], cache)
        cache.rollback(torch.tensor([1, 0, 2]))  # per-row rejection
        third = model.forward_cached(steps[:, 2:], cache)
        for row, n in enumerate(lengths.tolist()):
            keep = 2 - [1, 0, 2][row]
            seq = torch.cat([prompts[row, :n], steps[row, :keep], steps[row, 2:]])[None]
            alone = model(seq)[0]
            assert torch.allclose(first[row, :n], alone[:n], atol=1e-5)
            assert torch.allclose(
                second[row], model(torch.cat([prompts[row, :n], steps[row, :2]])[None])[0, n:], atol=1e-5
            )
            assert torch.allclose(third[row], alone[n + keep :], atol=1e-5)


def test_padded_full_forward_matches_unpadded_rows():
    model = random_backbone(tiny_config("llama"))
    x = torch.randn(2, 9, 32)
    lengths = torch.tensor([9, 4])
    with torch.no_grad():
        out = model(x, lengths=lengths)
        assert torch.allclose(out[1, :4], model(x[1:, :4])[0], atol=1e-5)
        assert torch.allclose(out[0], model(x[:1])[0], atol=1e-5)


def test_bad_config_is_a_clear_error():
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        tiny_config("qwen2", num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="not supported"):
        tiny_config("gpt2")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_additive_block_mask_attends_exactly_as_the_bool_mask(dtype):
    """The verify block's mask is made additive once per call; attention through it is bit for bit what sdpa
    computes from the bool mask, and a query never sees a key past its own position."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 4, 8, generator=g).to(dtype)
    k, v = (torch.randn(2, 2, 30, 8, generator=g).to(dtype) for _ in range(2))
    start = torch.tensor([20, 13])
    allowed = (torch.arange(30) <= (start[:, None] + torch.arange(4))[..., None])[:, None]
    mask = block_mask(start, 4, 30, "cpu", dtype)
    assert torch.equal(mask, additive(allowed, dtype))
    assert torch.equal(sdpa(q, k, v, mask), sdpa(q, k, v, allowed))
    poisoned = v.clone()
    poisoned[1, :, 17:] = 1e4  # row 1's last query sits at position 16: its keys past that must weigh 0
    assert torch.equal(sdpa(q, k, poisoned, mask), sdpa(q, k, v, mask))
    every = torch.ones_like(allowed)  # negative control: a mask that lets the queries see those keys
    assert not torch.equal(sdpa(q, k, poisoned, every), sdpa(q, k, v, every))
