"""Sampling transforms: logits (+ generated history) -> the exact per-step distribution.

The SAME function gives the AR baseline the distribution it samples from and gives
the verifier the target law q at each draft position (with the history extended by
the earlier draft tokens). That is what makes β = 0 exact, RAS included.

Everything is vectorised over rows: the verifier evaluates B·(k+1) positions at once.
Computation happens in the dtype of `logits` (the engine passes float32; the
analytic certificates pass float64).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch

from ssd.decoding.rng import RowRandom

NUCLEUS_RULES = ("hf", "cosyvoice")
RAS_VARIANTS = ("classic", "exclude_repeated")
# eos_mode -> what it forbids before min_len, and which upstream CosyVoice 2 code it matches
# (FunAudioLLM/CosyVoice Qwen2LM.sampling_ids + inference; docs/targets.md §6 has the dated history).
EOS_MODES = {
    "resample_eos": "redraw while the draw is EOS; the other stop tokens end the sequence (upstream 2025-08-21 "
    "to 2025-12-08; before 2025-08-21 upstream skipped those two by re-feeding its last input, which no law "
    "reproduces)",
    "resample": "redraw while the draw is any stop token (upstream 2025-12-09 to 2026-02-10)",
    "mask_eos": "EOS logit set to -inf; the other stop tokens end the sequence (upstream since 2026-02-11)",
    "mask": "every stop token's logit set to -inf (no upstream sampling_ids; what vLLM's min_tokens does to "
    "stop_token_ids in upstream's vLLM path)",
}


@dataclass(frozen=True)
class SamplingConfig:
    """How one model turns logits into its per-step sampling law.

    temperature: 0 means greedy (a one-hot law on the argmax).
    nucleus: "hf" = HF top-k then top-p (the token crossing top_p is kept);
             "cosyvoice" = CosyVoice's loop: take tokens in descending order while the
             cumulative mass BEFORE them is < top_p and fewer than top_k are taken.
    ras_window: > 0 turns on CosyVoice 2's repetition-aware sampling (docs/targets.md §2.3):
             a nucleus draw that occurs >= ras_window·ras_tau times among the last
             ras_window GENERATED tokens is replaced by a draw from the full softmax.
    ras_variant: "classic" (fallback from the full softmax) or "exclude_repeated"
             (Feb-2026 upstream: the repeated id is excluded from the fallback).
    stop_tokens: ids that end a sequence; the first is the one the *_eos modes refuse before min_len (EOS for
                 CosyVoice 2 and LLaSA; for CosyVoice 3 id S, the row upstream's min_len rule names). Before
                 min_len some are forbidden:
    eos_mode: which ones and how (EOS_MODES says which upstream dates each matches).
              "mask" / "mask_eos": logits of all stop tokens / of EOS only set to -inf first;
              "resample" / "resample_eos": redraw while the draw is any stop token / EOS, i.e. the
              law conditioned on not drawing them.
    repetition_penalty: HF's RepetitionPenaltyLogitsProcessor (LLaSA's fine-tuning example uses 1.2):
             every id present in the WHOLE context (prompt ids included) has its logit multiplied by
             the penalty if negative, divided by it otherwise, before temperature and top-k/top-p,
             as HF orders its processors. The law then needs the whole history (`whole_context`).
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    nucleus: str = "hf"
    ras_window: int = 0
    ras_tau: float = 0.1
    ras_variant: str = "classic"
    stop_tokens: tuple[int, ...] = field(default_factory=tuple)
    eos_mode: str = "mask"
    repetition_penalty: float | None = None

    def __post_init__(self):
        object.__setattr__(self, "stop_tokens", tuple(int(t) for t in self.stop_tokens))
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 or null, got {self.top_k}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] or null, got {self.top_p}")
        for name, value, allowed in (
            ("nucleus", self.nucleus, NUCLEUS_RULES),
            ("ras_variant", self.ras_variant, RAS_VARIANTS),
        ):
            if value not in allowed:
                raise ValueError(f"sampling.{name} must be one of {allowed}, got {value!r}")
        if self.eos_mode not in EOS_MODES:
            modes = "; ".join(f"{k!r}: {v}" for k, v in EOS_MODES.items())
            raise ValueError(f"sampling.eos_mode must be one of {modes}. Got {self.eos_mode!r}")
        if self.ras_window < 0:
            raise ValueError(f"ras_window must be >= 0, got {self.ras_window}")
        if self.repetition_penalty is not None:
            if not self.repetition_penalty > 0:
                raise ValueError(
                    f"sampling.repetition_penalty must be > 0 or null, got {self.repetition_penalty}"
                )
            if self.ras_window:
                # RAS reads the last ras_window GENERATED tokens; a whole-context history would feed it prompt ids.
                raise ValueError(
                    "sampling.repetition_penalty and sampling.ras_window > 0 cannot be combined: set one to null/0"
                )

    @property
    def window(self) -> int:
        """How many generated tokens the law depends on (see whole_context for the rest)."""
        return self.ras_window

    @property
    def whole_context(self) -> bool:
        """The law depends on every id of the context, prompt included: the engine passes the prompt's ids
        (the model's context_ids) and all generated tokens as the history window."""
        return self.repetition_penalty is not None

    @property
    def forbidden_before_min_len(self) -> tuple[int, ...]:
        """The stop tokens eos_mode forbids before min_len."""
        return self.stop_tokens if self.eos_mode in ("mask", "resample") else self.stop_tokens[:1]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def windows(self, last_window: torch.Tensor, drafted: torch.Tensor) -> torch.Tensor:
        """The history windows [B, k+1, W] of draft positions 0..k, from the emitted history [B, W]: position
        i sees it extended by the draft tokens x_<i of its round (drafted [B, k]), since the law at i is a
        function of them (RAS's window, the repetition penalty's context)."""
        width = last_window.shape[1]
        if width == 0:
            return last_window.new_empty(last_window.shape[0], drafted.shape[1] + 1, 0)
        return torch.cat([last_window, drafted], dim=1).unfold(1, width, 1)


def distribution(
    cfg: SamplingConfig,
    logits: torch.Tensor,
    window: torch.Tensor | None = None,
    step: torch.Tensor | int = 0,
    min_len: torch.Tensor | int = 0,
) -> torch.Tensor:
    """The per-step sampling law for each row.

    logits [N, V]; window [N, W] = the last W generated tokens (-1 where fewer exist; with
    cfg.whole_context, every id of the context: prompt ids and generated tokens, in any order);
    step [N] = index of the token being sampled (0 = first generated token);
    min_len [N] = stop tokens are forbidden while step < min_len (the int 0: in no row, so the law skips that
    work; a row past its min_len gets the same law either way).
    Returns probabilities [N, V] (rows sum to 1) in logits.dtype.
    """
    n_rows, vocab = logits.shape
    # [N, V]: the stop tokens forbidden in each row at this step (None: the law forbids none)
    forbidden = None
    if cfg.forbidden_before_min_len and not (isinstance(min_len, int) and min_len <= 0):
        step = torch.as_tensor(step, device=logits.device).expand(n_rows)
        min_len = torch.as_tensor(min_len, device=logits.device).expand(n_rows)
        early = step < min_len
        forbidden = early[:, None] & _columns(cfg.forbidden_before_min_len, vocab, logits.device)
    masking = cfg.eos_mode in ("mask", "mask_eos") or cfg.greedy

    if cfg.repetition_penalty is not None and window is not None:
        logits = _repetition_penalty(logits, window, cfg.repetition_penalty)
    if forbidden is not None and masking:
        logits = logits.masked_fill(forbidden, float("-inf"))

    if cfg.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), vocab).to(logits.dtype)

    logits = logits / cfg.temperature if cfg.temperature != 1.0 else logits
    resampling = forbidden is not None and not masking
    if resampling:
        # Where the whole law sits on forbidden stop tokens, upstream's redraw loop gives up (raises) after 100
        # tries; those rows take the masked law instead. Every row's masked law rides along in the same pass
        # (rows N..2N-1), so finding the rows that need it takes no host read: the round keeps its one sync.
        logits = torch.cat([logits, logits.masked_fill(forbidden, float("-inf"))])
        window = None if window is None else torch.cat([window, window])
    probs = torch.softmax(logits, dim=-1)
    nucleus = _nucleus(cfg, logits, probs)
    law = nucleus if cfg.ras_window == 0 else _ras(cfg, nucleus, probs, window)

    if resampling:
        law, masked = law[:n_rows], law[n_rows:]
        allowed = law.masked_fill(forbidden, 0.0)
        mass = allowed.sum(-1, keepdim=True)
        # rows past min_len keep the law they have when none is forbidden
        law = torch.where(early[:, None], torch.where(mass > 0, allowed / mass, masked), law)
    return law


@functools.cache
def _columns(tokens: tuple[int, ...], vocab: int, device: torch.device) -> torch.Tensor:
    """[V] bool, True at `tokens` (made once per law, vocabulary and device: a decode step would otherwise
    build it every call)."""
    columns = torch.zeros(vocab, dtype=torch.bool, device=device)
    columns[list(tokens)] = True
    return columns


def _repetition_penalty(logits: torch.Tensor, context: torch.Tensor, penalty: float) -> torch.Tensor:
    """HF's RepetitionPenaltyLogitsProcessor: each id present in `context` [N, W] (-1 = none) once."""
    n_rows, vocab = logits.shape
    present = torch.zeros(n_rows, vocab + 1, dtype=torch.bool, device=logits.device)
    present.scatter_(1, torch.where(context >= 0, context, vocab), True)
    penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(present[:, :vocab], penalised, logits)


def _nucleus(cfg: SamplingConfig, logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Renormalised law over the nucleus set (top-k / top-p by the configured rule)."""
    if cfg.top_k is None and cfg.top_p is None:
        return probs
    vocab = probs.shape[-1]
    if cfg.nucleus == "cosyvoice":
        kept = probs * _cosyvoice_taken(cfg, probs)  # probs * 1 is probs
        return kept / kept.sum(-1, keepdim=True)

    # HF rule: TopKLogitsWarper then TopPLogitsWarper on the renormalised result.
    filtered = logits
    if cfg.top_k is not None and cfg.top_k < vocab:
        kth = torch.topk(filtered, cfg.top_k, dim=-1).values[..., -1:]
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    if cfg.top_p is not None and cfg.top_p < 1.0:
        sorted_logits, order = filtered.sort(dim=-1, descending=False)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        remove_sorted = cum <= (1 - cfg.top_p)
        remove_sorted[..., -1] = False  # min_tokens_to_keep = 1
        remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
        filtered = filtered.masked_fill(remove, float("-inf"))
    return torch.softmax(filtered, dim=-1)


def _cosyvoice_taken(cfg: SamplingConfig, probs: torch.Tensor) -> torch.Tensor:
    """[N, V] bool: the tokens CosyVoice's loop takes. It walks the law in descending order (a stable sort: equal
    probabilities by id) while the mass before a token is < top_p and fewer than top_k are taken. Only the top_k
    largest can be taken, so they come from topk, not a sort of the vocabulary (sorting [4, 6564] rows costs
    milliseconds on a CPU, topk tens of microseconds); the n taken are the n largest with ties at the smallest
    of them settled by id, as the stable sort settles them."""
    vocab = probs.shape[-1]
    values = probs.topk(min(cfg.top_k or vocab, vocab), dim=-1).values  # descending: the sorted law's head
    if cfg.top_p is None:
        n = torch.full_like(values[:, :1], values.shape[-1], dtype=torch.long)
    else:
        before = values.cumsum(-1) - values  # the mass before each token
        n = (before < cfg.top_p).sum(-1, keepdim=True).clamp_min(1)
    smallest = values.gather(-1, n - 1)
    above, tied = probs > smallest, probs == smallest
    return above | (tied & (tied.cumsum(-1) <= n - above.sum(-1, keepdim=True)))


def _ras(cfg: SamplingConfig, nucleus: torch.Tensor, probs: torch.Tensor, window: torch.Tensor | None):
    """Closed form of repetition-aware sampling (docs/targets.md §2.3)."""
    n_rows, vocab = probs.shape
    if window is None:
        window = torch.full((n_rows, 0), -1, dtype=torch.long, device=probs.device)
    window = window[:, -cfg.ras_window :] if window.shape[1] else window
    valid = window >= 0
    counts = torch.zeros(n_rows, vocab + 1, dtype=probs.dtype, device=probs.device)
    counts.scatter_add_(1, torch.where(valid, window, vocab), valid.to(probs.dtype))
    repeated = counts[:, :vocab] >= cfg.ras_window * cfg.ras_tau
    kept = nucleus.masked_fill(repeated, 0.0)
    rejected = nucleus - kept  # exactly the nucleus mass of the repeated ids, 0 elsewhere
    if cfg.ras_variant == "classic":
        return kept + rejected.sum(-1, keepdim=True) * probs
    # Fallback excludes the repeated id x: p(y)[y != x] / (1 - p(x)), weighted by n(x).
    weight = rejected / (1 - probs).clamp_min(torch.finfo(probs.dtype).tiny)
    return kept + probs * (weight.sum(-1, keepdim=True) - weight)


def sample(probs: torch.Tensor, generator: RowRandom | torch.Generator | None = None) -> torch.Tensor:
    """One token per row from probabilities [N, V] -> LongTensor [N], by inverse CDF of one uniform per row.

    Row n uses one number of ITS OWN stream (`RowRandom` row n), so its token does not depend on the
    other rows; a torch.Generator (or None) seeds fresh row streams. Rows need not sum to 1.
    """
    rows = RowRandom.of(generator, probs.shape[0], probs.device)
    return inverse_cdf(probs, rows.uniform(1, dtype=probs.dtype)).squeeze(-1)


# a CPU scalar: elementwise ops take it beside tensors of any device and float dtype
_DOWN = torch.tensor(-math.inf)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The tokens [N, T] at which uniforms u [N, T] fall in each row's CDF of probs [N, V] (rows need not sum
    to 1); never a token without mass (an all-zero row, which has none, gives token 0)."""
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:]
    # u * total can round up to total, past every token: the target stays below the float under total, so the
    # first CDF entry above it belongs to a token with mass and always exists (an all-zero row's target is
    # negative: its first entry)
    below = torch.minimum(u * total, torch.nextafter(total, _DOWN))
    # the clamp keeps a NaN row inside the vocabulary, so the caller's check of the logits names the fault
    return torch.searchsorted(cdf, below, right=True).clamp(max=probs.shape[-1] - 1)
