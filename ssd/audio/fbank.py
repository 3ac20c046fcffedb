"""Kaldi-style log mel filterbank, the features CAM++ (`campplus.onnx`) was trained on.

CosyVoice's frontend calls `torchaudio.compliance.kaldi.fbank(wav, num_mel_bins=80, dither=0,
sample_frequency=16000)`. torchaudio cannot be imported next to torch 2.13, so this is a reimplementation
of that call with its defaults (25 ms Povey window, 10 ms shift, snip_edges, DC removal, pre-emphasis
0.97, power spectrum on a 512-point FFT, Kaldi mel scale from 20 Hz to Nyquist, log floored at float32
eps). tests/test_judges.py checks it against kaldi-native-fbank.
"""

from __future__ import annotations

import numpy as np
import torch


def _mel(freq: torch.Tensor) -> torch.Tensor:
    return 1127.0 * torch.log1p(freq / 700.0)


def kaldi_mel_banks(num_bins: int, padded_window: int, sample_rate: float, low_freq: float, high_freq: float):
    """[num_bins, padded_window // 2 + 1] triangular filters, flat in Kaldi's mel scale (Nyquist column 0)."""
    nyquist = 0.5 * sample_rate
    if high_freq <= 0.0:
        high_freq += nyquist
    if not 0.0 <= low_freq < high_freq <= nyquist:
        raise ValueError(f"fbank: need 0 <= low_freq < high_freq <= {nyquist}, got {low_freq}, {high_freq}")
    mel_low, mel_high = (
        _mel(torch.tensor(low_freq, dtype=torch.float64)),
        _mel(torch.tensor(high_freq, dtype=torch.float64)),
    )
    delta = (mel_high - mel_low) / (num_bins + 1)
    index = torch.arange(num_bins, dtype=torch.float64).unsqueeze(1)
    left, center, right = (
        mel_low + index * delta,
        mel_low + (index + 1) * delta,
        mel_low + (index + 2) * delta,
    )
    fft_mel = _mel(
        torch.arange(padded_window // 2, dtype=torch.float64) * sample_rate / padded_window
    ).unsqueeze(0)
    up = (fft_mel - left) / (center - left)
    down = (right - fft_mel) / (right - center)
    banks = torch.clamp(torch.minimum(up, down), min=0.0)
    return torch.nn.functional.pad(banks, (0, 1))  # Kaldi leaves the Nyquist bin out of every filter


def kaldi_fbank(
    wav: np.ndarray | torch.Tensor,
    sample_rate: int = 16_000,
    num_mel_bins: int = 80,
    frame_length_ms: float = 25.0,
    frame_shift_ms: float = 10.0,
    preemphasis: float = 0.97,
    low_freq: float = 20.0,
    high_freq: float = 0.0,
) -> torch.Tensor:
    """[num_frames, num_mel_bins] float32 log mel energies of a 1-D waveform, as torchaudio's kaldi.fbank
    computes them with dither=0 and its other defaults; no frames when the input is shorter than a window."""
    x = torch.as_tensor(wav, dtype=torch.float64)
    if x.ndim != 1:
        raise ValueError(f"fbank: expected a 1-D waveform, got shape {tuple(x.shape)}")
    window_size = int(sample_rate * frame_length_ms * 0.001)
    window_shift = int(sample_rate * frame_shift_ms * 0.001)
    padded_window = 1 << (window_size - 1).bit_length()
    if x.numel() < window_size:
        return torch.zeros(0, num_mel_bins, dtype=torch.float32)
    frames = x.unfold(0, window_size, window_shift)  # snip_edges: only whole windows
    frames = frames - frames.mean(dim=1, keepdim=True)
    previous = torch.cat([frames[:, :1], frames[:, :-1]], dim=1)  # Kaldi repeats the first sample
    frames = frames - preemphasis * previous
    povey = torch.hann_window(window_size, periodic=False, dtype=torch.float64).pow(0.85)
    frames = torch.nn.functional.pad(frames * povey, (0, padded_window - window_size))
    power = torch.fft.rfft(frames).abs().pow(2)
    mel_energy = power @ kaldi_mel_banks(num_mel_bins, padded_window, sample_rate, low_freq, high_freq).T
    eps = torch.finfo(torch.float32).eps
    return torch.log(torch.clamp(mel_energy, min=eps)).to(torch.float32)
