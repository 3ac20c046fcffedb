"""LlasaLM reads a real-format LLaSA dir and computes HF LlamaForCausalLM's logits on its head (the full
vocabulary, or the speech slice with head="speech")."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from ssd.contracts import SpeechLM  # noqa: E402
from ssd.drafters.layers import build_draft  # noqa: E402
from ssd.models.llasa import LlasaLM, LlasaPrompt  # noqa: E402
from tests.fixtures_models import TINY_LLASA_SPEECH_TOKENS  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model(tiny_llasa_dir):
    return LlasaLM.from_dir(tiny_llasa_dir)


@pytest.fixture(scope="module", params=["full", "speech"])
def any_head(request, tiny_llasa_dir):
    return LlasaLM.from_dir(tiny_llasa_dir, head=request.param)


def test_ids_come_from_the_tokenizer(any_head):
    model = any_head
    assert isinstance(model, SpeechLM)
    tok = model.tokenizer
    n = TINY_LLASA_SPEECH_TOKENS
    assert model.speech_offset == tok.convert_tokens_to_ids("<|s_0|>")
    assert model.speech_end_id == tok.convert_tokens_to_ids("<|SPEECH_GENERATION_END|>")
    assert model.num_speech_tokens == n and model.speech_token_size == n
    assert model.stop_tokens == (n,) and model.eos_token == n
    head_ids = model.to_global_ids(torch.arange(model.vocab_size)).tolist()
    # codes first, then the end token, under both heads
    assert head_ids[: n + 1] == [model.speech_offset + i for i in range(n)] + [model.speech_end_id]
    if model.head == "speech":
        assert model.vocab_size == n + 1
    else:  # every other vocabulary id after them, ascending, each once
        assert model.vocab_size == len(tok) == model.backbone.config.vocab_size
        assert head_ids[n + 1 :] == sorted(set(range(model.vocab_size)) - set(head_ids[: n + 1]))


def test_codec_tokens_drop_text_tokens_and_keep_codes(model):
    text_id = int(
        torch.nonzero(model.to_global_ids(torch.arange(model.vocab_size)) < model.speech_offset)[-1]
    )
    assert text_id > model.eos_token  # a text token in the full head
    assert model.codec_tokens([3, text_id, 0, 39, text_id]) == [3, 0, 39]


def test_embed_speech_embeds_any_head_id_as_its_llama_token(model):
    ids = torch.arange(model.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(
            model.embed_speech(ids), model.backbone.embed_tokens(model.to_global_ids(ids))
        )
        text_ids = model.tokenizer("bin blue", add_special_tokens=False).input_ids
        head = model.context_ids(LlasaPrompt([text_ids]))[0]
        torch.testing.assert_close(
            model.embed_speech(head), model.backbone.embed_tokens(torch.tensor(text_ids))
        )


def test_context_ids_are_the_prompt_in_head_space(any_head):
    prompt = any_head.make_prompt(["bin blue"], ["lay green"], [[1, 2]])
    (context,) = any_head.context_ids(prompt)
    kept = torch.isin(prompt.input_ids[0], any_head.to_global_ids(torch.arange(any_head.vocab_size)))
    assert any_head.to_global_ids(context).tolist() == prompt.input_ids[0][kept].tolist()
    assert context[-2:].tolist() == [1, 2]  # the prompt's speech tokens are codes
    if any_head.head == "full":
        assert kept.all()


def test_prompt_format(model):
    prompt = model.make_prompt(["bin blue"], ["lay green"], [[1, 2]])
    text = model.tokenizer.decode(prompt.input_ids[0])
    assert (
        "convert the text to speech : <|TEXT_UNDERSTANDING_START|> lay green bin blue <|TEXT_UNDERSTANDING_END|>"
        in text
    )
    assert text.endswith("assistant <|end_header_id|> <|SPEECH_GENERATION_START|> <|s_1|> <|s_2|>")


@pytest.mark.parametrize("joiner", [" ", ""])
def test_prompt_joiner_joins_prompt_text_and_text(tiny_llasa_dir, joiner):
    """ " " as the authors' Spaces demo, "" as the model card's example: the ids are the chat template's of
    the joined string."""
    model = LlasaLM.from_dir(tiny_llasa_dir, prompt_joiner=joiner)
    chat = [
        {"role": "user", "content": f"Convert the text to speech:<|TEXT_UNDERSTANDING_START|>lay green{joiner}bin "
         "blue<|TEXT_UNDERSTANDING_END|>"},
        {"role": "assistant", "content": "<|SPEECH_GENERATION_START|>"},
    ]  # fmt: skip
    expected = model.tokenizer.apply_chat_template(chat, tokenize=True, continue_final_message=True)
    expected = list(
        expected["input_ids"] if hasattr(expected, "input_ids") or isinstance(expected, dict) else expected
    )
    ids = model.make_prompt(["bin blue"], ["lay green"], [[]]).input_ids[0].tolist()
    assert ids == expected
    other = LlasaLM.from_dir(tiny_llasa_dir, prompt_joiner=" " if joiner == "" else "")
    assert other.make_prompt(["bin blue"], ["lay green"], [[]]).input_ids[0].tolist() != ids


def test_logits_equal_hf_llama_on_the_head(any_head, tiny_llasa_dir):
    from transformers import LlamaForCausalLM

    model = any_head
    hf = LlamaForCausalLM.from_pretrained(str(tiny_llasa_dir), local_files_only=True).eval()
    columns = model.to_global_ids(torch.arange(model.vocab_size))
    prompt = model.make_prompt(["bin blue at zero", "set red"], ["lay green", ""], [[1, 2], []])
    # 40 = EOS, fed back as <|SPEECH_GENERATION_END|>; 45 (full head) is a text token
    generated = torch.tensor([[4, 39, 40], [0, 7, 45 if model.head == "full" else 7]])
    cache, first = model.prefill(prompt, 4)
    steps = model.extend(cache, generated)
    for row in range(2):
        ids = torch.cat([prompt.input_ids[row], model.to_global_ids(generated[row])])
        with torch.no_grad():
            ref = hf(input_ids=ids[None]).logits[0, :, columns]
        n = prompt.input_ids[row].numel()
        torch.testing.assert_close(first[row], ref[n - 1], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(steps[row], ref[n:], atol=1e-5, rtol=1e-4)


def test_tied_head_becomes_a_separate_trainable_draft_head(model):
    assert model.lm_head.weight.data_ptr() == model.backbone.embed_tokens.weight.data_ptr()
    draft = build_draft(model, layers=[0, 2], trainable=["head"])
    assert (
        draft.model.lm_head.weight.requires_grad
        and not draft.model.backbone.embed_tokens.weight.requires_grad
    )
    assert draft.model.lm_head.weight.data_ptr() != model.lm_head.weight.data_ptr()


def test_bad_dirs_are_clear_errors(tiny_llasa_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    with pytest.raises(ValueError, match="LLASA_DIR"):
        LlasaLM.from_dir(None)
    with pytest.raises(FileNotFoundError, match="config.json"):
        LlasaLM.from_dir(tmp_path)
    import shutil

    bad = shutil.copytree(tiny_llasa_dir, tmp_path / "bad")
    state = load_file(str(bad / "model.safetensors"))
    del state["model.norm.weight"]
    save_file(state, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.safetensors.*missing keys: model.norm.weight"):
        LlasaLM.from_dir(bad)


def test_training_logits_score_speech_and_end_after_the_chat_prompt(model):
    """A LLaSA draft is trained like any target: the row is the chat prompt of the text (the same ids as
    make_prompt builds) then the speech; only speech + <|SPEECH_GENERATION_END|> carry a loss."""
    from ssd.contracts import IGNORE_INDEX

    text_ids = torch.tensor(model.tokenizer("bin blue", add_special_tokens=False).input_ids)
    prompt_ids = model.make_prompt(["bin blue"]).input_ids[0]
    with torch.no_grad():
        torch.testing.assert_close(model.prefix_embeds(text_ids), model.backbone.embed_tokens(prompt_ids))
    speech = torch.tensor([[3, 5, 7]])
    logits, targets = model.training_logits(
        text_ids[None], torch.tensor([len(text_ids)]), speech, torch.tensor([3])
    )
    n = len(prompt_ids)
    assert logits.shape == (1, n + 3, model.vocab_size)
    assert (targets[0, : n - 1] == IGNORE_INDEX).all()
    assert targets[0, n - 1 :].tolist() == [3, 5, 7, model.eos_token]
    # the logits are the cached forward's: the last prompt position predicts the first speech token
    cache, first = model.prefill(model.make_prompt(["bin blue"]), 4)
    torch.testing.assert_close(logits[0, n - 1], first[0], atol=1e-4, rtol=1e-4)
