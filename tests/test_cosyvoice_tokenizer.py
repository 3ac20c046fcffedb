"""The CosyVoice 2 speech-tokenizer path, end to end, on a tiny ONNX model with the real signature."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from ssd.audio.cosyvoice_tokenizer import MODEL_FILENAME, CosyVoiceSpeechTokenizer
from ssd.audio.features import whisper_log_mel


def _write_model(path, lengths_dtype=TensorProto.INT32):
    """feats [1, 128, T] -> 4-frame average pool (100 Hz -> 25 Hz) -> argmax over mel bins -> indices."""
    nodes = [
        helper.make_node("AveragePool", ["feats"], ["pooled"], kernel_shape=[4], strides=[4]),
        helper.make_node("ArgMax", ["pooled"], ["argmax"], axis=1, keepdims=0),
        # Uses feats_length (times zero) so the graph really consumes both inputs, like the real model.
        helper.make_node("Sub", ["feats_length", "feats_length"], ["zero"]),
        helper.make_node("Cast", ["zero"], ["zero64"], to=TensorProto.INT64),
        helper.make_node("Add", ["argmax", "zero64"], ["indices"]),
    ]
    graph = helper.make_graph(
        nodes,
        "tiny_speech_tokenizer",
        [
            helper.make_tensor_value_info("feats", TensorProto.FLOAT, [1, 128, "T"]),
            helper.make_tensor_value_info("feats_length", lengths_dtype, [1]),
        ],
        [helper.make_tensor_value_info("indices", TensorProto.INT64, [1, "T_tok"])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("cosyvoice2")
    _write_model(model_dir / MODEL_FILENAME)
    return CosyVoiceSpeechTokenizer(model_dir)  # the model dir is accepted, like a CosyVoice2-0.5B dir


def _tone(freq_hz, seconds, sr=16000, seed=0):
    t = np.arange(int(seconds * sr)) / sr
    noise = np.random.default_rng(seed).standard_normal(t.size) * 1e-3
    return (0.5 * np.sin(2 * np.pi * freq_hz * t) + noise).astype(np.float32)


def test_tokens_match_an_independent_pipeline_at_25_hz(tokenizer):
    wav = np.concatenate([_tone(300, 1.0), _tone(2500, 1.0)])
    tokens = tokenizer.encode(wav, 16000)
    assert tokens.dtype == np.int64 and tokens.shape == (50,)  # 2 s -> 200 mel frames -> 50 tokens

    whisper = pytest.importorskip("whisper")  # CosyVoice's own feature call, when available
    feats = whisper.log_mel_spectrogram(wav, n_mels=128).numpy()
    expected = feats[:, : feats.shape[1] // 4 * 4].reshape(128, -1, 4).mean(axis=2).argmax(axis=0)
    np.testing.assert_array_equal(tokens, expected)
    # The tokens follow the audio: a low tone and a high tone land on different, stable mel bins.
    assert len(set(tokens[2:23])) == 1 and len(set(tokens[27:48])) == 1 and tokens[10] < tokens[40]


def test_other_sample_rates_are_resampled_to_16k(tokenizer):
    wav_16k = _tone(1000, 1.5)
    t = np.arange(int(1.5 * 24000)) / 24000
    wav_24k = (0.5 * np.sin(2 * np.pi * 1000 * t)).astype(np.float32)
    tokens_16k, tokens_24k = tokenizer.encode(wav_16k, 16000), tokenizer.encode(wav_24k, 24000)
    assert tokens_24k.shape == tokens_16k.shape == (37,)
    np.testing.assert_array_equal(tokens_24k[2:-2], tokens_16k[2:-2])
    np.testing.assert_array_equal(tokenizer.encode(wav_16k, 16000), tokens_16k)  # deterministic


def test_audio_over_30_seconds_is_refused(tokenizer):
    assert tokenizer.encode(np.zeros(30 * 16000, np.float32), 16000).shape == (750,)
    with pytest.raises(ValueError, match="at most 30 s"):
        tokenizer.encode(np.zeros(30 * 16000 + 160, np.float32), 16000)


def test_bad_audio_and_bad_models_get_clear_errors(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="mono audio"):
        tokenizer.encode(np.zeros((2, 16000), np.float32), 16000)
    with pytest.raises(ValueError, match="non-empty"):
        tokenizer.encode(np.zeros(0, np.float32), 16000)
    with pytest.raises(ValueError, match="shorter than one 40 ms token"):
        tokenizer.encode(np.zeros(300, np.float32), 16000)
    with pytest.raises(FileNotFoundError, match=MODEL_FILENAME):
        CosyVoiceSpeechTokenizer(tmp_path / "missing_dir")
    wrong = _write_model(tmp_path / "int64_lengths.onnx", lengths_dtype=TensorProto.INT64)
    with pytest.raises(ValueError, match="input 1 'feats_length' must be int32"):
        CosyVoiceSpeechTokenizer(wrong)


def test_feature_input_is_the_whisper_log_mel(tokenizer):
    """The model sees whisper_log_mel(16 kHz audio) with feats_length = its frame count."""
    wav = _tone(700, 0.64, seed=3)
    feats = whisper_log_mel(wav).numpy()[None]
    direct = tokenizer.session.run(
        None, {"feats": feats, "feats_length": np.array([feats.shape[2]], np.int32)}
    )
    np.testing.assert_array_equal(tokenizer.encode(wav, 16000), direct[0].reshape(-1))
