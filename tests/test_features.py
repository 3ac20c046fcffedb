"""Whisper-style log-mel and resampling."""

from __future__ import annotations

import numpy as np
import pytest
import soundfile as sf
import torch

from ssd.audio.features import load_audio, mel_filterbank, resample, resample_sinc, whisper_log_mel


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
    """A 10 kHz tone has no place at 16 kHz (Nyquist 8 kHz): the filter (cut-off 0.99 x 8 kHz, a Hann
    transition about 1.3 kHz wide) removes it, where plain interpolation (the negative control) folds it
    down to 6 kHz at nearly full power."""
    sr_in = 44100
    t = np.arange(sr_in) / sr_in
    tone = np.sin(2 * np.pi * 10_000 * t)
    kept = resample(tone, sr_in, 16000)
    naive = np.interp(np.arange(16000) / 16000, t, tone)
    assert np.sqrt(np.mean(kept[1000:-1000] ** 2)) < 0.01  # the input's RMS is 0.71
    assert np.sqrt(np.mean(naive**2)) > 0.3


def _voice(sr, seconds=1.5, seed=0):
    """Speech-like audio generated at `sr` itself, with energy up to its Nyquist frequency: a glottal
    pulse train (f0 gliding 95-190 Hz) through three formant resonators, syllable-rate loudness, and noise
    bursts standing in for fricatives."""
    from scipy.signal import lfilter

    rng = np.random.default_rng(seed)
    n = int(sr * seconds)
    t = np.arange(n) / sr
    f0 = 140 + 45 * np.sin(2 * np.pi * 0.7 * t)
    pulses = np.diff(np.floor(np.cumsum(f0) / sr), prepend=0.0)
    voiced = np.zeros(n)
    for formant, bandwidth in ((700, 90), (1200, 110), (2600, 160)):
        r = np.exp(-np.pi * bandwidth / sr)
        voiced += lfilter([1 - r], [1, -2 * r * np.cos(2 * np.pi * formant / sr), r * r], pulses)
    bursts = rng.standard_normal(n) * (np.sin(2 * np.pi * 2.3 * t) > 0.8)
    speech = (voiced / np.abs(voiced).max() + 0.3 * bursts) * (0.6 + 0.4 * np.sin(2 * np.pi * 4 * t))
    return (0.5 * speech / np.abs(speech).max()).astype(np.float32)


def _tones(sr, seconds=1.0):
    t = np.arange(int(sr * seconds)) / sr
    tones = sum(np.sin(2 * np.pi * f * t + f) for f in (440, 3100, 7800, 7950, 9000))
    return (0.2 * tones).astype(np.float32)


RATE_PAIRS = [(24000, 16000), (44100, 16000), (16000, 24000), (44100, 24000), (22050, 16000), (8000, 16000)]


@pytest.mark.parametrize("signal", [_voice, _tones], ids=["speech", "tones"])
@pytest.mark.parametrize("orig, target", RATE_PAIRS)
def test_sinc_resampler_equals_torchaudios_resample(orig, target, signal):
    """Where torchaudio imports (`make test-compat`), the written-out filter must give upstream's signal."""
    torchaudio = pytest.importorskip("torchaudio", exc_type=ImportError)
    wav = signal(orig)
    reference = torchaudio.transforms.Resample(orig, target)(torch.from_numpy(wav)).numpy()
    ours = resample_sinc(wav, orig, target)
    assert ours.shape == reference.shape == (-(-wav.size * target // orig),)
    assert np.abs(ours - reference).max() <= 1e-6
    np.testing.assert_array_equal(resample(wav, orig, target), reference)  # torchaudio itself is used


@pytest.mark.parametrize("orig, target", RATE_PAIRS)
def test_sinc_resampler_evaluates_the_windowed_sinc_at_every_output_instant(orig, target):
    """The polyphase bookkeeping (phases, stride, padding, interleaving) checked against the plain formula,
    sample by sample: y[m] = sum_i x[i] h(i - m * orig / target), h a sinc with cut-off 0.99 x the lower
    Nyquist under a Hann window that ends at its 6th zero crossing (torchaudio's definition)."""
    wav = _voice(orig, seconds=0.25)
    ours = resample_sinc(wav, orig, target)
    cutoff = min(orig, target) * 0.99 / orig  # cycles per input sample, times 2
    rng = np.random.default_rng(0)
    outputs = np.concatenate([[0, 1, ours.size - 1], rng.integers(0, ours.size, 40)])
    inputs = np.arange(wav.size)
    for m in outputs:
        x = np.clip((inputs - m * orig / target) * cutoff, -6, 6)
        h = np.sinc(x) * np.cos(x * np.pi / 12) ** 2 * cutoff
        assert abs(ours[m] - np.dot(wav.astype(np.float64), h)) < 2e-5, m
    # Negative control: the same formula without the window is another filter, and it shows.
    m = ours.size // 2
    x = (inputs - m * orig / target) * cutoff
    unwindowed = np.dot(wav.astype(np.float64), np.sinc(np.clip(x, -6, 6)) * cutoff)
    assert abs(ours[m] - unwindowed) > 1e-4


def test_judges_hear_audio_of_any_rate_as_the_projects_resampler_gives_it():
    """One resampler for the whole project (docs/target-cosyvoice2.md §4): a judge given 24 kHz audio scores
    exactly what it scores on `resample(audio, 24000, 16000)` at 16 kHz. The negative control: the same audio
    brought to 16 kHz another way (linear interpolation) changes the scores, so the comparison can fail."""
    from ssd.audio.mos import DNSMOS
    from ssd.audio.speaker import ResemblyzerSpeaker

    wav = _voice(24000, seconds=2.0)
    ours = resample(wav, 24000, 16000)
    other = np.interp(np.arange(ours.size) * 1.5, np.arange(wav.size), wav).astype(np.float32)
    speaker, mos = ResemblyzerSpeaker(), DNSMOS(num_threads=1)
    np.testing.assert_array_equal(speaker.embed(wav, 24000), speaker.embed(ours, 16000))
    assert mos.score(wav, 24000) == mos.score(ours, 16000)
    assert not np.array_equal(speaker.embed(other, 16000), speaker.embed(ours, 16000))
    assert mos.score(other, 16000) != mos.score(ours, 16000)


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
