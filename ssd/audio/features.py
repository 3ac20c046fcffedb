"""Audio loading, resampling (upstream CosyVoice's filter) and the Whisper-style log-mel that CosyVoice 2's
speech tokenizer reads.

The log-mel reproduces `whisper.log_mel_spectrogram(audio, n_mels=128)` (the call CosyVoice's frontend
makes) without depending on openai-whisper: 16 kHz input, 25 ms Hann window (n_fft 400), 10 ms hop
(160), |STFT|^2 without the last frame, Slaney mel filterbank, log10 with a 1e-10 floor, dynamic range
clamped to 8 (i.e. 80 dB) below the maximum, then (x + 4) / 4.
"""

from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path

import numpy as np
import soundfile as sf
import torch

SAMPLE_RATE = 16000
N_FFT = 400
HOP_LENGTH = 160
N_MELS = 128
FRAME_RATE = SAMPLE_RATE // HOP_LENGTH  # 100 mel frames per second


# Slaney's auditory-toolbox scale (librosa's default, htk=False): linear below 1 kHz, log above.
_SLANEY_HZ_PER_MEL = 200.0 / 3
_SLANEY_LOG_HZ = 1000.0
_SLANEY_LOG_MEL = _SLANEY_LOG_HZ / _SLANEY_HZ_PER_MEL
_SLANEY_LOG_STEP = np.log(6.4) / 27.0


def _hz_to_mel(freq: np.ndarray, htk: bool = False) -> np.ndarray:
    freq = np.asarray(freq, dtype=np.float64)
    if htk:
        return 2595.0 * np.log10(1.0 + freq / 700.0)
    mel = freq / _SLANEY_HZ_PER_MEL
    above = freq >= _SLANEY_LOG_HZ
    mel[above] = _SLANEY_LOG_MEL + np.log(freq[above] / _SLANEY_LOG_HZ) / _SLANEY_LOG_STEP
    return mel


def _mel_to_hz(mel: np.ndarray, htk: bool = False) -> np.ndarray:
    mel = np.asarray(mel, dtype=np.float64)
    if htk:
        return 700.0 * (10.0 ** (mel / 2595.0) - 1.0)
    freq = _SLANEY_HZ_PER_MEL * mel
    above = mel >= _SLANEY_LOG_MEL
    freq[above] = _SLANEY_LOG_HZ * np.exp(_SLANEY_LOG_STEP * (mel[above] - _SLANEY_LOG_MEL))
    return freq


@lru_cache(maxsize=8)
def mel_filterbank(
    n_mels: int = N_MELS, sample_rate: int = SAMPLE_RATE, n_fft: int = N_FFT, htk: bool = False
) -> torch.Tensor:
    """Slaney-normalised triangular mel filters, float32 [n_mels, n_fft // 2 + 1].

    Same formula as `librosa.filters.mel(sr, n_fft, n_mels, htk=htk)` (fmin 0, fmax sr/2,
    norm="slaney"); htk=False is how Whisper's `mel_filters.npz` was made, htk=True is the toy codec's
    scale. Written out here so the project needs neither librosa nor openai-whisper at runtime.
    """
    fft_freqs = np.linspace(0.0, sample_rate / 2, 1 + n_fft // 2)
    mel_edges = _mel_to_hz(
        np.linspace(
            _hz_to_mel(np.array([0.0]), htk)[0], _hz_to_mel(np.array([sample_rate / 2]), htk)[0], n_mels + 2
        ),
        htk,
    )
    edge_gaps = np.diff(mel_edges)
    ramps = mel_edges[:, None] - fft_freqs[None, :]
    lower = -ramps[:-2] / edge_gaps[:-1, None]
    upper = ramps[2:] / edge_gaps[1:, None]
    weights = np.maximum(0.0, np.minimum(lower, upper))
    weights *= (2.0 / (mel_edges[2:] - mel_edges[:-2]))[:, None]  # equal area per filter
    return torch.from_numpy(weights.astype(np.float32))


def whisper_log_mel(audio: np.ndarray | torch.Tensor, n_mels: int = N_MELS) -> torch.Tensor:
    """Whisper log-mel of 16 kHz audio [..., samples] -> float32 [..., n_mels, samples // 160].

    Like Whisper, the 8-unit dynamic-range clamp uses the maximum over the whole input tensor, so a
    batch gives the same numbers as one call per row only if the rows share a maximum; call it per
    utterance (as CosyVoice does) when that matters.
    """
    audio = torch.as_tensor(audio, dtype=torch.float32)
    if audio.shape[-1] <= N_FFT // 2:  # the STFT's reflect padding needs more than half a window
        raise ValueError(
            f"whisper_log_mel needs more than {N_FFT // 2} samples, got {audio.shape[-1]} (empty audio?)"
        )
    window = torch.hann_window(N_FFT, device=audio.device)
    stft = torch.stft(audio, N_FFT, HOP_LENGTH, window=window, return_complex=True)
    power = stft[..., :-1].abs() ** 2
    mel = mel_filterbank(n_mels).to(audio.device) @ power
    log_spec = torch.clamp(mel, min=1e-10).log10()
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
    return (log_spec + 4.0) / 4.0


# Upstream CosyVoice resamples every prompt with torchaudio's `transforms.Resample` at its defaults: a
# Hann-windowed sinc with 6 zero crossings and the cut-off at 0.99 of the lower Nyquist frequency.
SINC_ZERO_CROSSINGS = 6
SINC_ROLLOFF = 0.99


@lru_cache(maxsize=1)
def _torchaudio_resample_class():
    """torchaudio.transforms.Resample, or None where torchaudio is missing or does not load with this torch
    (a torchaudio built for another torch fails at import with an OSError or a RuntimeError)."""
    try:
        from torchaudio.transforms import Resample
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return None
    return Resample


@lru_cache(maxsize=16)
def _torchaudio_resampler(orig_sr: int, target_sr: int):
    return _torchaudio_resample_class()(orig_sr, target_sr)


@lru_cache(maxsize=16)
def sinc_kernel(orig_sr: int, target_sr: int) -> tuple[torch.Tensor, int, int, int]:
    """The polyphase filters of torchaudio's default Resample for orig_sr -> target_sr.

    Returns (kernel float32 [new, 1, 2 * width + orig], width, orig, new) where orig / new are the rates
    divided by their gcd: output sample j * new + k is the dot product of filter k with the input (padded by
    `width` zeros on the left) from sample j * orig on. Filter k is a sinc with cut-off
    min(orig, new) * rolloff, centred on the output instant (j + k / new) * orig, under a Hann window that
    reaches zero at the 6th zero crossing. Computed in float64, stored as float32, as torchaudio does.
    """
    gcd = math.gcd(int(orig_sr), int(target_sr))
    orig, new = int(orig_sr) // gcd, int(target_sr) // gcd
    cutoff = min(orig, new) * SINC_ROLLOFF
    width = math.ceil(SINC_ZERO_CROSSINGS * orig / cutoff)
    offsets = np.arange(-width, width + orig, dtype=np.float64) / orig  # input taps, in units of orig samples
    # Each output phase's instant within a step; torchaudio forms this quotient in float32 (default dtype)
    # before mixing it with float64 offsets, and so does this, so the filters agree to float32 precision.
    phase = (np.arange(new, dtype=np.float32)[:, None] / np.float32(new)).astype(np.float64)
    x = np.clip((offsets[None, :] - phase) * cutoff, -SINC_ZERO_CROSSINGS, SINC_ZERO_CROSSINGS)
    window = np.cos(x * np.pi / (2 * SINC_ZERO_CROSSINGS)) ** 2
    kernel = np.sinc(x) * window * (cutoff / orig)
    return torch.from_numpy(kernel.astype(np.float32))[:, None, :], width, orig, new


def resample_sinc(wav: np.ndarray, orig_sr: int, target_sr: int) -> np.ndarray:
    """torchaudio's default Resample written out, for environments where torchaudio does not import (it has
    no build for this project's newest torch). Mono float32 -> float32 with ceil(n * target / orig) samples."""
    kernel, width, orig, new = sinc_kernel(int(orig_sr), int(target_sr))
    signal = torch.from_numpy(np.ascontiguousarray(wav, dtype=np.float32))[None, None]
    padded = torch.nn.functional.pad(signal, (width, width + orig))
    phases = torch.nn.functional.conv1d(padded, kernel, stride=orig)  # [1, new, steps]
    n_out = -(-new * wav.shape[-1] // orig)
    return phases[0].T.reshape(-1)[:n_out].numpy()


def resample(wav: np.ndarray, orig_sr: int, target_sr: int = SAMPLE_RATE) -> np.ndarray:
    """The project's one resampler (tokenizers, judges, vocoders): mono float audio at `orig_sr` ->
    contiguous float32 at `target_sr`, as upstream CosyVoice resamples its prompts: torchaudio's
    `transforms.Resample` where torchaudio imports, else the same filter (`resample_sinc`)."""
    wav = np.asarray(wav)
    if wav.ndim != 1:
        raise ValueError(
            f"expected a mono 1-D waveform, got shape {wav.shape}; average or pick a channel first"
        )
    if not np.issubdtype(wav.dtype, np.floating):
        raise ValueError(
            f"expected a float waveform in [-1, 1], got dtype {wav.dtype}; divide int16 by 32768"
        )
    if int(orig_sr) <= 0 or int(target_sr) <= 0:
        raise ValueError(f"sample rates must be positive, got orig_sr={orig_sr}, target_sr={target_sr}")
    if not np.all(np.isfinite(wav)):
        raise ValueError("waveform contains NaN or inf samples")
    wav = wav.astype(np.float32, copy=False)
    if int(orig_sr) != int(target_sr) and wav.size:
        if _torchaudio_resample_class() is not None:
            with torch.no_grad():
                wav = _torchaudio_resampler(int(orig_sr), int(target_sr))(torch.from_numpy(wav)).numpy()
        else:
            wav = resample_sinc(wav, int(orig_sr), int(target_sr))
    return np.ascontiguousarray(wav, dtype=np.float32)


def load_audio(path: str | Path, target_sr: int | None = SAMPLE_RATE) -> tuple[np.ndarray, int]:
    """Read an audio file as mono float32 (channels averaged), resampled to `target_sr` unless None.

    Returns (wav, sample_rate). Unreadable files raise ValueError naming the file.
    """
    try:
        wav, sr = sf.read(str(path), dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError, OSError) as err:
        raise ValueError(f"cannot read audio file {path}: {err}") from err
    wav = wav.mean(axis=1)
    if wav.size == 0:
        raise ValueError(f"audio file {path} has no samples")
    if not np.isfinite(wav).all():
        raise ValueError(f"audio file {path} has NaN or inf samples")
    if target_sr is not None and sr != target_sr:
        wav, sr = resample(wav, sr, target_sr), target_sr
    return wav, sr
