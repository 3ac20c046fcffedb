"""CosyVoice's speech tokenizers through onnxruntime: `speech_tokenizer_v2.onnx` (CosyVoice 2) and
`speech_tokenizer_v3.onnx` (CosyVoice 3). Both are 25 Hz FSQ tokenizers of 6561 codes with one signature.

Fed exactly as CosyVoice's frontend (`CosyVoiceFrontEnd._extract_speech_token`, one function for both) feeds it: the 128-bin
Whisper log-mel of 16 kHz audio as input 0 (`feats`, float32 [1, 128, T]) and its frame count as
input 1 (`feats_length`, int32 [1]); output 0 (`indices`) flattened is the 25 Hz token sequence.
Inputs are addressed by position, like the frontend does, so a re-exported model with other names
still works; their dtypes and ranks are checked when the model is loaded.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ssd.audio.features import N_MELS, SAMPLE_RATE, resample, whisper_log_mel

MODEL_FILENAME = "speech_tokenizer_v2.onnx"
MODEL_FILENAME_V3 = "speech_tokenizer_v3.onnx"


class CosyVoiceSpeechTokenizer:
    """Audio -> CosyVoice 2 speech tokens (25 Hz, ids 0..6560). Same `encode` as the toy codec."""

    token_rate = 25
    codebook_size = 6561  # FSQ, 3^8 levels: the CosyVoice 2 LM's speech_token_size
    sample_rate = SAMPLE_RATE
    max_seconds = 30.0  # the model's limit; CosyVoice's own extraction tool refuses longer audio too
    model_filename = MODEL_FILENAME
    model_name = "CosyVoice 2"
    model_dir_name = "CosyVoice2-0.5B"

    def __init__(self, onnx_path: str | Path, num_threads: int = 1, providers: list[str] | None = None):
        from ssd.audio.onnx import onnx_session

        path = Path(onnx_path)
        if path.is_dir():
            path = path / self.model_filename
        if not path.is_file():
            raise FileNotFoundError(
                f"{self.model_name} speech tokenizer not found at {path}: pass the path of {self.model_filename} "
                f"(or the {self.model_dir_name} model directory that contains it)"
            )
        self.path = path
        self.session = onnx_session(path, num_threads, providers)
        self._check_signature()

    @classmethod
    def load(cls, path: str | Path) -> CosyVoiceSpeechTokenizer:
        """Load from the .onnx file or the model dir that holds it (the toy codec's `load` shape)."""
        return cls(path)

    def _check_signature(self) -> None:
        inputs = self.session.get_inputs()
        if len(inputs) != 2:
            raise ValueError(
                f"{self.path}: expected 2 inputs (feats float32 [1, {N_MELS}, T], feats_length int32 [1]), "
                f"got {[(i.name, i.type, i.shape) for i in inputs]}"
            )
        feats, lengths = inputs
        if feats.type != "tensor(float)" or len(feats.shape) != 3:
            raise ValueError(
                f"{self.path}: input 0 '{feats.name}' must be float32 of rank 3, got {feats.type} {feats.shape}"
            )
        if isinstance(feats.shape[1], int) and feats.shape[1] != N_MELS:
            raise ValueError(
                f"{self.path}: input 0 '{feats.name}' must have {N_MELS} mel bins, got shape {feats.shape}"
            )
        if lengths.type != "tensor(int32)":
            raise ValueError(f"{self.path}: input 1 '{lengths.name}' must be int32, got {lengths.type}")
        self._feats_name, self._lengths_name = feats.name, lengths.name

    def encode(self, wav: np.ndarray, sr: int) -> np.ndarray:
        """Mono float audio at `sr` (resampled to 16 kHz) -> int64 token ids [T_tok], 25 per second."""
        wav = np.asarray(wav, dtype=np.float32)
        if wav.ndim != 1 or wav.size == 0:
            raise ValueError(f"encode expects non-empty mono audio of shape [samples], got shape {wav.shape}")
        seconds = wav.size / sr
        if seconds < 1 / self.token_rate:
            raise ValueError(
                f"audio is {seconds * 1000:.0f} ms long, shorter than one {1000 // self.token_rate} ms token"
            )
        if seconds > self.max_seconds:
            raise ValueError(
                f"audio is {seconds:.1f} s long; the {self.model_name} speech tokenizer accepts at most "
                f"{self.max_seconds:.0f} s (split it, or filter such utterances out)"
            )
        feats = whisper_log_mel(resample(wav, sr, SAMPLE_RATE), n_mels=N_MELS).numpy()[None]
        outputs = self.session.run(
            None,
            {self._feats_name: feats, self._lengths_name: np.array([feats.shape[2]], dtype=np.int32)},
        )
        return np.asarray(outputs[0]).reshape(-1).astype(np.int64)


class CosyVoice3SpeechTokenizer(CosyVoiceSpeechTokenizer):
    """Audio -> CosyVoice 3 speech tokens: speech_tokenizer_v3.onnx, fed as v2 (upstream's CosyVoice3 builds the
    same frontend with this file). 25 Hz and 6561 codes as v2, but other codes: v2 tokens mean nothing to
    the CosyVoice 3 LM."""

    model_filename = MODEL_FILENAME_V3
    model_name = "CosyVoice 3"
    model_dir_name = "Fun-CosyVoice3-0.5B"
