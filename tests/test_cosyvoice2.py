"""CosyVoice2LM loads the real llm.pt layout strictly and computes what upstream's Qwen2LM computes."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from ssd.contracts import SpeechLM  # noqa: E402
from ssd.models.cosyvoice2 import CosyVoice2LM, CosyVoice2Prompt  # noqa: E402
from tests.fixtures_models import TINY_SPEECH_TOKENS  # noqa: E402

torch.set_num_threads(1)


class UpstreamReference:
    """An independent construction from the same files: HF Qwen2ForCausalLM + the upstream input
    layout, recomputed from scratch for every sequence (no cache)."""

    def __init__(self, model_dir):
        from transformers import AutoConfig, Qwen2ForCausalLM

        state = torch.load(model_dir / "llm.pt", weights_only=True)
        config = AutoConfig.from_pretrained(model_dir / "CosyVoice-BlankEN")
        self.qwen = Qwen2ForCausalLM(config).eval()
        qwen_state = {k.removeprefix("llm.model."): v for k, v in state.items() if k.startswith("llm.model.")}
        self.qwen.load_state_dict(qwen_state, strict=True)
        self.llm_embedding = state["llm_embedding.weight"]
        self.speech_embedding = state["speech_embedding.weight"]
        self.decoder_w, self.decoder_b = state["llm_decoder.weight"], state["llm_decoder.bias"]

    @torch.no_grad()
    def logits(self, text_ids, speech_ids, generated) -> torch.Tensor:
        """Logits after every position from the task_id on: [1 + len(speech) + len(generated), V]."""
        lm_input = torch.cat(
            [
                self.llm_embedding[0:1],
                self.qwen.model.embed_tokens(torch.as_tensor(text_ids)),
                self.llm_embedding[1:2],
                self.speech_embedding[torch.as_tensor(list(speech_ids) + list(generated), dtype=torch.long)],
            ]
        )[None]
        hidden = self.qwen.model(inputs_embeds=lm_input).last_hidden_state[0]
        out = hidden @ self.decoder_w.T + self.decoder_b
        return out[1 + len(text_ids) :]


@pytest.fixture(scope="module")
def model(tiny_cosyvoice2_dir):
    return CosyVoice2LM.from_dir(tiny_cosyvoice2_dir)


def test_ids_and_interface(model):
    assert isinstance(model, SpeechLM)
    assert model.vocab_size == TINY_SPEECH_TOKENS + 3
    assert model.eos_token == TINY_SPEECH_TOKENS
    assert model.stop_tokens == (TINY_SPEECH_TOKENS, TINY_SPEECH_TOKENS + 1, TINY_SPEECH_TOKENS + 2)


def test_prompt_from_strings_has_no_bos_eos_and_right_length_limits(model):
    prompt = model.make_prompt(["bin blue at zero now", "set red"], ["lay green", ""], [[1, 2, 3], []])
    vocab = model.tokenizer.get_vocab()
    assert prompt.text_ids[0].tolist() == [vocab[w] for w in "lay green bin blue at zero now".split()]
    assert prompt.text_ids[1].tolist() == [vocab["set"], vocab["red"]]
    assert prompt.speech_ids[0].tolist() == [1, 2, 3] and prompt.speech_ids[1].numel() == 0
    min_len, max_len = model.length_limits(prompt)
    assert min_len.tolist() == [10, 4] and max_len.tolist() == [100, 40]
    with pytest.raises(ValueError, match="target_text_lens"):
        CosyVoice2Prompt(text_ids=[[1, 2]], speech_ids=[[]], target_text_lens=[3])


def test_logits_equal_independent_construction_and_cache_equals_recompute(model, tiny_cosyvoice2_dir):
    reference = UpstreamReference(tiny_cosyvoice2_dir)
    prompt = model.make_prompt(["bin blue at zero now", "set red"], ["lay green", ""], [[1, 2, 3], []])
    generated = torch.tensor([[5, 9, 12, 60, 7], [33, 2, 2, 40, 0]])
    cache, first = model.prefill(prompt, max_new_tokens=8)
    steps = [model.extend(cache, generated[:, :2]), model.extend(cache, generated[:, 2:3])]
    model.rollback(cache, torch.tensor([1, 0]))  # row 0 drops token 12; row 1 keeps all
    steps.append(model.extend(cache, generated[:, 3:]))
    for row in range(2):
        kept = generated[row].tolist() if row == 1 else [5, 9, 60, 7]
        ref = reference.logits(prompt.text_ids[row].tolist(), prompt.speech_ids[row].tolist(), kept)
        n_speech = prompt.speech_ids[row].numel()
        torch.testing.assert_close(first[row], ref[n_speech], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(steps[0][row], ref[n_speech + 1 : n_speech + 3], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(steps[2][row], ref[-2:], atol=1e-5, rtol=1e-4)
    assert first.dtype == torch.float32


def test_training_logits_targets_and_padding(model, tiny_cosyvoice2_dir):
    reference = UpstreamReference(tiny_cosyvoice2_dir)
    text = torch.tensor([[3, 4, 5], [6, 7, 0]])
    text_lens = torch.tensor([3, 2])
    speech = torch.tensor([[10, 11, 0, 0], [20, 21, 22, 23]])
    speech_lens = torch.tensor([2, 4])
    logits, targets = model.training_logits(text, text_lens, speech, speech_lens)
    assert logits.shape == (2, 8, TINY_SPEECH_TOKENS + 3)
    eos = TINY_SPEECH_TOKENS
    assert targets.tolist() == [
        [-100, -100, -100, -100, 10, 11, eos, -100],
        [-100, -100, -100, 20, 21, 22, 23, eos],
    ]
    ref0 = reference.logits([3, 4, 5], [10, 11], [])
    torch.testing.assert_close(logits[0, 4:7], ref0, atol=1e-5, rtol=1e-4)
    ref1 = reference.logits([6, 7], [20, 21, 22, 23], [])
    torch.testing.assert_close(logits[1, 3:8], ref1, atol=1e-5, rtol=1e-4)


def _copy_dir(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_and_wrong_keys_are_clear_errors(tiny_cosyvoice2_dir, tmp_path):
    bad = _copy_dir(tiny_cosyvoice2_dir, tmp_path / "bad")
    state = torch.load(bad / "llm.pt", weights_only=True)
    del state["llm.model.model.layers.1.mlp.up_proj.weight"]
    state["llm.model.model.extra.weight"] = torch.zeros(2)
    state["llm_decoder.bias"] = torch.zeros(5)
    torch.save(state, bad / "llm.pt")
    with pytest.raises(ValueError) as err:
        CosyVoice2LM.from_dir(bad)
    message = str(err.value)
    assert "llm.pt" in message
    assert "missing keys: llm.model.model.layers.1.mlp.up_proj.weight" in message
    assert "unexpected keys: llm.model.model.extra.weight" in message
    assert "llm_decoder.bias: file (5,)" in message


def test_missing_dir_and_unset_dir_are_clear_errors(tiny_cosyvoice2_dir, tmp_path):
    with pytest.raises(ValueError, match="model_dir=.*COSYVOICE2_DIR"):
        CosyVoice2LM.from_dir(None)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        CosyVoice2LM.from_dir(tmp_path / "nowhere")
    no_tokenizer = _copy_dir(tiny_cosyvoice2_dir, tmp_path / "no_tok")
    shutil.rmtree(no_tokenizer / "CosyVoice-BlankEN")
    with pytest.raises(FileNotFoundError, match="CosyVoice-BlankEN/config.json"):
        CosyVoice2LM.from_dir(no_tokenizer)


def test_save_dir_round_trip_and_half_precision(model, tmp_path):
    out = model.save_dir(tmp_path / "copy")
    again = CosyVoice2LM.from_dir(out)
    for (k1, v1), (k2, v2) in zip(model.state_dict().items(), again.state_dict().items()):
        assert k1 == k2 and torch.equal(v1, v2)
    half = CosyVoice2LM.from_dir(out, dtype="bfloat16")
    assert half.dtype == torch.bfloat16
    prompt = model.make_prompt(["bin blue"])
    _, logits = half.prefill(prompt, 2)
    _, full = model.prefill(prompt, 2)
    assert logits.dtype == torch.float32
    assert torch.allclose(logits, full, atol=0.3)  # same model, bf16 rounding only
