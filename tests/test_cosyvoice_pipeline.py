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
import shlex
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import soundfile as sf
import torch

from ssd.audio.vocoder import CosyVoice2Vocoder, WorkerError
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
    def __init__(self, get_tokenizer, feat_extractor, campplus_model, speech_tokenizer_model, spk2info="",
                 allowed_special="all"):
        self.tokenizer = get_tokenizer()
        self.speech_tokenizer_model = speech_tokenizer_model

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

# Upstream's model classes, cut to the non-streaming token2wav path; the flow and HiFT below carry one weight
# each (0 until flow.pt / hift.pt are loaded), so the waveform's level shows that the files were loaded.
_MODEL = """
\"\"\"Stand-in cosyvoice.cli.model (tests only): token2wav's interface and output length law.\"\"\"
import torch


class CosyVoice2Model:
    def __init__(self, llm, flow, hift, fp16=False):
        self.device = torch.device("cpu")
        self.llm, self.flow, self.hift, self.fp16 = llm, flow, hift, fp16
        self.llm.to(self.device)  # upstream moves / halves the LM in some versions
        self.hift_cache_dict = {}
        self.calls = []

    def token2wav(self, token, prompt_token, prompt_feat, embedding, token_offset, uuid, stream=False,
                  finalize=False, speed=1.0):
        assert self.hift_cache_dict[uuid] is None and finalize and token_offset == 0
        self.calls.append({"token": token, "prompt_token": prompt_token, "prompt_feat": prompt_feat})
        mel, _ = self.flow.inference(token=token, token_len=torch.tensor([token.shape[1]]), prompt_token=prompt_token,
                                     prompt_token_len=torch.tensor([prompt_token.shape[1]]), prompt_feat=prompt_feat,
                                     prompt_feat_len=torch.tensor([prompt_feat.shape[1]]), embedding=embedding,
                                     streaming=stream, finalize=finalize)
        speech, _ = self.hift.inference(speech_feat=mel, cache_source=torch.zeros(1, 1, 0))
        return speech


class CosyVoice3Model(CosyVoice2Model):
    def token2wav(self, token, prompt_token, prompt_feat, embedding, token_offset, uuid, stream=False,
                  finalize=False, speed=1.0):
        self.calls.append({"token": token, "prompt_token": prompt_token, "prompt_feat": prompt_feat})
        mel, _ = self.flow.inference(token=token, token_len=torch.tensor([token.shape[1]]), prompt_token=prompt_token,
                                     prompt_token_len=torch.tensor([prompt_token.shape[1]]), prompt_feat=prompt_feat,
                                     prompt_feat_len=torch.tensor([prompt_feat.shape[1]]), embedding=embedding,
                                     streaming=stream, finalize=finalize)
        assert self.hift_cache_dict[uuid] is None
        self.hift_cache_dict[uuid] = {"mel": mel, "speech_offset": 0}
        speech, _ = self.hift.inference(speech_feat=mel, finalize=finalize)
        return speech
"""

_FLOW = """
import os
import sys

import torch


class CausalMaskedDiffWithXvec(torch.nn.Module):
    def __init__(self, token_mel_ratio=2, output_size=80):
        super().__init__()
        self.token_mel_ratio, self.output_size = token_mel_ratio, output_size
        self.scale = torch.nn.Parameter(torch.zeros(()))

    def inference(self, token, token_len, prompt_token, prompt_token_len, prompt_feat, prompt_feat_len, embedding,
                  streaming, finalize):
        if (token < 0).any():
            raise ValueError("negative speech token")
        if (token >= 6561).any():
            print("fatal: token beyond the codebook", file=sys.stderr, flush=True)
            os._exit(3)
        # (prompt + new) tokens at 2 mel frames each, minus the prompt's own mel frames
        frames = self.token_mel_ratio * (prompt_token.shape[1] + token.shape[1]) - prompt_feat.shape[1]
        return (embedding[:, :1, None] * self.scale).expand(1, self.output_size, frames).clone(), None


class CausalMaskedDiffWithDiT(CausalMaskedDiffWithXvec):
    pass
"""

_HIFT = """
import torch


class HiFTGenerator(torch.nn.Module):
    def __init__(self, sampling_rate=24000):
        super().__init__()
        self.gain = torch.nn.Parameter(torch.zeros(()))

    def inference(self, speech_feat, cache_source=None):
        # 480 samples per mel frame at 24 kHz
        return (speech_feat.mean(1) * self.gain).repeat_interleave(480, dim=1), None


class CausalHiFTGenerator(HiFTGenerator):
    def inference(self, speech_feat, finalize=True):
        return super().inference(speech_feat)
"""

_LLM = """
class Qwen2LM:
    def __init__(self, **kwargs):
        raise RuntimeError("upstream's LM was built")


CosyVoice3LM = Qwen2LM
"""

_TOKENIZER = """
def get_qwen_tokenizer(token_path, skip_special_tokens):
    assert token_path.endswith("CosyVoice-BlankEN"), token_path
    return object()
"""

# The model dir's HyperPyYAML in upstream's format (the entries token2wav and the frontend read, plus the
# LM's, whose construction must never happen).
_HYPERPYYAML = """
sample_rate: 24000
qwen_pretrain_path: ''
token_mel_ratio: 2
llm: !new:cosyvoice.llm.llm.{llm}
    llm_input_size: 896
flow: !new:cosyvoice.flow.flow.{flow}
    token_mel_ratio: !ref <token_mel_ratio>
hift: !new:cosyvoice.hifigan.generator.{hift}
    sampling_rate: !ref <sample_rate>
get_tokenizer: !name:cosyvoice.tokenizer.tokenizer.get_qwen_tokenizer
    token_path: !ref <qwen_pretrain_path>
    skip_special_tokens: True
allowed_special: 'all'
feat_extractor: !name:matcha.utils.audio.mel_spectrogram
    n_fft: 1920
    sampling_rate: !ref <sample_rate>
"""
MODEL_FILES = {  # model_class -> (yaml, speech tokenizer, LM class, flow class, HiFT class), as upstream's
    "CosyVoice2": ("cosyvoice2.yaml", "speech_tokenizer_v2.onnx", "Qwen2LM", "CausalMaskedDiffWithXvec",
                   "HiFTGenerator"),
    "CosyVoice3": ("cosyvoice3.yaml", "speech_tokenizer_v3.onnx", "CosyVoice3LM", "CausalMaskedDiffWithDiT",
                   "CausalHiFTGenerator"),
}  # fmt: skip
FLOW_SCALE, HIFT_GAIN = 1.5, 2.0  # the stored weights: the waveform is 3x the embedding's value


# Streaming stand-ins: upstream's tts(stream=True) loop, its streaming token2wav (HiFT cache of 8 mel frames and
# their audio, crossfaded under a Hamming window) and CosyVoice 3's (the whole mel rerun, new samples emitted), as
# upstream's model.py reads; a flow whose mel depends on every token (so a wrong prefix or offset shows) and which
# drops the pre-lookahead tokens' frames unless finalizing. "2025": the first chunk padded to the prompt
# (prompt_token_pad) and token2wav(stream=...); "2024-12": neither (CosyVoice 2's first release).
_STREAMING_MODEL = """
\"\"\"Stand-in cosyvoice.cli.model (tests only): upstream's streaming loop and caches, tiny models.\"\"\"
import threading
import time
import uuid

import numpy as np
import torch


def fade_in_out(fade_in_mel, fade_out_mel, window):
    mel_overlap_len = int(window.shape[0] / 2)
    fade_in_mel = fade_in_mel.clone()
    fade_in_mel[..., :mel_overlap_len] = fade_in_mel[..., :mel_overlap_len] * window[:mel_overlap_len] + \\
        fade_out_mel[..., -mel_overlap_len:] * window[mel_overlap_len:]
    return fade_in_mel


class CosyVoice2Model:
    def __init__(self, llm, flow, hift, fp16=False{init_extra}):
        self.device = torch.device("cpu")
        self.llm, self.flow, self.hift, self.fp16 = llm, flow, hift, fp16
        self.token_hop_len = 25
        self.mel_cache_len = 8
        self.source_cache_len = int(self.mel_cache_len * 480)
        self.speech_window = torch.from_numpy(np.hamming(2 * self.source_cache_len)).float()
        self.lock = threading.Lock()
        self.tts_speech_token_dict, self.llm_end_dict, self.hift_cache_dict = {{}}, {{}}, {{}}
        self.calls = []

    def llm_job(self, text, prompt_text, llm_prompt_speech_token, llm_embedding, uuid):
        raise RuntimeError("the stand-in has no LM")

    def token2wav(self, token, prompt_token, prompt_feat, embedding, token_offset, uuid, {stream_param}finalize=False,
                  speed=1.0):
        self.calls.append((token[0].tolist(), token_offset, finalize, {stream_value}))
        tts_mel, _ = self.flow.inference(token=token, token_len=torch.tensor([token.shape[1]]), prompt_token=prompt_token,
                                         prompt_token_len=torch.tensor([prompt_token.shape[1]]), prompt_feat=prompt_feat,
                                         prompt_feat_len=torch.tensor([prompt_feat.shape[1]]), embedding=embedding,
                                         {stream_arg}finalize=finalize)
        tts_mel = tts_mel[:, :, token_offset * self.flow.token_mel_ratio:]
        if self.hift_cache_dict[uuid] is not None:
            hift_cache_mel, hift_cache_source = self.hift_cache_dict[uuid]["mel"], self.hift_cache_dict[uuid]["source"]
            tts_mel = torch.concat([hift_cache_mel, tts_mel], dim=2)
        else:
            hift_cache_source = torch.zeros(1, 1, 0)
        tts_speech, tts_source = self.hift.inference(speech_feat=tts_mel, cache_source=hift_cache_source)
        if self.hift_cache_dict[uuid] is not None:
            tts_speech = fade_in_out(tts_speech, self.hift_cache_dict[uuid]["speech"], self.speech_window)
        if finalize is False:
            self.hift_cache_dict[uuid] = {{"mel": tts_mel[:, :, -self.mel_cache_len:],
                                          "source": tts_source[:, :, -self.source_cache_len:],
                                          "speech": tts_speech[:, -self.source_cache_len:]}}
            tts_speech = tts_speech[:, :-self.source_cache_len]
        return tts_speech

    def tts(self, text=torch.zeros(1, 0, dtype=torch.int32), flow_embedding=torch.zeros(0, 192),
            llm_embedding=torch.zeros(0, 192), prompt_text=torch.zeros(1, 0, dtype=torch.int32),
            llm_prompt_speech_token=torch.zeros(1, 0, dtype=torch.int32),
            flow_prompt_speech_token=torch.zeros(1, 0, dtype=torch.int32), prompt_speech_feat=torch.zeros(1, 0, 80),
            source_speech_token=torch.zeros(1, 0, dtype=torch.int32), stream=False, speed=1.0, **kwargs):
        this_uuid = str(uuid.uuid1())
        with self.lock:
            self.tts_speech_token_dict[this_uuid], self.llm_end_dict[this_uuid] = [], False
            self.hift_cache_dict[this_uuid] = None
        p = threading.Thread(target=self.llm_job, args=(text, prompt_text, llm_prompt_speech_token, llm_embedding,
                                                        this_uuid))
        p.start()
        assert stream is True, "the stand-in streams only"
        token_offset = 0
        {pad_line}
        while True:
            time.sleep(0.1)
            this_token_hop_len = {first_hop} if token_offset == 0 else self.token_hop_len
            if len(self.tts_speech_token_dict[this_uuid]) - token_offset >= this_token_hop_len + self.flow.pre_lookahead_len:
                this_tts_speech_token = torch.tensor(self.tts_speech_token_dict[this_uuid][:token_offset + this_token_hop_len + self.flow.pre_lookahead_len]).unsqueeze(dim=0)
                this_tts_speech = self.token2wav(token=this_tts_speech_token, prompt_token=flow_prompt_speech_token,
                                                 prompt_feat=prompt_speech_feat, embedding=flow_embedding,
                                                 token_offset=token_offset, uuid=this_uuid, {stream_kw}finalize=False)
                token_offset += this_token_hop_len
                yield {{"tts_speech": this_tts_speech.cpu()}}
            if self.llm_end_dict[this_uuid] is True and len(self.tts_speech_token_dict[this_uuid]) - token_offset < this_token_hop_len + self.flow.pre_lookahead_len:
                break
        p.join()
        this_tts_speech_token = torch.tensor(self.tts_speech_token_dict[this_uuid]).unsqueeze(dim=0)
        this_tts_speech = self.token2wav(token=this_tts_speech_token, prompt_token=flow_prompt_speech_token,
                                         prompt_feat=prompt_speech_feat, embedding=flow_embedding,
                                         token_offset=token_offset, uuid=this_uuid, finalize=True)
        yield {{"tts_speech": this_tts_speech.cpu()}}
        with self.lock:
            self.tts_speech_token_dict.pop(this_uuid)
            self.llm_end_dict.pop(this_uuid)
            self.hift_cache_dict.pop(this_uuid)


class CosyVoice3Model(CosyVoice2Model):
    def token2wav(self, token, prompt_token, prompt_feat, embedding, token_offset, uuid, {stream_param}finalize=False,
                  speed=1.0):
        self.calls.append((token[0].tolist(), token_offset, finalize, {stream_value}))
        tts_mel, _ = self.flow.inference(token=token, token_len=torch.tensor([token.shape[1]]), prompt_token=prompt_token,
                                         prompt_token_len=torch.tensor([prompt_token.shape[1]]), prompt_feat=prompt_feat,
                                         prompt_feat_len=torch.tensor([prompt_feat.shape[1]]), embedding=embedding,
                                         {stream_arg}finalize=finalize)
        tts_mel = tts_mel[:, :, token_offset * self.flow.token_mel_ratio:]
        if self.hift_cache_dict[uuid] is not None:
            tts_mel = torch.concat([self.hift_cache_dict[uuid]["mel"], tts_mel], dim=2)
            self.hift_cache_dict[uuid]["mel"] = tts_mel
        else:
            self.hift_cache_dict[uuid] = {{"mel": tts_mel, "speech_offset": 0}}
        tts_speech, _ = self.hift.inference(speech_feat=tts_mel, finalize=finalize)
        tts_speech = tts_speech[:, self.hift_cache_dict[uuid]["speech_offset"]:]
        self.hift_cache_dict[uuid]["speech_offset"] += tts_speech.shape[1]
        return tts_speech
"""

_STREAMING_FLOW = """
import torch


class CausalMaskedDiffWithXvec(torch.nn.Module):
    def __init__(self, token_mel_ratio=2, output_size=80):
        super().__init__()
        self.token_mel_ratio, self.output_size, self.pre_lookahead_len = token_mel_ratio, output_size, 3
        self.scale = torch.nn.Parameter(torch.zeros(()))

    def inference(self, token, token_len, prompt_token, prompt_token_len, prompt_feat, prompt_feat_len, embedding,
                  {stream_param}finalize=False):
        tokens = torch.cat([prompt_token, token], 1).float()
        if not finalize:
            tokens = tokens[:, : tokens.shape[1] - self.pre_lookahead_len]
        # each frame: its token, plus the mean of every token so far (left context), in the prompt's voice
        context = tokens.cumsum(1) / torch.arange(1, tokens.shape[1] + 1)
        frames = (tokens / 100 + context / 1000 + embedding[:, :1]).repeat_interleave(self.token_mel_ratio, dim=1)
        mel = (frames[:, None, prompt_feat.shape[1]:] * self.scale).expand(1, self.output_size, -1).clone()
        return mel, None


class CausalMaskedDiffWithDiT(CausalMaskedDiffWithXvec):
    pass
"""

_STREAMING_HIFT = """
import torch


class HiFTGenerator(torch.nn.Module):
    def __init__(self, sampling_rate=24000):
        super().__init__()
        self.gain = torch.nn.Parameter(torch.zeros(()))

    def inference(self, speech_feat, cache_source=torch.zeros(1, 1, 0)):
        speech = (speech_feat.mean(1) * self.gain).repeat_interleave(480, dim=1)
        ramp = torch.linspace(0, 1e-3, speech.shape[1])[None]  # differs sample by sample
        return speech + ramp, torch.zeros(1, 1, speech.shape[1])


class CausalHiFTGenerator(HiFTGenerator):
    def inference(self, speech_feat, finalize=True):
        return super().inference(speech_feat)
"""


def _streaming_files(pad: bool, stream_arg: bool, flow_cache: bool = False):
    model = _STREAMING_MODEL.format(
        init_extra=", use_flow_cache=False" if flow_cache else "",
        stream_param="stream=False, " if stream_arg else "",
        stream_value="stream" if stream_arg else "None",
        stream_arg="streaming=stream, " if stream_arg else "",
        stream_kw="stream=stream, " if stream_arg else "",
        pad_line=(
            "prompt_token_pad = int(np.ceil(flow_prompt_speech_token.shape[1] / self.token_hop_len) * "
            "self.token_hop_len - flow_prompt_speech_token.shape[1])"
        ) if pad else "",
        first_hop="self.token_hop_len + prompt_token_pad" if pad else "self.token_hop_len",
    )  # fmt: skip
    flow = _STREAMING_FLOW.format(stream_param="streaming=False, " if stream_arg else "")
    return model, flow, _STREAMING_HIFT


STREAMING = {
    "2025": _streaming_files(pad=True, stream_arg=True),
    "2024-12": _streaming_files(pad=False, stream_arg=False),
    "flow-cache": _streaming_files(pad=True, stream_arg=True, flow_cache=True),
}


def _write_checkout(root, generation, streaming=None):
    model, flow, hift = (_MODEL, _FLOW, _HIFT) if streaming is None else STREAMING[streaming]
    files = {
        "cosyvoice/__init__.py": "",
        "cosyvoice/cli/__init__.py": "",
        "cosyvoice/cli/frontend.py": _FRONTEND_COMMON + FRONTENDS[generation],
        "cosyvoice/cli/model.py": model,
        "cosyvoice/llm/__init__.py": "",
        "cosyvoice/llm/llm.py": _LLM,
        "cosyvoice/flow/__init__.py": "",
        "cosyvoice/flow/flow.py": flow,
        "cosyvoice/hifigan/__init__.py": "",
        "cosyvoice/hifigan/generator.py": hift,
        "cosyvoice/tokenizer/__init__.py": "",
        "cosyvoice/tokenizer/tokenizer.py": _TOKENIZER,
        "third_party/Matcha-TTS/matcha/__init__.py": "",
        "third_party/Matcha-TTS/matcha/utils/__init__.py": "",
        "third_party/Matcha-TTS/matcha/utils/audio.py": "def mel_spectrogram(y, n_fft, sampling_rate):\n    pass\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def _model_dir(root, model_class="CosyVoice2", yaml_text=None):
    config, tokenizer, llm, flow, hift = MODEL_FILES[model_class]
    root.mkdir(parents=True, exist_ok=True)
    (root / config).write_text(yaml_text or _HYPERPYYAML.format(llm=llm, flow=flow, hift=hift))
    torch.save({"scale": torch.tensor(FLOW_SCALE)}, root / "flow.pt")
    torch.save({"generator.gain": torch.tensor(HIFT_GAIN)}, root / "hift.pt")  # upstream strips "generator."
    for name in ("campplus.onnx", tokenizer):
        (root / name).write_bytes(b"")  # the stand-in frontend never opens them
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


def _vocoder(tmp_path, generation, model_class="CosyVoice2", python=None, streaming=None):
    repo = _write_checkout(tmp_path / f"CosyVoice-{generation}", generation, streaming)
    model_dir = _model_dir(tmp_path / f"{model_class}-0.5B", model_class)
    return CosyVoice2Vocoder(repo, model_dir, python=python, model_class=model_class)


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
    call = vocoder.engine.model.calls[-1]
    assert call["prompt_token"].tolist() == [prepared.tokens.tolist()]
    assert call["prompt_feat"].shape == (1, 2 * UPSTREAM_PROMPT_TOKENS, 80)
    assert call["token"].tolist() == [new_tokens.tolist()]
    # The embedding reaching token2wav is the frontend's (the stand-in's is the prompt's RMS, 0.3 / sqrt 2),
    # through the flow and HiFT weights of flow.pt and hift.pt.
    np.testing.assert_allclose(wav, FLOW_SCALE * HIFT_GAIN * 0.3 / np.sqrt(2), rtol=1e-3)

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
    inputs = vocoder.engine.frontend.frontend_zero_shot(
        "", prompt.text, torch.from_numpy(_prompt_wav(16_000))[None], 24_000
    )
    vocoder.engine.model.hift_cache_dict["s"] = None
    wav = vocoder.engine.model.token2wav(
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
    with pytest.raises(FileNotFoundError, match="cosyvoice2.yaml not found.*vocoder.model_dir="):
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
    from ssd.evaluation.batch import lm_prompt
    from ssd.evaluation.items import prepare_item
    from ssd.evaluation.models import EvalModels
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


# --- upstream's LM is never built; CosyVoice 3; the worker in another Python ----------------------------------


@pytest.mark.usefixtures("isolated_imports")
def test_upstreams_lm_is_never_built_and_its_loader_would_build_it(tmp_path):
    """The stand-in LM raises when constructed. The vocoder builds flow, HiFT and frontend from the model dir's
    HyperPyYAML without it; loading that file as upstream's CosyVoice2 does (negative control) builds it."""
    vocoder = _vocoder(tmp_path, "path-622a3a1")
    assert type(vocoder.engine.model.llm) is torch.nn.Module and not list(
        vocoder.engine.model.llm.parameters()
    )
    assert (
        vocoder.engine.model.flow.scale.item() == FLOW_SCALE
        and vocoder.engine.model.hift.gain.item() == HIFT_GAIN
    )
    from hyperpyyaml import load_hyperpyyaml

    with (
        open(tmp_path / "CosyVoice2-0.5B" / "cosyvoice2.yaml") as f,
        pytest.raises(RuntimeError, match="LM was built"),
    ):
        load_hyperpyyaml(f, overrides={"qwen_pretrain_path": "x/CosyVoice-BlankEN"})


@pytest.mark.usefixtures("isolated_imports")
@pytest.mark.parametrize("python", [None, sys.executable], ids=["in-process", "worker"])
def test_cosyvoice3_builds_its_own_classes_and_files(tmp_path, python):
    """model_class=CosyVoice3: cosyvoice3.yaml, CosyVoice3Model's token2wav (its own HiFT cache), the flow with
    DiT and the causal HiFT, speech_tokenizer_v3.onnx for the frontend; same prompt cut and length law."""
    vocoder = _vocoder(tmp_path, "path-622a3a1", model_class="CosyVoice3", python=python)
    prompt = vocoder.prepare_prompt(_prompt())
    assert prompt.tokens.size == UPSTREAM_PROMPT_TOKENS
    wav = vocoder.vocode(np.arange(NEW_TOKENS) % 7, prompt)
    assert wav.shape == (48_000,)
    np.testing.assert_allclose(wav, FLOW_SCALE * HIFT_GAIN * 0.3 / np.sqrt(2), rtol=1e-3)
    if python is None:
        engine = vocoder.engine
        assert type(engine.model).__name__ == "CosyVoice3Model"
        assert type(engine.model.flow).__name__ == "CausalMaskedDiffWithDiT"
        assert type(engine.model.hift).__name__ == "CausalHiFTGenerator"
        assert engine.frontend.speech_tokenizer_model.endswith("speech_tokenizer_v3.onnx")
        assert engine.model.hift_cache_dict == {}  # the session's HiFT cache is dropped after each call
    vocoder.close()


@pytest.mark.usefixtures("isolated_imports")
@pytest.mark.parametrize("generation", ["path-622a3a1", "tensor-spk-id-9fea0f0"])
def test_worker_gives_what_in_process_gives(tmp_path, generation):
    """vocoder.python=<another Python>: the same cut tokens and the same samples as in this process, the
    frontend run once per prompt (the conditioning is cached on this side)."""
    here = _vocoder(tmp_path / "here", generation)
    there = _vocoder(tmp_path / "there", generation, python=sys.executable)
    assert there.frontend_api == here.frontend_api and there.sample_rate == here.sample_rate == 24_000
    prompt = _prompt(sr=44_100)
    new_tokens = np.arange(NEW_TOKENS) % 7
    prepared = there.prepare_prompt(prompt)
    np.testing.assert_array_equal(prepared.tokens, here.prepare_prompt(prompt).tokens)
    np.testing.assert_array_equal(there.vocode(new_tokens, prepared), here.vocode(new_tokens, prepared))
    assert len(there._conditioning) == 1
    there.close()
    assert there.engine._process.poll() == 0  # ended cleanly on EOF


@pytest.mark.usefixtures("isolated_imports")
def test_worker_errors_carry_the_traceback_and_a_command_that_reproduces_them(tmp_path):
    vocoder = _vocoder(tmp_path, "path-622a3a1", python=sys.executable)
    prompt = vocoder.prepare_prompt(_prompt())
    with pytest.raises(WorkerError) as err:
        vocoder.vocode(np.array([3, -1, 4]), prompt)
    message = str(err.value)
    assert "ValueError: negative speech token" in message
    assert "--- worker traceback ---" in message and "cosyvoice/flow/flow.py" in message
    command = message.split("Reproduce: ", 1)[1].strip()
    assert "--replay" in command
    rerun = subprocess.run(shlex.split(command), capture_output=True, text=True, timeout=120)
    assert rerun.returncode != 0 and "ValueError: negative speech token" in rerun.stderr
    # The worker survives a failed request.
    assert vocoder.vocode(np.arange(NEW_TOKENS) % 7, prompt).shape == (48_000,)

    with pytest.raises(
        WorkerError,
        match=r"(?s)exited with code 3 during token2wav.*fatal: token beyond the codebook.*--replay",
    ):
        vocoder.vocode(np.array([6561]), prompt)


@pytest.mark.usefixtures("isolated_imports")
def test_worker_start_errors_name_the_python_and_a_check_command(tmp_path):
    repo = _write_checkout(tmp_path / "CosyVoice", "path-622a3a1")
    broken = _HYPERPYYAML.format(llm="Qwen2LM", flow="NoSuchFlow", hift="HiFTGenerator")
    model_dir = _model_dir(tmp_path / "CosyVoice2-0.5B", yaml_text=broken)
    with pytest.raises(WorkerError) as err:
        CosyVoice2Vocoder(repo, model_dir, python=sys.executable)
    message = str(err.value)
    assert (
        "failed during start" in message and "NoSuchFlow" in message and "--- worker traceback ---" in message
    )
    command = message.split("Reproduce: ", 1)[1].strip()
    assert command.endswith("--check")
    rerun = subprocess.run(shlex.split(command), capture_output=True, text=True, timeout=120)
    assert rerun.returncode != 0 and "NoSuchFlow" in rerun.stderr
    with pytest.raises(FileNotFoundError, match="vocoder.python=/no/such/python is not an executable Python"):
        CosyVoice2Vocoder(repo, model_dir, python="/no/such/python")


def test_worker_script_needs_only_the_standard_library_at_import():
    """The worker runs in the CosyVoice environment, where ssd is not installed: the file imports nothing from
    ssd, and only the standard library before a Token2Wav is built."""
    import ast

    from ssd.audio import cosyvoice_token2wav

    tree = ast.parse(open(cosyvoice_token2wav.__file__).read())
    every = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    every |= {
        node.module.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module
    }
    assert "ssd" not in every
    top = {
        alias.name.split(".")[0] for node in tree.body if isinstance(node, ast.Import) for alias in node.names
    }
    top |= {
        node.module.split(".")[0] for node in tree.body if isinstance(node, ast.ImportFrom) and node.module
    }
    assert top <= set(sys.stdlib_module_names) | {"__future__"}, top - set(sys.stdlib_module_names)


# --- streaming: the checkout's own tts(stream=True) for the same tokens -------------------------------------------


def _check_script():
    """scripts/check_cosyvoice_streaming.py (the same comparison, for a real checkout)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "scripts" / "check_cosyvoice_streaming.py"
    spec = importlib.util.spec_from_file_location("check_cosyvoice_streaming", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


STREAM_TOKENS = 130  # 59 prompt tokens: chunks of 41 (25 + the pad of 16), 25, 25, then the rest


@pytest.mark.usefixtures("isolated_imports")
@pytest.mark.parametrize("model_class", ["CosyVoice2", "CosyVoice3"])
@pytest.mark.parametrize("release", ["2025", "2024-12"])
def test_streamed_chunks_equal_the_checkouts_own_streaming_tts(tmp_path, release, model_class):
    """Pushed in random splits of 1-9 tokens (as speculative rounds deliver them), the vocoder's stream makes the
    checkout's own token2wav calls of its tts(stream=True) loop, one by one (tokens, token_offset, finalize, the
    stream flag where token2wav takes one), and its chunks equal that loop's sample for sample; the HiFT cache is
    gone after the last chunk. The schedule is read off the checkout: the first chunk padded to the prompt where
    its tts pads it (2025), not where it does not (2024-12)."""
    from ssd.audio.streaming import ChunkSchedule

    vocoder = _vocoder(tmp_path, "path-622a3a1", model_class=model_class, streaming=release)
    new = release == "2025"
    assert vocoder.streaming == {"supported": True, "why": None, "token_hop_len": 25, "pre_lookahead_len": 3,
                                 "align_prompt": new, "stream_arg": new}  # fmt: skip
    prompt = vocoder.prepare_prompt(_prompt())
    tokens = np.random.default_rng(0).integers(0, 6561, STREAM_TOKENS)
    check, model = _check_script(), vocoder.engine.model

    mine = check.ours(vocoder, tokens, prompt, seed=1)
    our_calls, model.calls = model.calls, []
    assert model.hift_cache_dict == {}
    theirs = check.upstream_tts_stream(model, tokens, *vocoder._prepared(prompt), per_poll=2)
    assert our_calls == model.calls
    schedule = ChunkSchedule(align_prompt=new).chunks(STREAM_TOKENS, UPSTREAM_PROMPT_TOKENS)
    assert [(len(t), offset, final) for t, offset, final, _ in our_calls] == schedule
    assert [stream for *_, stream in our_calls] == [True] * (len(schedule) - 1) + [False] if new else [None] * len(
        schedule)  # fmt: skip
    assert len(mine) == len(theirs) == len(schedule) >= 4
    for a, b in zip(mine, theirs):
        np.testing.assert_array_equal(a, b)
    assert np.concatenate(mine).size == STREAM_TOKENS * 960  # 40 ms a token at 24 kHz, as one-shot
    assert check.compare(vocoder, tokens, prompt, per_poll=1, seed=2)["equal"]


@pytest.mark.usefixtures("isolated_imports")
def test_negative_control_a_stream_without_the_prompt_pad_differs_from_the_checkouts(tmp_path):
    """The comparison tells schedules apart: the 2025 checkout's tts pads its first chunk; a stream that does not
    (align_prompt off) makes other calls and other audio."""
    from ssd.audio.vocoder import CosyVoiceStream

    vocoder = _vocoder(tmp_path, "path-622a3a1", streaming="2025")
    prompt = vocoder.prepare_prompt(_prompt())
    tokens = np.random.default_rng(0).integers(0, 6561, STREAM_TOKENS)
    check = _check_script()
    theirs = check.upstream_tts_stream(vocoder.engine.model, tokens, *vocoder._prepared(prompt))
    from ssd.audio.streaming import ChunkSchedule

    wrong = CosyVoiceStream(vocoder.engine, ChunkSchedule(align_prompt=False), *vocoder._prepared(prompt))
    mine = [*wrong.push(tokens), *wrong.finish()]
    assert [c.size for c in mine] != [c.size for c in theirs]


@pytest.mark.usefixtures("isolated_imports")
def test_the_worker_streams_what_the_process_streams(tmp_path):
    here = _vocoder(tmp_path / "here", "path-622a3a1", streaming="2025")
    there = _vocoder(tmp_path / "there", "path-622a3a1", python=sys.executable, streaming="2025")
    assert there.streaming == here.streaming
    prompt = here.prepare_prompt(_prompt())
    tokens = np.random.default_rng(3).integers(0, 6561, 90)
    check = _check_script()
    a, b = check.ours(here, tokens, prompt, seed=4), check.ours(there, tokens, prompt, seed=5)
    assert len(a) == len(b) >= 3
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    abandoned = there.stream(prompt)  # a session dropped mid-utterance frees its cache in the worker
    assert abandoned.push(tokens[:60]) and abandoned.open
    abandoned._close()
    assert not abandoned.open
    there.close()


@pytest.mark.usefixtures("isolated_imports")
def test_streaming_a_checkout_it_cannot_follow_is_a_clear_error(tmp_path):
    flow_cache = _vocoder(tmp_path / "a", "path-622a3a1", streaming="flow-cache")
    assert not flow_cache.streaming["supported"]
    with pytest.raises(ValueError, match="eval.streaming=true: .*flow cache"):
        flow_cache.stream(flow_cache.prepare_prompt(_prompt()))


@pytest.mark.usefixtures("isolated_imports")
def test_streaming_a_checkout_without_a_streaming_loop_is_a_clear_error(tmp_path):
    plain = _vocoder(tmp_path, "path-622a3a1")  # the non-streaming stand-in: no tts loop to follow
    with pytest.raises(ValueError, match="no streaming tts"):
        plain.stream(plain.prepare_prompt(_prompt()))
    assert plain.vocode(np.arange(NEW_TOKENS) % 7, plain.prepare_prompt(_prompt())).shape == (48_000,)
