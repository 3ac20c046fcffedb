"""CosyVoice 2's real pipeline beyond the LM: the vocoder follows the checkout's own frontend API (both
upstream generations), cuts the prompt tokens as upstream's frontend does, and the runner's LM prompt gets
the same cut tokens.

The CosyVoice checkouts here are stand-ins written into tmp_path in upstream's module layout, with upstream's
signatures and length arithmetic but no models: the 24 kHz mel has (n + 1440 - 1920) // 480 + 1 frames
(n_fft 1920, hop 480, 720 samples of reflect padding per side), the flow makes 2 mel frames per token and
cuts the prompt's own frames, HiFT makes 480 samples per frame. So a 2.37 s prompt has 118 mel frames and
60 tokens at 25 Hz (rounded up); upstream keeps 59 tokens and 50 new tokens give 48,000 samples (60 prompt
tokens would give 48,960).
"""

from __future__ import annotations

import math
import sys
import textwrap
from types import SimpleNamespace

import numpy as np
import pytest
import soundfile as sf
import torch

from ssd.audio.vocoder import CosyVoice2Vocoder
from ssd.contracts import VocoderPrompt
from tests.fixtures_models import TINY_SPEECH_TOKENS

PROMPT_SR = 24_000
PROMPT_SECONDS = 2.37
RAW_PROMPT_TOKENS = 60  # ceil(2.37 * 25)
UPSTREAM_PROMPT_TOKENS = 59  # min(118 mel frames // 2, 60)
NEW_TOKENS = 50

_FRONTEND_COMMON = '''
"""Stand-in CosyVoiceFrontEnd (tests only): upstream's interface, arithmetic in place of the models."""
import math

import numpy as np
import soundfile as sf
import torch

CALLS = []


def conditioning(speech, sr, truncate):
    n_24k = math.ceil(speech.size * 24000 / sr)
    frames = (n_24k + 1440 - 1920) // 480 + 1
    tokens = math.ceil(speech.size * 25 / sr)
    feat = torch.zeros(1, frames, 80)
    if truncate:
        tokens = min(frames // 2, tokens)
        feat = feat[:, : 2 * tokens]
    rms = float(np.sqrt(np.mean(np.asarray(speech, dtype=np.float64) ** 2)))
    return {
        "prompt_speech_feat": feat,
        "flow_prompt_speech_token": torch.zeros(1, tokens, dtype=torch.int32),
        "flow_embedding": torch.full((1, 192), rms),
    }


class CosyVoiceFrontEnd:
'''

# One frontend_zero_shot per upstream generation (signatures as upstream's at those commits).
FRONTENDS = {
    "path-622a3a1": """
    def frontend_zero_shot(self, tts_text, prompt_text, prompt_wav, resample_rate, zero_shot_spk_id):
        assert zero_shot_spk_id == "", "speaker not in spk2info"
        speech, sr = sf.read(prompt_wav, dtype="float32")
        assert sr >= 16000, "wav sample rate must be at least 16000"
        CALLS.append({"api": "path", "speech": speech, "sr": sr, "text": prompt_text})
        return conditioning(speech, sr, resample_rate == 24000)
""",
    "tensor-spk-id-9fea0f0": """
    def frontend_zero_shot(self, tts_text, prompt_text, prompt_speech_16k, resample_rate, zero_shot_spk_id):
        assert zero_shot_spk_id == "", "speaker not in spk2info"
        assert isinstance(prompt_speech_16k, torch.Tensor) and prompt_speech_16k.ndim == 2
        CALLS.append({"api": "tensor", "speech": prompt_speech_16k[0].numpy(), "sr": 16000, "text": prompt_text})
        return conditioning(prompt_speech_16k[0].numpy(), 16000, resample_rate == 24000)
""",
    "tensor-3581cae": """
    def frontend_zero_shot(self, tts_text, prompt_text, prompt_speech_16k, resample_rate):
        assert isinstance(prompt_speech_16k, torch.Tensor) and prompt_speech_16k.ndim == 2
        CALLS.append({"api": "tensor", "speech": prompt_speech_16k[0].numpy(), "sr": 16000, "text": prompt_text})
        return conditioning(prompt_speech_16k[0].numpy(), 16000, resample_rate == 24000)
""",
    # The first CosyVoice 2 frontend (c693039, 2024-12-12) did not cut the prompt yet.
    "tensor-untruncated-c693039": """
    def frontend_zero_shot(self, tts_text, prompt_text, prompt_speech_16k, resample_rate):
        CALLS.append({"api": "tensor", "speech": prompt_speech_16k[0].numpy(), "sr": 16000, "text": prompt_text})
        return conditioning(prompt_speech_16k[0].numpy(), 16000, False)
""",
    # CosyVoice 1's frontend (2024-09): no resample_rate; fits neither supported generation.
    "cosyvoice1": """
    def frontend_zero_shot(self, tts_text, prompt_text, prompt_speech_16k):
        raise AssertionError("never called")
""",
}

_MODEL = '''
"""Stand-in CosyVoice2Model (tests only): token2wav's interface and output length law."""
import torch


class CosyVoice2Model:
    def __init__(self):
        self.hift_cache_dict = {}
        self.calls = []

    def token2wav(self, token, prompt_token, prompt_feat, embedding, token_offset, uuid, stream=False,
                  finalize=False, speed=1.0):
        assert self.hift_cache_dict[uuid] is None and finalize and token_offset == 0
        self.calls.append({"token": token, "prompt_token": prompt_token, "prompt_feat": prompt_feat})
        # flow: (prompt + new) tokens at 2 mel frames each, minus the prompt's mel; HiFT: 480 samples a frame
        frames = 2 * (prompt_token.shape[1] + token.shape[1]) - prompt_feat.shape[1]
        return embedding[:, :1].expand(1, 480 * frames).clone()
'''

_COSYVOICE = '''
"""Stand-in cosyvoice.cli.cosyvoice (tests only)."""
import matcha  # noqa: F401  (upstream imports from third_party/Matcha-TTS; the path setup must allow it)

from cosyvoice.cli.frontend import CosyVoiceFrontEnd
from cosyvoice.cli.model import CosyVoice2Model


class CosyVoice2:
    def __init__(self, model_dir, load_jit=False, load_trt=False, fp16=False):
        self.sample_rate = 24000
        self.frontend = CosyVoiceFrontEnd()
        self.model = CosyVoice2Model()
'''


def _write_checkout(root, generation):
    files = {
        "cosyvoice/__init__.py": "",
        "cosyvoice/cli/__init__.py": "",
        "cosyvoice/cli/frontend.py": _FRONTEND_COMMON + FRONTENDS[generation],
        "cosyvoice/cli/model.py": _MODEL,
        "cosyvoice/cli/cosyvoice.py": _COSYVOICE,
        "third_party/Matcha-TTS/matcha/__init__.py": "",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text) if rel.endswith("model.py") else text)
    return root


def _model_dir(root):
    root.mkdir(parents=True, exist_ok=True)
    for name in ("flow.pt", "hift.pt"):
        (root / name).write_bytes(b"")  # the stand-in never reads them; the vocoder checks they exist
    return root


@pytest.fixture
def isolated_imports(monkeypatch):
    """Each test imports its own stand-in `cosyvoice`; none leaks into the next."""
    monkeypatch.setattr(sys, "path", list(sys.path))

    def forget():
        for name in [n for n in sys.modules if n.split(".")[0] in ("cosyvoice", "matcha")]:
            del sys.modules[name]

    forget()
    yield
    forget()


def _vocoder(tmp_path, generation):
    repo = _write_checkout(tmp_path / f"CosyVoice-{generation}", generation)
    return CosyVoice2Vocoder(repo, _model_dir(tmp_path / "CosyVoice2-0.5B"))


def _prompt_wav(sr=PROMPT_SR, seconds=PROMPT_SECONDS):
    t = np.arange(round(sr * seconds)) / sr
    return (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)


def _prompt(sr=PROMPT_SR, seconds=PROMPT_SECONDS):
    wav = _prompt_wav(sr, seconds)
    return VocoderPrompt(wav, sr, "lay green", np.arange(math.ceil(wav.size * 25 / sr), dtype=np.int64))


@pytest.mark.usefixtures("isolated_imports")
@pytest.mark.parametrize("generation", [g for g in FRONTENDS if g != "cosyvoice1"])
def test_prompt_cut_as_upstream_and_output_length_for_every_frontend_generation(tmp_path, generation):
    vocoder = _vocoder(tmp_path, generation)
    assert vocoder.frontend_api == ("prompt_wav" if generation.startswith("path") else "prompt_speech_16k")
    prompt = _prompt()
    assert prompt.tokens.size == RAW_PROMPT_TOKENS

    prepared = vocoder.prepare_prompt(prompt)
    np.testing.assert_array_equal(prepared.tokens, prompt.tokens[:UPSTREAM_PROMPT_TOKENS])
    assert prepared.text == prompt.text and prepared.wav is prompt.wav

    new_tokens = np.arange(NEW_TOKENS) % 7
    wav = vocoder.vocode(new_tokens, prepared)
    assert wav.dtype == np.float32 and wav.shape == (48_000,)
    call = vocoder.model.model.calls[-1]
    assert call["prompt_token"].tolist() == [prepared.tokens.tolist()]
    assert call["prompt_feat"].shape == (1, 2 * UPSTREAM_PROMPT_TOKENS, 80)
    assert call["token"].tolist() == [new_tokens.tolist()]
    # The embedding reaching token2wav is the frontend's (the stand-in's is the prompt's RMS, 0.3 / sqrt 2).
    np.testing.assert_allclose(wav, 0.3 / np.sqrt(2), rtol=1e-3)

    # An unprepared prompt is cut the same way; the frontend ran once for all of this (conditioning cached).
    assert vocoder.vocode(new_tokens, prompt).shape == (48_000,)
    frontend_module = sys.modules["cosyvoice.cli.frontend"]
    assert len(frontend_module.CALLS) == 1
    received = frontend_module.CALLS[0]
    assert received["text"] == "lay green"
    if generation.startswith("path"):  # a wav file at the prompt's own rate, samples unchanged
        assert received["sr"] == PROMPT_SR
        np.testing.assert_array_equal(received["speech"], prompt.wav)
    else:  # a [1, samples] tensor at 16 kHz
        assert received["sr"] == 16_000 and received["speech"].size == round(16_000 * PROMPT_SECONDS)


@pytest.mark.usefixtures("isolated_imports")
def test_negative_control_the_uncut_prompt_gives_upstreams_wrong_length(tmp_path):
    """The stand-in's length law tells the two apart: 60 prompt tokens against 118 mel frames (the
    earlier behaviour) give 48,960 samples, not 48,000."""
    vocoder = _vocoder(tmp_path, "tensor-untruncated-c693039")
    prompt = _prompt()
    inputs = vocoder.model.frontend.frontend_zero_shot(
        "", prompt.text, torch.from_numpy(_prompt_wav(16_000))[None], 24_000
    )
    vocoder.model.model.hift_cache_dict["s"] = None
    wav = vocoder.model.model.token2wav(
        token=torch.zeros(1, NEW_TOKENS, dtype=torch.int32),
        prompt_token=torch.as_tensor(prompt.tokens)[None],
        prompt_feat=inputs["prompt_speech_feat"],
        embedding=inputs["flow_embedding"],
        token_offset=0,
        uuid="s",
        finalize=True,
    )
    assert inputs["prompt_speech_feat"].shape[1] == 118 and wav.shape[1] == 48_960


@pytest.mark.usefixtures("isolated_imports")
def test_path_frontend_gets_a_16_khz_file_for_a_low_rate_prompt(tmp_path):
    vocoder = _vocoder(tmp_path, "path-622a3a1")
    prepared = vocoder.prepare_prompt(_prompt(sr=8_000, seconds=2.0))
    received = sys.modules["cosyvoice.cli.frontend"].CALLS[0]
    assert received["sr"] == 16_000 and received["speech"].size == 32_000
    assert prepared.tokens.size == 50  # 2 s: 100 mel frames, 50 tokens -> nothing to cut


@pytest.mark.usefixtures("isolated_imports")
def test_a_checkout_that_fits_neither_generation_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError) as err:
        _vocoder(tmp_path, "cosyvoice1")
    message = str(err.value)
    assert "frontend_zero_shot(tts_text, prompt_text, prompt_speech_16k)" in message  # what it found
    assert "c693039 (2024-12-12)" in message and "622a3a1 (2025-12-08)" in message  # what fits
    assert "vocoder.cosyvoice_repo=" in message


@pytest.mark.usefixtures("isolated_imports")
def test_missing_paths_are_clear_errors_before_any_import(tmp_path):
    with pytest.raises(ValueError, match="vocoder.cosyvoice_repo is not set"):
        CosyVoice2Vocoder(None, tmp_path)
    repo = _write_checkout(tmp_path / "CosyVoice", "path-622a3a1")
    with pytest.raises(FileNotFoundError, match="flow.pt not found.*vocoder.model_dir="):
        CosyVoice2Vocoder(repo, tmp_path / "empty")
    assert "cosyvoice" not in sys.modules


def test_vocoder_and_tokenizer_expose_the_same_codebook():
    from ssd.audio.cosyvoice_tokenizer import CosyVoiceSpeechTokenizer

    assert CosyVoice2Vocoder.codebook_size == CosyVoiceSpeechTokenizer.codebook_size == 6561
    assert CosyVoice2Vocoder.token_rate == CosyVoiceSpeechTokenizer.token_rate == 25


class _CeilTokenizer:
    """25 Hz tokens, rounded up like CosyVoice 2's tokenizer on a 2.37 s prompt (60 tokens)."""

    token_rate, codebook_size = 25, TINY_SPEECH_TOKENS

    def encode(self, wav, sr):
        return np.arange(math.ceil(len(wav) * 25 / sr)) % TINY_SPEECH_TOKENS


@pytest.mark.usefixtures("isolated_imports")
def test_runner_builds_the_lm_prompt_from_the_vocoders_cut_tokens(tmp_path, tiny_cosyvoice2_dir):
    from ssd.evaluation.items import prepare_item
    from ssd.evaluation.models import EvalModels
    from ssd.evaluation.runner import lm_prompt
    from ssd.models.cosyvoice2 import CosyVoice2LM

    wav_path = tmp_path / "prompt.wav"
    sf.write(wav_path, _prompt_wav(), PROMPT_SR, subtype="FLOAT")
    vocoder = _vocoder(tmp_path, "path-622a3a1")
    models = EvalModels(
        target=CosyVoice2LM.from_dir(tiny_cosyvoice2_dir), sampling=None, decoder=None,
        speech_tokenizer=_CeilTokenizer(), vocoder=vocoder, asr=None,
        speaker=SimpleNamespace(embed=lambda wav, sr: np.ones(4, np.float32)), language=None,
    )  # fmt: skip
    pair = SimpleNamespace(
        utt="u1", prompt_utt="p1", prompt_wav=wav_path, prompt_text="lay green", text="bin blue"
    )
    cache = {}
    item = prepare_item(models, 0, 0, pair, None, cache)
    prompt, vprompt = lm_prompt(models, [item]), item.vprompt
    raw = _CeilTokenizer().encode(_prompt_wav(), PROMPT_SR)
    assert raw.size == RAW_PROMPT_TOKENS
    np.testing.assert_array_equal(vprompt.tokens, raw[:UPSTREAM_PROMPT_TOKENS])
    assert prompt.speech_ids[0].tolist() == vprompt.tokens.tolist()  # the LM sees what the flow sees
    assert vocoder.vocode(np.zeros(NEW_TOKENS, np.int64), vprompt).shape == (48_000,)
    prepare_item(models, 0, 1, pair, None, cache)  # the second item with this prompt
    assert len(sys.modules["cosyvoice.cli.frontend"].CALLS) == 1


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_written_model_dir_opens_with_upstreams_qwen2_loader_and_ours(tmp_path, tiny_cosyvoice2_dir, tied):
    """Upstream builds its Qwen2 by Qwen2ForCausalLM.from_pretrained(CosyVoice-BlankEN/), then loads llm.pt
    over the whole LM strictly; both must find the same text-LM weights. Our loader stays strict too."""
    from transformers import Qwen2ForCausalLM

    from ssd.models.cosyvoice2 import CosyVoice2LM
    from tests.fixtures_models import make_tiny_cosyvoice2_dir

    model_dir = (
        tiny_cosyvoice2_dir
        if tied
        else make_tiny_cosyvoice2_dir(tmp_path / "untied", tie_word_embeddings=False)
    )
    qwen, info = Qwen2ForCausalLM.from_pretrained(model_dir / "CosyVoice-BlankEN", output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    llm_pt = torch.load(model_dir / "llm.pt", weights_only=True)
    from_llm_pt = {k.removeprefix("llm.model."): v for k, v in llm_pt.items() if k.startswith("llm.model.")}
    read = qwen.state_dict()
    assert set(read) == set(from_llm_pt)
    for key, value in from_llm_pt.items():
        assert torch.equal(read[key], value), key
    assert (qwen.lm_head.weight is qwen.model.embed_tokens.weight) == tied
    CosyVoice2LM.from_dir(model_dir)  # strict llm.pt load, unchanged
