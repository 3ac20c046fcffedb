"""CosyVoice3LM loads upstream CosyVoice3LM's llm.pt layout strictly and computes what it computes.

The reference is built independently from the same files: HF Qwen2ForCausalLM from CosyVoice-BlankEN/ with
llm.pt's weights, and upstream's CosyVoice 3 input layout (sos / task_id as speech_embedding rows S and S+2,
a bias-free llm_decoder of S+200 rows), recomputed from scratch for every sequence.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from ssd.contracts import SpeechLM, TTSTargetLM  # noqa: E402
from ssd.models.cosyvoice2 import CosyVoice2LM  # noqa: E402
from ssd.models.cosyvoice3 import (  # noqa: E402
    END_OF_PROMPT,
    INSTRUCTION,
    MAX_SILENT_RUN,
    TEXT_SPECIAL_TOKENS,
    CosyVoice3LM,
    CosyVoice3Prompt,
)
from tests.fixtures_models import TINY_QWEN2, TINY_SPEECH_TOKENS  # noqa: E402

torch.set_num_threads(1)
S = TINY_SPEECH_TOKENS
LAYERS = TINY_QWEN2["num_hidden_layers"]


class UpstreamReference:
    """Upstream's CosyVoice 3 LM input and head, from the files alone."""

    def __init__(self, model_dir, sos_row: int = S, task_id_row: int = S + 2):
        from transformers import AutoConfig, Qwen2ForCausalLM

        state = torch.load(model_dir / "llm.pt", weights_only=True)
        config = AutoConfig.from_pretrained(model_dir / "CosyVoice-BlankEN")
        self.qwen = Qwen2ForCausalLM(config).eval()
        qwen_state = {k.removeprefix("llm.model."): v for k, v in state.items() if k.startswith("llm.model.")}
        self.qwen.load_state_dict(qwen_state, strict=True)
        self.speech_embedding = state["speech_embedding.weight"]
        self.decoder_w = state["llm_decoder.weight"]
        self.sos_row, self.task_id_row = sos_row, task_id_row

    @torch.no_grad()
    def logits(self, text_ids, speech_ids, generated) -> torch.Tensor:
        """Logits after every position from the task_id on: [1 + len(speech) + len(generated), S+200]."""
        emb = self.speech_embedding
        lm_input = torch.cat(
            [
                emb[self.sos_row : self.sos_row + 1],
                self.qwen.model.embed_tokens(torch.as_tensor(text_ids)),
                emb[self.task_id_row : self.task_id_row + 1],
                emb[torch.as_tensor(list(speech_ids) + list(generated), dtype=torch.long)],
            ]
        )[None]
        hidden = self.qwen.model(inputs_embeds=lm_input).last_hidden_state[0]
        return (hidden @ self.decoder_w.T)[1 + len(text_ids) :]


@pytest.fixture(scope="module")
def model(tiny_cosyvoice3_dir):
    return CosyVoice3LM.from_dir(tiny_cosyvoice3_dir)


def _copy_dir(src, dst):
    shutil.copytree(src, dst)
    return dst


# ---- the files ----------------------------------------------------------------------------------------


def test_llm_pt_has_upstreams_cosyvoice3_keys_and_no_cosyvoice2_ones(tiny_cosyvoice3_dir):
    state = torch.load(tiny_cosyvoice3_dir / "llm.pt", weights_only=True)
    h = TINY_QWEN2["hidden_size"]
    assert len(state) == 5 + 12 * LAYERS  # 53 keys for 4 layers (CosyVoice 2's llm.pt: 55)
    assert state["speech_embedding.weight"].shape == (S + 200, h)
    assert state["llm_decoder.weight"].shape == (S + 200, h)
    assert "llm_embedding.weight" not in state and "llm_decoder.bias" not in state
    assert {k for k in state if not k.startswith("llm.model.")} == {
        "speech_embedding.weight",
        "llm_decoder.weight",
    }


def test_written_dir_opens_with_transformers_qwen2_loader(tiny_cosyvoice3_dir):
    """Upstream's Qwen2Encoder runs Qwen2ForCausalLM.from_pretrained(CosyVoice-BlankEN) before loading llm.pt."""
    from transformers import Qwen2ForCausalLM

    qwen, info = Qwen2ForCausalLM.from_pretrained(
        str(tiny_cosyvoice3_dir / "CosyVoice-BlankEN"), local_files_only=True, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    state = torch.load(tiny_cosyvoice3_dir / "llm.pt", weights_only=True)
    for key, value in qwen.state_dict().items():
        assert torch.equal(value, state["llm.model." + key]), key


def test_ids_stop_tokens_and_interface(model):
    assert isinstance(model, SpeechLM) and isinstance(model, TTSTargetLM)
    assert model.vocab_size == S + 200
    assert (model.sos_token, model.eos_token, model.task_id_token, model.fill_token) == (
        S,
        S + 1,
        S + 2,
        S + 3,
    )
    # every special row ends a sequence; the first is S, the id upstream's min_len rule refuses
    assert model.stop_tokens == tuple(range(S, S + 200)) and model.stop_tokens[0] == S
    assert model.llm_embedding is None and model.llm_decoder.bias is None
    assert "llm_embedding" not in model.module_groups()


def test_tokenizer_has_cosyvoice3s_special_tokens_in_upstreams_order(model):
    assert len(TEXT_SPECIAL_TOKENS) == 280 and len(set(TEXT_SPECIAL_TOKENS)) == 280
    assert (
        TEXT_SPECIAL_TOKENS[19:22] == ("<|endofsystem|>", "[AA]", "[AA0]")
        and TEXT_SPECIAL_TOKENS[-1] == "[ǜ]"
    )
    ids = [model.tokenizer.convert_tokens_to_ids(t) for t in TEXT_SPECIAL_TOKENS]
    assert ids == sorted(ids) and len(set(ids)) == 280  # added in this order: consecutive ids
    assert model.end_of_prompt_id == ids[2]
    assert model.tokenize("[breath][AH0]") == [ids[3], ids[29]]


# ---- prompts --------------------------------------------------------------------------------------------


def test_prompt_carries_the_instruction_and_length_limits_count_the_target_text(model):
    prompt = model.make_prompt(["bin blue at zero now", "set red"], ["lay green", ""], [[1, 2, 3], []])
    tok = model.tokenizer
    expected0 = tok(f"{INSTRUCTION}{END_OF_PROMPT}lay green", add_special_tokens=False).input_ids
    assert prompt.text_ids[0].tolist() == expected0 + model.tokenize("bin blue at zero now")
    vocab = tok.get_vocab()
    assert expected0[: len(model.instruction_ids)] == model.instruction_ids
    assert model.instruction_ids[:5] == [vocab[w] for w in "you are a helpful assistant".split()]
    assert model.instruction_ids[-1] == model.end_of_prompt_id
    assert prompt.text_ids[1].tolist() == model.instruction_ids + [vocab["set"], vocab["red"]]
    assert isinstance(prompt, CosyVoice3Prompt) and prompt.target_text_lens.tolist() == [5, 2]
    min_len, max_len = model.length_limits(prompt)
    assert min_len.tolist() == [10, 4] and max_len.tolist() == [100, 40]


def test_an_upstream_style_prompt_with_its_own_instruction_is_taken_as_given(model):
    own = f"please soon{END_OF_PROMPT}lay green"
    prompt = model.make_prompt(["set red", f"now{END_OF_PROMPT}set red"], [own, ""], [[], []])
    assert prompt.text_ids[0].tolist() == model.tokenize(own) + model.tokenize("set red")
    assert prompt.text_ids[1].tolist() == model.tokenize(f"now{END_OF_PROMPT}set red")
    assert prompt.target_text_lens.tolist() == [2, 4]  # upstream counts an instruction in the text as text


def test_a_prompt_without_end_of_prompt_or_with_special_speech_ids_is_refused(model):
    bare = CosyVoice3Prompt(text_ids=[model.tokenize("set red")], speech_ids=[[]], target_text_lens=[2])
    with pytest.raises(
        ValueError, match=r"row 0: its text ids hold no <\|endofprompt\|>.*target.model.instruction"
    ):
        model.prefill(bare, 2)
    with pytest.raises(ValueError, match=rf"codec tokens < {S}, got {S + 1}"):
        model.prefill(model.make_prompt(["set red"], ["lay"], [[1, S + 1]]), 2)
    from ssd.models.cosyvoice2 import CosyVoice2Prompt

    with pytest.raises(TypeError, match="CosyVoice3LM needs a CosyVoice3Prompt, got CosyVoice2Prompt"):
        model.prefill(CosyVoice2Prompt([[1]], [[]], [1]), 2)


def test_a_tokenizer_without_end_of_prompt_is_refused(model, tmp_path):
    from ssd.models.text_tokenizer import load_text_tokenizer, write_word_tokenizer

    plain = load_text_tokenizer(write_word_tokenizer(["set", "red"], tmp_path / "plain"))
    with pytest.raises(
        ValueError, match=r"does not keep <\|endofprompt\|> as one token.*TEXT_SPECIAL_TOKENS"
    ):
        CosyVoice3LM(model.backbone.config, S, tokenizer=plain)


def test_the_instruction_is_configurable(tiny_cosyvoice3_dir):
    other = CosyVoice3LM.from_dir(tiny_cosyvoice3_dir, instruction="please")
    vocab = other.tokenizer.get_vocab()
    assert other.instruction_ids == [vocab["please"], other.end_of_prompt_id]
    assert other.make_prompt(["set red"]).text_ids[0].tolist() == [vocab[w] for w in ("please",)] + [
        other.end_of_prompt_id,
        vocab["set"],
        vocab["red"],
    ]


# ---- what the model computes ----------------------------------------------------------------------------


def test_logits_equal_independent_construction_and_cache_equals_recompute(model, tiny_cosyvoice3_dir):
    reference = UpstreamReference(tiny_cosyvoice3_dir)
    prompt = model.make_prompt(["bin blue at zero now", "set red"], ["lay green", ""], [[1, 2, 3], []])
    generated = torch.tensor([[5, 9, 12, 60, 7], [33, 2, 2, 40, 0]])
    cache, first = model.prefill(prompt, max_new_tokens=8)
    steps = [model.extend(cache, generated[:, :2]), model.extend(cache, generated[:, 2:3])]
    model.rollback(cache, torch.tensor([1, 0]))  # row 0 drops token 12; row 1 keeps all
    steps.append(model.extend(cache, generated[:, 3:]))
    assert first.shape == (2, S + 200) and first.dtype == torch.float32
    for row in range(2):
        kept = generated[row].tolist() if row == 1 else [5, 9, 60, 7]
        ref = reference.logits(prompt.text_ids[row].tolist(), prompt.speech_ids[row].tolist(), kept)
        n_speech = prompt.speech_ids[row].numel()
        torch.testing.assert_close(first[row], ref[n_speech], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(steps[0][row], ref[n_speech + 1 : n_speech + 3], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(steps[2][row], ref[-2:], atol=1e-5, rtol=1e-4)


def test_the_reference_tells_the_special_rows_apart(model, tiny_cosyvoice3_dir):
    """Negative control: CosyVoice 2's positions for sos / task_id (rows 0 and 1) or task_id taken from the
    EOS row give other logits, so the test above would catch an adapter that used them."""
    prompt = model.make_prompt(["bin blue"], ["lay"], [[1, 2]])
    _, first = model.prefill(prompt, 1)
    text, speech = prompt.text_ids[0].tolist(), prompt.speech_ids[0].tolist()
    for sos_row, task_id_row in ((0, 1), (S, S + 1)):
        wrong = UpstreamReference(tiny_cosyvoice3_dir, sos_row, task_id_row).logits(text, speech, [])
        assert (wrong[len(speech)] - first[0]).abs().max() > 1e-2


def test_training_logits_prefix_holds_the_instruction_and_targets_end_with_eos(model, tiny_cosyvoice3_dir):
    reference = UpstreamReference(tiny_cosyvoice3_dir)
    text = torch.tensor([[3, 4, 5], [6, 7, 0]])
    speech = torch.tensor([[10, 11, 0, 0], [20, 21, 22, 23]])
    logits, targets = model.training_logits(text, torch.tensor([3, 2]), speech, torch.tensor([2, 4]))
    n_instr = len(model.instruction_ids)
    assert logits.shape == (2, 1 + n_instr + 2 + 1 + 4, S + 200)
    eos = S + 1
    assert targets[0].tolist() == [-100] * (n_instr + 4) + [10, 11, eos, -100]
    assert targets[1].tolist() == [-100] * (n_instr + 3) + [20, 21, 22, 23, eos]
    ref0 = reference.logits(model.instruction_ids + [3, 4, 5], [10, 11], [])
    torch.testing.assert_close(logits[0, n_instr + 4 : n_instr + 7], ref0, atol=1e-5, rtol=1e-4)
    ref1 = reference.logits(model.instruction_ids + [6, 7], [20, 21, 22, 23], [])
    torch.testing.assert_close(logits[1, n_instr + 3 :], ref1, atol=1e-5, rtol=1e-4)


def test_codec_tokens_drop_silent_runs_beyond_five_as_upstreams_model(model, tiny_cosyvoice3_dir):
    silent, speech = 28, 7  # 28 is one of upstream's silent FSQ tokens, 7 is not
    tokens = [speech] + [silent] * 8 + [speech, 1, 2, 1, 2, 1, 2, 1, speech, silent]
    expected = [speech] + [silent] * MAX_SILENT_RUN + [speech, 1, 2, 1, 2, 1, speech, silent]
    assert model.codec_tokens(tokens) == expected
    keep_all = CosyVoice3LM.from_dir(tiny_cosyvoice3_dir, drop_long_silences=False)
    assert keep_all.codec_tokens(tokens) == tokens


# ---- loading: strict, with errors that say what to fix -------------------------------------------------


def test_missing_unexpected_and_misshaped_keys_are_one_clear_error(tiny_cosyvoice3_dir, tmp_path):
    bad = _copy_dir(tiny_cosyvoice3_dir, tmp_path / "bad")
    state = torch.load(bad / "llm.pt", weights_only=True)
    del state["llm.model.model.layers.1.mlp.up_proj.weight"]
    state["llm_decoder.bias"] = torch.zeros(S + 200)  # CosyVoice 3's head has none
    state["llm.model.model.norm.weight"] = torch.ones(7)
    torch.save(state, bad / "llm.pt")
    with pytest.raises(ValueError) as err:
        CosyVoice3LM.from_dir(bad)
    message = str(err.value)
    assert "llm.pt" in message
    assert "missing keys: llm.model.model.layers.1.mlp.up_proj.weight" in message
    assert "unexpected keys: llm_decoder.bias" in message
    assert "llm.model.model.norm.weight: file (7,)" in message


def test_the_other_generations_checkpoints_are_refused(tiny_cosyvoice2_dir, tiny_cosyvoice3_dir):
    with pytest.raises(ValueError, match="has 64 rows; a CosyVoice 3 llm.pt has the codec's tokens \\+ 200"):
        CosyVoice3LM.from_dir(tiny_cosyvoice2_dir)
    with pytest.raises(ValueError, match="missing keys: llm_embedding.weight, llm_decoder.bias"):
        CosyVoice2LM.from_dir(tiny_cosyvoice3_dir)


def test_missing_and_unset_dir_are_clear_errors(tiny_cosyvoice3_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("COSYVOICE3_DIR", raising=False)
    with pytest.raises(
        ValueError, match="target.model.model_dir=/path/to/Fun-CosyVoice3-0.5B.*COSYVOICE3_DIR"
    ):
        CosyVoice3LM.from_dir(None)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        CosyVoice3LM.from_dir(tmp_path / "nowhere")
    no_config = _copy_dir(tiny_cosyvoice3_dir, tmp_path / "no_config")
    (no_config / "CosyVoice-BlankEN" / "config.json").unlink()
    with pytest.raises(
        FileNotFoundError, match="a CosyVoice 3 model dir holds llm.pt and CosyVoice-BlankEN/config"
    ):
        CosyVoice3LM.from_dir(no_config)


class _RunsCodeWhenUnpickled:
    def __reduce__(self):
        return (os.system, ("true",))


def test_checkpoints_are_read_without_code_execution(tiny_cosyvoice3_dir, tmp_path):
    """llm.pt goes through torch.load(weights_only=True): a pickle that would call a function is refused."""
    evil = _copy_dir(tiny_cosyvoice3_dir, tmp_path / "evil")
    state = torch.load(evil / "llm.pt", weights_only=True)
    state["payload"] = _RunsCodeWhenUnpickled()
    torch.save(state, evil / "llm.pt")
    with pytest.raises(
        ValueError,
        match=r"llm.pt was not loaded: a CosyVoice 3 llm.pt holds tensors and plain data "
        r"only, and this file holds objects whose unpickling would run code",
    ):
        CosyVoice3LM.from_dir(evil)


def test_save_dir_round_trip_and_half_precision(model, tmp_path):
    out = model.save_dir(tmp_path / "copy")
    again = CosyVoice3LM.from_dir(out)
    assert list(model.state_dict()) == list(again.state_dict())
    for key, value in model.state_dict().items():
        assert torch.equal(value, again.state_dict()[key]), key
    assert again.instruction_ids == model.instruction_ids
    half = CosyVoice3LM.from_dir(out, dtype="bfloat16")
    prompt = model.make_prompt(["bin blue"])
    _, logits = half.prefill(prompt, 2)
    _, full = model.prefill(prompt, 2)
    assert half.dtype == torch.bfloat16 and logits.dtype == torch.float32
    assert torch.allclose(logits, full, atol=0.3)  # same model, bf16 rounding only


# ---- drafts and configs ---------------------------------------------------------------------------------


def test_layer_subset_draft_of_cosyvoice3_decodes_like_its_layers(model):
    from ssd.drafters.layers import build_draft

    draft = build_draft(model, layers=[0, -1], trainable=["layers.0", "head"])
    assert isinstance(draft.model, CosyVoice3LM) and draft.model.instruction_ids == model.instruction_ids
    assert draft.stop_tokens == model.stop_tokens and draft.vocab_size == S + 200
    trainable = {k for k, p in draft.model.named_parameters() if p.requires_grad}
    assert trainable == {
        k for k in dict(draft.model.named_parameters()) if k.startswith("backbone.layers.0.")
    } | {"llm_decoder.weight"}
    prompt = model.make_prompt(["set red"], ["lay"], [[4]])
    _, logits = draft.model.prefill(prompt, 2)
    assert logits.shape == (1, S + 200) and torch.isfinite(logits).all()
    # with all target layers the draft is the target
    same = build_draft(model, layers=range(LAYERS))
    torch.testing.assert_close(same.model.prefill(prompt, 2)[1], model.prefill(prompt, 2)[1])


def test_target_cosyvoice3_brings_the_v3_tokenizer_its_vocoder_and_judges():
    from ssd.config import compose

    cfg = compose("sweep", ["target=cosyvoice3", "target.model.model_dir=/models/cv3"])
    assert cfg.target.model._target_ == "ssd.models.cosyvoice3.CosyVoice3LM.from_dir"
    assert cfg.speech_tokenizer._target_.endswith("CosyVoice3SpeechTokenizer.load")
    assert cfg.speech_tokenizer.path == "/models/cv3/speech_tokenizer_v3.onnx"
    assert cfg.vocoder.model_class == "CosyVoice3" and cfg.vocoder.model_dir == "/models/cv3"
    assert cfg.sim.onnx_path == "/models/cv3/campplus.onnx" and cfg.asr._target_.endswith("OpenAIWhisperASR")
    assert (cfg.target.sampling.ras_variant, cfg.target.sampling.eos_mode) == ("classic", "resample")


@pytest.mark.parametrize("draft_name", ["cosyvoice3_8layer", "pcg_3layer"])
def test_cosyvoice3_target_and_draft_configs_instantiate(tmp_path, draft_name):
    from hydra.utils import instantiate

    from tests.fixtures_models import make_tiny_cosyvoice3_dir
    from tests.test_model_configs import compose_target_draft, decode_a_few_tokens

    model_dir = make_tiny_cosyvoice3_dir(tmp_path / "deep", num_hidden_layers=24, hidden_size=16,
                                         intermediate_size=16, num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    cfg = compose_target_draft("cosyvoice3", draft_name, f"target.model.model_dir={model_dir}")
    target = instantiate(cfg.target.model)
    sampling = instantiate(cfg.target.sampling, stop_tokens=list(target.stop_tokens))
    assert (
        sampling.stop_tokens == target.stop_tokens and sampling.forbidden_before_min_len == target.stop_tokens
    )
    draft = instantiate(cfg.draft, target=target)
    expected = (0, 1, 18, 19, 20, 21, 22, 23) if draft_name == "cosyvoice3_8layer" else (0, 1, 23)
    assert draft.recipe.layers == expected and draft.recipe.trainable == ("layers.0", "layers.1", "head")
    assert decode_a_few_tokens(draft.model, target.make_prompt(["set red"])).shape == (1, 3)


@pytest.mark.parametrize("family", ["heads", "mtp", "eagle", "block"])
def test_each_drafter_family_decodes_cosyvoice3_under_its_law(tmp_path, family):
    """The drafter families' CosyVoice 3 configs build on its 24 layers and decode through its 200 special
    rows: every emitted token is a speech code or ends the row with a stop token."""
    from hydra.utils import instantiate

    from ssd.decoding.acceptance import ExactRule
    from ssd.decoding.generate import Request, decode_speculative
    from ssd.decoding.observe import Instruments
    from tests.fixtures_models import make_tiny_cosyvoice3_dir
    from tests.test_model_configs import compose_target_draft

    model_dir = make_tiny_cosyvoice3_dir(tmp_path / "deep", num_hidden_layers=24, hidden_size=16,
                                         intermediate_size=16, num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    cfg = compose_target_draft("cosyvoice3", f"{family}_cosyvoice3", f"target.model.model_dir={model_dir}")
    target = instantiate(cfg.target.model)
    sampling = instantiate(cfg.target.sampling, stop_tokens=list(target.stop_tokens))
    drafter = instantiate(cfg.draft, target=target)
    prompt = target.make_prompt(["set red at one"])
    request = Request(prompt, 12, 2, generator=torch.Generator().manual_seed(0))
    result = decode_speculative(target, drafter, request, sampling, ExactRule(), 3, Instruments())
    tokens = result.tokens[0]
    assert 2 <= len(tokens) <= 12 and all(0 <= t < target.speech_token_size for t in tokens)
    assert result.stats.rounds >= 1


def test_static_decode_step_compiles_whole_and_matches_eager(tiny_cosyvoice3_dir):
    """CosyVoice 3's step (speech_embedding rows in, bias-free head out) compiles without a graph break,
    one graph per block length, with the eager path's logits (the script of tests/test_compile.py)."""
    from torch._dynamo.testing import CompileCounter

    from tests.test_compile import PROMPT_SPEECH, PROMPT_TEXTS, SCRIPT, TEXTS, run_script

    torch._dynamo.reset()
    eager, static = CosyVoice3LM.from_dir(tiny_cosyvoice3_dir), CosyVoice3LM.from_dir(tiny_cosyvoice3_dir)
    counter = CompileCounter()
    static.compile_decoding(backend=counter)
    prompt = eager.make_prompt(TEXTS, PROMPT_TEXTS, PROMPT_SPEECH)
    want, _ = run_script(eager, prompt, SCRIPT)
    got, cache = run_script(static, prompt, SCRIPT)
    torch._dynamo.reset()
    assert cache.static and counter.frame_count == 3
    for step, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape and a.shape[-1] == S + 200 and a.dtype == torch.float32
        assert torch.allclose(a, b, atol=1e-5, rtol=0), f"call {step}: {(a - b).abs().max():.2e}"
