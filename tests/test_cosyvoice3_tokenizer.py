"""CosyVoice 3's speech tokenizer (speech_tokenizer_v3.onnx): the v2 path with its own file, on a tiny ONNX
model with the real signature (the builder of tests/test_cosyvoice_tokenizer.py)."""

from __future__ import annotations

import numpy as np
import pytest

from ssd.audio.cosyvoice_tokenizer import (
    MODEL_FILENAME,
    MODEL_FILENAME_V3,
    CosyVoice3SpeechTokenizer,
    CosyVoiceSpeechTokenizer,
)
from tests.test_cosyvoice_tokenizer import _tone, _write_model


def test_v3_speech_tokenizer_reads_its_own_file_from_the_model_dir(tmp_path):
    model_dir = tmp_path / "Fun-CosyVoice3-0.5B"
    model_dir.mkdir()
    _write_model(model_dir / MODEL_FILENAME)  # a v2 file beside it must not be picked
    with pytest.raises(
        FileNotFoundError, match="CosyVoice 3 speech tokenizer not found.*speech_tokenizer_v3.onnx"
    ):
        CosyVoice3SpeechTokenizer.load(model_dir)
    _write_model(model_dir / MODEL_FILENAME_V3)
    tokenizer = CosyVoice3SpeechTokenizer.load(model_dir)
    assert tokenizer.path.name == "speech_tokenizer_v3.onnx"
    assert (tokenizer.codebook_size, tokenizer.token_rate) == (6561, 25)
    tokens = tokenizer.encode(np.concatenate([_tone(300, 1.0), _tone(2500, 1.0)]), 16000)
    assert tokens.shape == (50,) and tokens.dtype == np.int64
    assert CosyVoiceSpeechTokenizer.load(model_dir).path.name == "speech_tokenizer_v2.onnx"
    with pytest.raises(ValueError, match="the CosyVoice 3 speech tokenizer accepts at most 30 s"):
        tokenizer.encode(np.zeros(31 * 16000, np.float32), 16000)
