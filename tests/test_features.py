"""Whisper-style log-mel and resampling."""

from __future__ import annotations

import numpy as np
import pytest
import soundfile as sf
import torch

from ssd.audio.features import load_audio, mel_filterbank, resample, whisper_log_mel


def _speechlike(seconds, sr=16000, seed=0):
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * sr)) / sr
    wav = 0.3 * np.sin(2 * np.pi * 220 * t) * (1 + np.sin(2 * np.pi * 3 * t)) + 0.05 * rng.standard_normal(
        t.size
    )
    wav[: sr // 10] = 0.0  # a silent stretch exercises the 1e-10 floor and the 8-unit clamp
    return wav.astype(np.float32)


def test_filterbank_equals_whispers_shipped_filters():
    whisper = pytest.importorskip("whisper")
    shipped = whisper.audio.mel_filters("cpu", 128)
    assert mel_filterbank(128).shape == (128, 201)
    torch.testing.assert_close(mel_filterbank(128), shipped, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(mel_filterbank(80), whisper.audio.mel_filters("cpu", 80), rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("seconds", [0.5, 3.0, 7.31])
def test_log_mel_equals_whisper(seconds):
    whisper = pytest.importorskip("whisper")
    wav = _speechlike(seconds, seed=int(seconds * 100))
    ours = whisper_log_mel(wav)
    reference = whisper.log_mel_spectrogram(wav, n_mels=128)
    assert ours.shape == reference.shape == (128, int(seconds * 16000) // 160)
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-5)
    torch.testing.assert_close(whisper_log_mel(torch.from_numpy(wav)[None])[0], reference, rtol=0, atol=1e-5)


def test_log_mel_range_and_empty_input():
    mel = whisper_log_mel(_speechlike(1.0))
    assert mel.dtype == torch.float32
    assert float(mel.max() - mel.min()) <= 2.0 + 1e-6  # the 8-unit (80 dB) clamp, after the /4 scaling
    with pytest.raises(ValueError, match="empty audio"):
        whisper_log_mel(np.zeros(0, np.float32))
    with pytest.raises(ValueError, match="more than 200 samples, got 150"):
        whisper_log_mel(np.zeros(150, np.float32))


def test_resample_keeps_a_tone_and_the_duration():
    sr_in = 44100
    t = np.arange(sr_in) / sr_in
    out = resample(np.sin(2 * np.pi * 1000 * t), sr_in, 16000)
    assert out.dtype == np.float32 and out.shape == (16000,)
    spectrum = np.abs(np.fft.rfft(out))
    assert abs(np.argmax(spectrum) - 1000) <= 1  # 1 Hz bins over one second
    np.testing.assert_array_equal(resample(out, 16000, 16000), out)
    with pytest.raises(ValueError, match="mono"):
        resample(np.zeros((2, 100)), 16000, 8000)


def test_resample_rejects_what_would_alias():
    """A 9 kHz tone has no place at 16 kHz (Nyquist 8 kHz): the band-limited resampler removes it, where
    plain interpolation (the negative control) folds it down to 7 kHz at nearly full power."""
    sr_in = 44100
    t = np.arange(sr_in) / sr_in
    tone = np.sin(2 * np.pi * 9000 * t)
    kept = resample(tone, sr_in, 16000)
    naive = np.interp(np.arange(16000) / 16000, t, tone)
    assert np.sqrt(np.mean(kept[1000:-1000] ** 2)) < 0.01  # the input's RMS is 0.71
    assert np.sqrt(np.mean(naive**2)) > 0.3


def test_no_other_resampler_in_the_code_base():
    """One resampler for the whole project (docs/target-cosyvoice2.md §4): everything else calls
    ssd.audio.features.resample, so tokenizers, vocoders and judges see the same audio."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    other = re.compile(
        r"resample_poly|functional\.resample|transforms\.Resample|librosa\.resample|scipy\.signal|soxr"
    )
    offenders = [
        f"{path.relative_to(root)}:{number}"
        for path in sorted([*(root / "ssd").rglob("*.py"), *(root / "scripts").glob("*.py")])
        if path != root / "ssd" / "audio" / "features.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if other.search(line)
    ]
    assert offenders == []
    assert other.search((root / "ssd" / "audio" / "features.py").read_text())  # the one place soxr is used


def test_load_audio_mixes_down_resamples_and_names_bad_files(tmp_path):
    stereo = np.stack([_speechlike(1.0, sr=24000), np.zeros(24000, np.float32)], axis=1)
    sf.write(tmp_path / "a.wav", stereo, 24000)
    wav, sr = load_audio(tmp_path / "a.wav")
    assert sr == 16000 and wav.shape == (16000,) and wav.dtype == np.float32
    native, native_sr = load_audio(tmp_path / "a.wav", target_sr=None)
    assert native_sr == 24000
    np.testing.assert_allclose(native, stereo.mean(axis=1), atol=1e-4)  # PCM16 quantisation
    (tmp_path / "bad.wav").write_bytes(b"RIFF not really a wav")
    with pytest.raises(ValueError, match="bad.wav"):
        load_audio(tmp_path / "bad.wav")


def test_htk_mel_filterbank_peaks_are_evenly_spaced_on_the_htk_scale():
    fb = mel_filterbank(40, 16000, 1024, htk=True).numpy()
    peaks_hz = fb.argmax(1) * 16000 / 1024
    peaks_mel = 2595.0 * np.log10(1.0 + peaks_hz / 700.0)
    bin_mel = 2595.0 * np.log10(1.0 + 8000 / 700.0) / 41  # the scale's spacing of 40 filters
    assert np.abs(np.diff(peaks_mel) - bin_mel).max() < 0.5 * bin_mel  # within one FFT bin of even
    assert not torch.equal(mel_filterbank(40, 16000, 1024, htk=True), mel_filterbank(40, 16000, 1024))
