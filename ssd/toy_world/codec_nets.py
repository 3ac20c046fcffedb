"""The toy codec's two networks: the token decoder (tokens + voice -> spectrogram) and the phonetic encoder
(log-mel -> the bottleneck features the tokens are clustered from). `ssd.toy_world.codec` holds and runs them;
`cfg` is its `ToyCodecConfig`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class TokenDecoder(nn.Module):
    """tokens [B, T] + voice [B, n_mels] -> log-magnitude [B, n_freq, T * frames_per_token] (or log-mel)."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        c = cfg.decoder_channels
        self.frames_per_token = cfg.frames_per_token
        self.embed = nn.Embedding(cfg.codebook_size, c)
        self.voice = nn.Linear(cfg.n_mels, c)
        self.token_convs = nn.ModuleList(
            nn.Conv1d(c, c, 3, padding=2**i, dilation=2**i) for i in range(cfg.decoder_token_layers)
        )
        self.frame_convs = nn.ModuleList(
            nn.Conv1d(c, c, 5, padding=2) for _ in range(cfg.decoder_frame_layers)
        )
        n_out = cfg.n_mels if cfg.decoder_target == "log_mel" else cfg.n_fft // 2 + 1
        self.out = nn.Conv1d(c, n_out, 1)

    def forward(self, tokens: torch.Tensor, voice: torch.Tensor) -> torch.Tensor:
        v = self.voice(voice)[:, :, None]
        x = self.embed(tokens).transpose(1, 2) + v
        for conv in self.token_convs:
            x = x + torch.nn.functional.gelu(conv(x))
        x = x.repeat_interleave(self.frames_per_token, dim=2)
        for conv in self.frame_convs:
            x = x + torch.nn.functional.gelu(conv(x + v))
        return self.out(x)


class PhoneticEncoder(nn.Module):
    """Mean-removed log-mel [B, n_mels, T] -> bottleneck features [B, D, T]; `classify` -> phone-state logits."""

    def __init__(self, cfg: Any, n_classes: int) -> None:
        super().__init__()
        c = cfg.encoder_channels
        self.inp = nn.Conv1d(cfg.n_mels, c, 5, padding=2)
        self.convs = nn.ModuleList(
            nn.Conv1d(c, c, 5, padding=2 * 2**i, dilation=2**i) for i in range(cfg.encoder_layers)
        )
        self.bottleneck = nn.Conv1d(c, cfg.encoder_bottleneck, 1)
        self.classify = nn.Conv1d(cfg.encoder_bottleneck, n_classes, 1)

    def features(self, normed_log_mel: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.gelu(self.inp(normed_log_mel))
        for conv in self.convs:
            x = x + torch.nn.functional.gelu(conv(x))
        return self.bottleneck(x)

    def forward(self, normed_log_mel: torch.Tensor) -> torch.Tensor:
        return self.classify(self.features(normed_log_mel))
