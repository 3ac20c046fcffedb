"""Tiny models that speak the engine's SpeechLM interface, for engine tests.

A trigram table model: the next-token logits depend on the last two tokens IN ITS
CACHE, so a loop that mis-tracks the cache (wrong rollback, a token fed twice or
never) changes the law, and the statistical certificates see it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch
from scipy.stats import chisquare

from ssd.decoding.sampling import SamplingConfig


@dataclass
class TrigramCache:
    tokens: torch.Tensor  # [B, capacity]
    lengths: torch.Tensor  # [B]
    features = None  # a table model has no hidden states (ssd.contracts.SpeechLM)


class TrigramLM:
    def __init__(self, table: torch.Tensor):
        self.table = table  # [V+1, V+1, V]; index V = "no token" (start)
        self.vocab_size = table.shape[-1]

    def prefill(self, prompt: torch.Tensor, max_new_tokens: int, taps=()):
        if taps:
            raise ValueError("a trigram table has no hidden states to tap")
        batch, plen = prompt.shape
        tokens = torch.full((batch, plen + max_new_tokens), self.vocab_size, dtype=torch.long)
        tokens[:, :plen] = prompt
        cache = TrigramCache(tokens, torch.full((batch,), plen, dtype=torch.long))
        return cache, self._logits(cache, cache.lengths)

    def extend(self, cache, tokens: torch.Tensor) -> torch.Tensor:
        batch, k = tokens.shape
        lengths = cache.lengths
        if int(lengths.max()) + k > cache.tokens.shape[1]:
            raise RuntimeError("TrigramLM cache overflow")
        pos = lengths.unsqueeze(-1) + torch.arange(k)
        cache.tokens.scatter_(1, pos, tokens)
        out = torch.stack([self._logits(cache, lengths + j + 1) for j in range(k)], 1)
        cache.lengths = lengths + k
        return out

    def rollback(self, cache, n) -> None:
        cache.lengths = cache.lengths - torch.as_tensor(n)
        if (cache.lengths < 0).any():
            raise RuntimeError("rolled back past the prompt")

    def _logits(self, cache, upto: torch.Tensor) -> torch.Tensor:
        toks = cache.tokens
        start = torch.full_like(upto, self.vocab_size)
        prev1 = torch.where(
            upto >= 1, toks.gather(1, (upto - 1).clamp_min(0).unsqueeze(-1)).squeeze(-1), start
        )
        prev2 = torch.where(
            upto >= 2, toks.gather(1, (upto - 2).clamp_min(0).unsqueeze(-1)).squeeze(-1), start
        )
        return self.table[prev2, prev1].float()


def trigram_pair(vocab: int, seed: int, draft_noise: float = 1.0, scale: float = 1.5):
    """A target trigram model and a draft that disagrees with it noticeably."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(vocab + 1, vocab + 1, vocab, generator=g, dtype=torch.float64) * scale
    noisy = table + torch.randn(table.shape, generator=g, dtype=torch.float64) * draft_noise
    return TrigramLM(table), TrigramLM(noisy)


def chi_square_fit(counts: Counter, law: dict[tuple, float]) -> tuple[float, int, float]:
    """Chi-square goodness of fit (statistic, df, p) of observed sequence `counts` to an enumerated `law`;
    cells with expected count < 5 are pooled; p = 0 when a sequence outside the law's support occurred."""
    if set(counts) - set(law):
        return float("inf"), 0, 0.0
    n = sum(counts.values())
    keys = sorted(law, key=law.get, reverse=True)
    expected = np.array([law[k] * n for k in keys])
    observed = np.array([counts.get(k, 0) for k in keys])
    small = expected < 5
    if small.any():
        expected = np.append(expected[~small], expected[small].sum())
        observed = np.append(observed[~small], observed[small].sum())
    result = chisquare(observed, expected * observed.sum() / expected.sum())
    return float(result.statistic), len(observed) - 1, float(result.pvalue)


def speculative(target, draft, prompt, law, rule, draft_len, max_len, min_len=0, generator=None, observer=None,
                drafter=None):  # fmt: skip
    """decode_speculative with `draft` (a SpeechLM) run autoregressively, instrumented unless `observer` is
    given; `drafter` replaces the autoregressive drafter (negative controls)."""
    from ssd.decoding.generate import Request, decode_speculative
    from ssd.decoding.observe import Instruments
    from ssd.drafters.autoregressive import AutoregressiveDrafter

    drafter = drafter or AutoregressiveDrafter(draft)
    request = Request(prompt, max_len, min_len, generator)
    return decode_speculative(target, drafter, request, law, rule, draft_len, observer or Instruments())


def autoregressive(model, prompt, law, max_len, min_len=0, generator=None, observer=None):
    """decode_ar, instrumented unless `observer` is given."""
    from ssd.decoding.generate import Request, decode_ar
    from ssd.decoding.observe import Instruments

    return decode_ar(model, Request(prompt, max_len, min_len, generator), law, observer or Instruments())


@dataclass(frozen=True)
class StaleWindowLaw(SamplingConfig):
    """Broken (a negative control): every draft position's history window is the emitted history alone, the
    earlier draft tokens of the round left out, for the drafter's law and the target's q alike."""

    def windows(self, last_window, drafted):
        return last_window.unsqueeze(1).expand(-1, drafted.shape[1] + 1, -1)
