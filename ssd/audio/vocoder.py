"""Speech tokens -> waveform, behind one small interface: `vocode(tokens, prompt) -> (wav, sample_rate)`.

Backends:
  toy         the toy codec's decoder (ssd/audio/toy_codec.py), conditioned on the prompt audio's voice.
  cosyvoice2  CosyVoice 2's flow matching + HiFT, imported from a user-provided CosyVoice checkout
              (`vocoder.cosyvoice_repo=`) with the model dir (`vocoder.model_dir=`). It follows upstream's
              zero-shot path: the flow is conditioned on the prompt's speech tokens, its 24 kHz mel and its
              CAM++ embedding (`frontend_zero_shot`), then `model.token2wav(..., token_offset=0, finalize=True)`.

`load_vocoder(cfg)` checks every path before importing anything heavy, so a runner fails fast.
"""

from __future__ import annotations

import inspect
import sys
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ssd.audio.asr import as_plain_dict


@dataclass
class VocoderPrompt:
    """What a zero-shot vocoder may condition on: the prompt's audio, text and speech tokens."""

    wav: np.ndarray  # float32 mono
    sample_rate: int
    text: str
    tokens: np.ndarray  # int64 [T] in the target's speech-token ids


class Vocoder(Protocol):
    sample_rate: int

    def vocode(self, tokens: np.ndarray, prompt: VocoderPrompt) -> np.ndarray: ...


class ToyVocoder:
    """The toy codec's decoder; the prompt's tokens are left context and its audio sets the voice."""

    def __init__(self, codec_dir: str | Path) -> None:
        from ssd.audio.toy_codec import ToyCodec

        self.codec = ToyCodec.load(codec_dir)
        self.sample_rate = self.codec.sample_rate

    def vocode(self, tokens: np.ndarray, prompt: VocoderPrompt) -> np.ndarray:
        wav = prompt.wav
        if prompt.sample_rate != self.sample_rate:
            from scipy.signal import resample_poly

            wav = resample_poly(wav, self.sample_rate, prompt.sample_rate).astype(np.float32)
        return self.codec.decode(np.asarray(tokens, dtype=np.int64), prompt.tokens, wav)


class CosyVoice2Vocoder:
    """CosyVoice 2 flow + HiFT from a CosyVoice checkout (the LM is ours; only token2wav is upstream's)."""

    def __init__(self, cosyvoice_repo: str | Path, model_dir: str | Path, fp16: bool = False) -> None:
        repo, model_dir = Path(cosyvoice_repo), Path(model_dir)
        for path in (
            repo / "cosyvoice" / "cli" / "cosyvoice.py",
            model_dir / "flow.pt",
            model_dir / "hift.pt",
        ):
            if not path.is_file():
                raise FileNotFoundError(
                    f"{path} not found: vocoder=cosyvoice2 needs vocoder.cosyvoice_repo=<a CosyVoice git checkout> "
                    "and vocoder.model_dir=<CosyVoice2-0.5B dir with flow.pt, hift.pt, campplus.onnx>"
                )
        for extra in (repo, repo / "third_party" / "Matcha-TTS"):  # upstream's own import setup
            if str(extra) not in sys.path:
                sys.path.insert(0, str(extra))
        import torch
        from cosyvoice.cli.cosyvoice import CosyVoice2

        self._torch = torch
        self.model = CosyVoice2(str(model_dir), load_jit=False, load_trt=False, fp16=fp16)
        self.sample_rate = int(self.model.sample_rate)

    def vocode(self, tokens: np.ndarray, prompt: VocoderPrompt) -> np.ndarray:
        torch = self._torch
        from ssd.audio.asr import to_mono_16k

        speech_16k = torch.from_numpy(to_mono_16k(prompt.wav, prompt.sample_rate))[None]
        # The flow's conditioning exactly as upstream's zero-shot inference builds it (tts text unused here).
        # Upstream added a 5th argument (zero_shot_spk_id) in 2025; pass it only where it exists.
        frontend = self.model.frontend.frontend_zero_shot
        extra = ("",) if "zero_shot_spk_id" in inspect.signature(frontend).parameters else ()
        inputs = frontend("", prompt.text, speech_16k, self.sample_rate, *extra)
        session = str(uuid.uuid1())
        self.model.model.hift_cache_dict[session] = None
        try:
            wav = self.model.model.token2wav(
                token=torch.as_tensor(np.asarray(tokens), dtype=torch.int32)[None],
                prompt_token=torch.as_tensor(np.asarray(prompt.tokens), dtype=torch.int32)[None],
                prompt_feat=inputs["prompt_speech_feat"],
                embedding=inputs["flow_embedding"],
                token_offset=0,
                uuid=session,
                finalize=True,
            )
        finally:
            self.model.model.hift_cache_dict.pop(session, None)
        return wav.squeeze(0).float().cpu().numpy()


def load_vocoder(cfg: Mapping[str, Any]) -> Vocoder:
    """`{backend: toy, codec_dir}` or `{backend: cosyvoice2, cosyvoice_repo, model_dir, fp16}`."""
    cfg = as_plain_dict(cfg)
    backend = cfg.get("backend")
    if backend == "toy":
        codec_dir = cfg.get("codec_dir")
        if codec_dir is None or not Path(codec_dir).is_dir():
            raise FileNotFoundError(
                f"vocoder.codec_dir={codec_dir}: no toy codec there; build the toy world "
                "(python scripts/build_toy_world.py) or set vocoder.codec_dir"
            )
        return ToyVocoder(codec_dir)
    if backend == "cosyvoice2":
        for key in ("cosyvoice_repo", "model_dir"):
            if not cfg.get(key):
                raise ValueError(f"vocoder.{key} is not set (vocoder.backend=cosyvoice2)")
        return CosyVoice2Vocoder(cfg["cosyvoice_repo"], cfg["model_dir"], bool(cfg.get("fp16", False)))
    raise ValueError(f"vocoder.backend must be 'toy' or 'cosyvoice2', got {backend!r}")
