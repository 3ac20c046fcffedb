"""Speaker-embedding judges behind `embed(wav, sr) -> L2-normalised np.ndarray`; SIM = `similarity(a, b)`.

Backends: resemblyzer (weights ship in its wheel; the toy default), CAM++ from CosyVoice 2's
`campplus.onnx` through onnxruntime on the same Kaldi fbank CosyVoice's frontend computes, and a WavLM
x-vector from a local transformers directory. Audio is resampled to 16 kHz for every backend.
Each backend is a Hydra `_target_` (configs/sim/); its constructor checks paths before importing anything heavy.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np

from ssd.audio.fbank import kaldi_fbank
from ssd.audio.features import resample

SPEAKER_SAMPLE_RATE = 16_000


def _unit(vector: np.ndarray, what: str) -> np.ndarray:
    vector = np.asarray(vector, dtype=np.float32).reshape(-1)
    norm = float(np.linalg.norm(vector))
    if not np.isfinite(norm) or norm == 0.0:
        raise ValueError(f"{what} produced a zero or non-finite embedding (silent or too short audio?)")
    return vector / norm


def similarity(a: np.ndarray, b: np.ndarray) -> float:
    """Cosine similarity of two speaker embeddings (re-normalised, so raw vectors work too)."""
    a, b = np.asarray(a, dtype=np.float64).reshape(-1), np.asarray(b, dtype=np.float64).reshape(-1)
    if a.shape != b.shape:
        raise ValueError(
            f"similarity: embeddings differ in size, {a.shape} vs {b.shape} (different backends?)"
        )
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _speech_16k(wav: np.ndarray, sr: int, min_seconds: float, backend: str) -> np.ndarray:
    audio = resample(wav, sr, SPEAKER_SAMPLE_RATE)
    if audio.size < min_seconds * SPEAKER_SAMPLE_RATE:
        raise ValueError(
            f"{backend}: audio is {audio.size / SPEAKER_SAMPLE_RATE:.3f} s long; need at least {min_seconds} s"
        )
    return audio


class ResemblyzerSpeaker:
    """resemblyzer's GE2E VoiceEncoder (256-d), after its own silence trimming and volume normalisation."""

    def __init__(self, device: str = "cpu") -> None:
        try:
            # webrtcvad's own pkg_resources deprecation notice, not ours to fix
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="pkg_resources is deprecated", category=UserWarning)
                from resemblyzer import VoiceEncoder, preprocess_wav
        except ImportError as err:  # webrtcvad imports pkg_resources, which setuptools >= 81 no longer ships
            raise ImportError(
                f"resemblyzer failed to import ({err}); install it with `pip install resemblyzer 'setuptools<81'` "
                "(its webrtcvad dependency needs pkg_resources) or replace webrtcvad by `webrtcvad-wheels`"
            ) from err
        self._preprocess = preprocess_wav
        self.encoder = VoiceEncoder(device=device, verbose=False)

    def embed(self, wav: np.ndarray, sr: int) -> np.ndarray:
        audio = self._preprocess(_speech_16k(wav, sr, 0.1, "resemblyzer"), source_sr=SPEAKER_SAMPLE_RATE)
        if audio.size == 0:
            raise ValueError("resemblyzer: no speech left after its silence trimming")
        return _unit(self.encoder.embed_utterance(audio), "resemblyzer")


class CamPlusSpeaker:
    """CAM++ (`campplus.onnx` from the CosyVoice 2 model dir): mean-normalised 80-bin Kaldi fbank -> 192-d."""

    def __init__(self, onnx_path: str | os.PathLike, num_threads: int = 1) -> None:
        onnx_path = Path(str(onnx_path))  # None (unset) reads as a missing file
        if not onnx_path.is_file():
            raise FileNotFoundError(
                f"CAM++ onnx_path={onnx_path}: no such file (campplus.onnx of CosyVoice 2)"
            )
        from ssd.audio.onnx import onnx_session

        self.session = onnx_session(onnx_path, int(num_threads))
        inputs = self.session.get_inputs()
        shape = inputs[0].shape
        if len(inputs) != 1 or len(shape) != 3 or shape[2] != 80:
            found = [(i.name, i.shape) for i in inputs]
            raise ValueError(f"{onnx_path}: expected one input of shape [batch, frames, 80], found {found}")
        self.input_name = inputs[0].name

    def embed(self, wav: np.ndarray, sr: int) -> np.ndarray:
        audio = _speech_16k(wav, sr, 0.025, "CAM++")
        feat = kaldi_fbank(audio, sample_rate=SPEAKER_SAMPLE_RATE, num_mel_bins=80)
        feat = feat - feat.mean(dim=0, keepdim=True)
        (embedding, *_) = self.session.run(None, {self.input_name: feat.unsqueeze(0).numpy()})
        return _unit(embedding, "CAM++")


class WavLMSpeaker:
    """WavLM x-vector head (`WavLMForXVector`, e.g. microsoft/wavlm-base-plus-sv) from a local directory."""

    def __init__(self, model_dir: str | os.PathLike, device: str = "cpu") -> None:
        model_dir = Path(str(model_dir))  # None (unset) reads as a missing dir
        for name in ("config.json", "preprocessor_config.json"):
            if not (model_dir / name).is_file():
                raise FileNotFoundError(
                    f"WavLM model_dir={model_dir} has no {name}; save both the model and its feature extractor there"
                )
        import torch
        from transformers import AutoFeatureExtractor, WavLMForXVector

        self._torch = torch
        self.device = torch.device(device)
        self.feature_extractor = AutoFeatureExtractor.from_pretrained(str(model_dir), local_files_only=True)
        self.model = (
            WavLMForXVector.from_pretrained(str(model_dir), local_files_only=True).to(self.device).eval()
        )

    def embed(self, wav: np.ndarray, sr: int) -> np.ndarray:
        audio = _speech_16k(wav, sr, 0.1, "WavLM")
        inputs = self.feature_extractor(audio, sampling_rate=SPEAKER_SAMPLE_RATE, return_tensors="pt")
        with self._torch.inference_mode():
            output = self.model(**{k: v.to(self.device) for k, v in inputs.items()})
        return _unit(output.embeddings[0].float().cpu().numpy(), "WavLM")
