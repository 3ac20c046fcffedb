"""X-codec2 (LLaSA's codec): speech tokenizer and vocoder through the `xcodec2` package's model class.

The model: `xcodec2.modeling_xcodec2.XCodec2Model.from_pretrained(model_dir)` (a dir holding its
config.json and model.safetensors, e.g. a download of HKUST-Audio/xcodec2), `encode_code(wav [1, N])` ->
codes [1, 1, T] and `decode_code(codes [1, 1, T])` -> audio [1, 1, N]. 16 kHz audio, one single-codebook
FSQ code (4^8 = 65536 codes, the LLaSA LM's <|s_0|>..<|s_65535|>) per 320 samples: 50 tokens/s.

The package pins torch 2.5 / torchaudio 2.5 and imports torchaudio, so it is an optional extra, installed
without its pins next to a torch that has a torchaudio build (docs/target-llasa.md, "X-codec2"). Its model
class also loads the semantic encoder `facebook/w2v-bert-2.0` by that hub id when it is built: it must be
in the local Hugging Face cache (this project runs with HF_HUB_OFFLINE=1).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np

from ssd.audio.features import resample
from ssd.contracts import VocoderPrompt

SAMPLE_RATE = 16_000
TOKEN_RATE = 50
CODEBOOK_SIZE = 65_536  # FSQ levels [4] * 8
INSTALL = (
    "pip install 'ssd[xcodec2]' && pip install --no-deps xcodec2==0.1.5, plus the torchaudio of your torch "
    "(torch <= 2.11 has one; xcodec2's own requirements pin torch 2.5): docs/target-llasa.md, X-codec2"
)


@functools.lru_cache(maxsize=2)
def _load_model(path: str, device: str) -> Any:
    """One model per (dir, device): the tokenizer and the vocoder of a run share it (w2v-BERT alone is 600 M
    parameters)."""
    try:
        from xcodec2.modeling_xcodec2 import XCodec2Model
    except ImportError as err:
        raise ImportError(f"X-codec2 needs the xcodec2 package ({err}): {INSTALL}") from err
    return XCodec2Model.from_pretrained(path).eval().to(device)


class XCodec2:
    """X-codec2 as both halves of LLaSA's codec: `encode` (SpeechTokenizer) and `vocode` (Vocoder)."""

    sample_rate = SAMPLE_RATE
    token_rate = TOKEN_RATE
    codebook_size = CODEBOOK_SIZE
    samples_per_token = SAMPLE_RATE // TOKEN_RATE

    def __init__(self, path: str | Path | None, device: str = "cpu") -> None:
        if path is None or str(path) in ("", "None"):
            raise ValueError(
                "X-codec2 model dir is not set: set speech_tokenizer.path= / vocoder.path= (or the XCODEC2_DIR "
                "environment variable) to a dir with config.json and model.safetensors (HKUST-Audio/xcodec2)"
            )
        path = Path(path)
        for needed in (path, path / "config.json", path / "model.safetensors"):
            if not needed.exists():
                raise FileNotFoundError(
                    f"{needed} does not exist: an X-codec2 model dir holds config.json and model.safetensors "
                    "(a download of HKUST-Audio/xcodec2)"
                )
        import torch

        self._torch = torch
        self.path, self.device = path, torch.device(device)
        self.model = _load_model(str(path.resolve()), str(self.device))

    @classmethod
    def load(cls, path: str | Path) -> XCodec2:
        """The speech tokenizer's `load(path)` shape (configs/speech_tokenizer/)."""
        return cls(path)

    def encode(self, wav: np.ndarray, sr: int) -> np.ndarray:
        """Mono audio at `sr` -> int64 codes [T] (50 per second of the 16 kHz audio)."""
        audio = self._torch.from_numpy(resample(wav, sr, SAMPLE_RATE))[None].to(self.device)
        codes = self.model.encode_code(audio)
        codes = codes.reshape(-1).cpu().numpy().astype(np.int64)
        return self._checked(codes, "X-codec2 encode_code")

    def vocode(self, tokens: np.ndarray, prompt: VocoderPrompt) -> np.ndarray:
        """Codes [T] -> float32 audio at 16 kHz. As LLaSA's own inference does, the prompt's codes are decoded
        together with the generated ones (the decoder's context then starts in the prompt's voice); the
        prompt's share, 320 samples per prompt code, is cut off."""
        tokens = self._checked(np.asarray(tokens, dtype=np.int64).reshape(-1), "vocode tokens")
        context = self._checked(np.asarray(prompt.tokens, dtype=np.int64).reshape(-1), "prompt tokens")
        codes = self._torch.from_numpy(np.concatenate([context, tokens]))[None, None].to(self.device)
        audio = self.model.decode_code(codes).reshape(-1).float().cpu().numpy()
        return np.ascontiguousarray(audio[len(context) * self.samples_per_token :], dtype=np.float32)

    @staticmethod
    def _checked(codes: np.ndarray, what: str) -> np.ndarray:
        if codes.size and (codes.min() < 0 or codes.max() >= CODEBOOK_SIZE):
            raise ValueError(
                f"{what}: X-codec2 codes must lie in [0, {CODEBOOK_SIZE}), got range [{codes.min()}, {codes.max()}]"
            )
        return codes
