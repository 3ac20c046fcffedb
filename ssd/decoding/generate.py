"""The decoding loops: AR baseline and speculative decoding, batch-first.

Bookkeeping (per row, every row its own length):
  target cache = all emitted tokens but the last one, which is `pending_t` [B, 1];
  draft cache  = all emitted tokens but the last two (`pending_d` [B, 2]; [B, 1] in round 1).
One round with draft length k:
  draft:  feed pending_d, then sample x_1..x_k (k draft calls: pending_d, x_1..x_{k-1});
  target: feed [pending_t, x_1..x_k] in ONE call -> q_1..q_{k+1};
  rule:   n accepted, next token y (replacement, or bonus from q_{k+1});
  both caches roll back k - n; pending_t = [y], pending_d = [token before y, y].
Rows that finished keep running with n forced to 0 (their caches grow by one token a
round) so that the batch stays rectangular; their output is frozen.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ssd.contracts import SpeechLM
from ssd.decoding.acceptance import AcceptanceRule
from ssd.decoding.sampling import SamplingConfig, distribution, sample


@dataclass
class AdaptiveDraftLength:
    """HF assisted-generation heuristic: +2 after a fully accepted round, -1 otherwise."""

    min_len: int = 1
    max_len: int = 8
    increase: int = 2
    decrease: int = 1

    def next(self, k: int, all_accepted: bool) -> int:
        k = k + self.increase if all_accepted else k - self.decrease
        return max(self.min_len, min(self.max_len, k))


@dataclass
class DecodeStats:
    """What a decode did. Counts only rows that were still generating."""

    rounds: int = 0
    target_calls: int = 0  # forward passes after prefill
    draft_calls: int = 0
    tokens: int = 0  # emitted tokens (stop tokens not counted)
    proposed: list[int] = field(default_factory=list)  # [position] rows that reached draft position i
    accepted: list[int] = field(default_factory=list)  # [position] rows that kept draft token i
    overlap_sum: list[float] = field(default_factory=list)  # [position] Σ_t Σ_x min(p_t, q_t)
    tv_sum: list[float] = field(default_factory=list)  # [position] Σ_t TV(rule's output law, q_t)
    accepted_per_round: list[list[int]] = field(default_factory=list)
    draft_len_per_round: list[int] = field(default_factory=list)
    time_prefill: float = 0.0
    time_draft: float = 0.0
    time_verify: float = 0.0
    time_accept: float = 0.0

    def _grow(self, k: int) -> None:
        for lst, zero in (
            (self.proposed, 0),
            (self.accepted, 0),
            (self.overlap_sum, 0.0),
            (self.tv_sum, 0.0),
        ):
            lst.extend([zero] * (k - len(lst)))

    @property
    def time_total(self) -> float:
        return self.time_prefill + self.time_draft + self.time_verify + self.time_accept

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / proposed draft tokens (positions reached)."""
        return sum(self.accepted) / max(1, sum(self.proposed))

    @property
    def alpha_per_position(self) -> list[float]:
        """P(draft token i kept | tokens before it kept)."""
        return [a / p if p else float("nan") for a, p in zip(self.accepted, self.proposed)]

    @property
    def overlap_per_position(self) -> list[float]:
        """Mean β_t = Σ_x min(p_t, q_t) at each position (no sampling noise)."""
        return [s / p if p else float("nan") for s, p in zip(self.overlap_sum, self.proposed)]

    @property
    def tv_per_position(self) -> list[float]:
        return [s / p if p else float("nan") for s, p in zip(self.tv_sum, self.proposed)]

    @property
    def mean_accepted_length(self) -> float:
        """Mean number of draft tokens kept per round and row."""
        rows = [n for r in self.accepted_per_round for n in r]
        return sum(rows) / max(1, len(rows))

    @property
    def tokens_per_target_call(self) -> float:
        return self.tokens / max(1, self.target_calls)

    def summary(self) -> dict:
        return {
            "rounds": self.rounds,
            "tokens": self.tokens,
            "target_calls": self.target_calls,
            "draft_calls": self.draft_calls,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "tokens_per_target_call": self.tokens_per_target_call,
            "alpha_per_position": self.alpha_per_position,
            "overlap_per_position": self.overlap_per_position,
            "tv_per_position": self.tv_per_position,
            "time_prefill": self.time_prefill,
            "time_draft": self.time_draft,
            "time_verify": self.time_verify,
            "time_accept": self.time_accept,
            "time_total": self.time_total,
        }


@dataclass
class DecodeResult:
    tokens: list[list[int]]  # per row, stop token excluded
    finish_reason: list[str]  # "stop" | "max_len"
    stats: DecodeStats


class _Clock:
    """Phase timer; synchronises CUDA so GPU time lands in the right phase."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.last = self._now()

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def lap(self) -> float:
        now = self._now()
        elapsed, self.last = now - self.last, now
        return elapsed


class _Output:
    """Emitted tokens per row, the generated-history window, stop/max_len handling."""

    def __init__(self, batch: int, max_len: torch.Tensor, cfg: SamplingConfig, device, model=None, prompt=None,
                 slack: int = 0):  # fmt: skip
        self.max_len = max_len.to(device)
        self.stop = torch.tensor(cfg.stop_tokens or (-2,), dtype=torch.long, device=device)
        cap = int(self.max_len.max()) + 1
        self.history = torch.full((batch, cap), -1, dtype=torch.long, device=device)
        self.context = _context_columns(cfg, model, prompt, batch, slack, device)
        self.generated_window = cap if cfg.whole_context else cfg.window  # a whole-context law sees them all
        self.window = self.context.shape[1] + self.generated_window  # width of last_window()
        self.count = torch.zeros(batch, dtype=torch.long, device=device)
        self.done = torch.zeros(batch, dtype=torch.bool, device=device)
        self.reason = ["max_len"] * batch

    def last_window(self) -> torch.Tensor:
        """[B, W]: the last W generated tokens, -1 where fewer exist (a whole-context law: after the prompt's ids)."""
        w = self.generated_window
        idx = self.count.unsqueeze(-1) - w + torch.arange(w, device=self.count.device)
        generated = torch.where(idx >= 0, self.history.gather(1, idx.clamp_min(0)), -1)
        return torch.cat([self.context, generated], 1) if self.context.shape[1] else generated

    def emit(self, block: torch.Tensor, block_len: torch.Tensor) -> torch.Tensor:
        """Append block[b, :block_len[b]] to each active row, cut at a stop token or max_len.

        Returns the number of tokens each row actually emitted (0 for finished rows).
        """
        k = block.shape[1]
        pos = torch.arange(k, device=block.device)
        is_stop = torch.isin(block, self.stop) & (pos < block_len.unsqueeze(-1))
        first_stop = torch.where(is_stop.any(-1), is_stop.float().argmax(-1), k)
        room = self.max_len - self.count
        n = torch.minimum(torch.minimum(block_len, first_stop), room).clamp_min(0)
        n = torch.where(self.done, 0, n)
        write = pos < n.unsqueeze(-1)
        idx = (self.count.unsqueeze(-1) + pos).clamp(max=self.history.shape[1] - 1)
        self.history.scatter_(1, idx, torch.where(write, block, self.history.gather(1, idx)))
        self.count += n
        stopped = ~self.done & (first_stop < block_len) & (first_stop < room)
        for b in stopped.nonzero().flatten().tolist():
            self.reason[b] = "stop"
        self.done |= stopped | (self.count >= self.max_len)
        return n

    def tokens(self) -> list[list[int]]:
        return [row[:n].tolist() for row, n in zip(self.history.cpu(), self.count.cpu().tolist())]


def _context_columns(cfg: SamplingConfig, model, prompt, batch: int, slack: int, device) -> torch.Tensor:
    """[B, slack + P]: for a whole-context law, the prompt's ids in head space (model.context_ids), -1-padded
    on the left; the `slack` leading -1 columns keep them in every verification window (_verification_windows
    shifts by one column per draft position). [B, 0] for other laws."""
    if not cfg.whole_context:
        return torch.empty(batch, 0, dtype=torch.long, device=device)
    if not hasattr(model, "context_ids"):
        raise TypeError(
            f"sampling.repetition_penalty needs the prompt's ids: {type(model).__name__} has no context_ids(prompt) "
            "(ssd.contracts.SpeechLM); set sampling.repetition_penalty=null for this model"
        )
    rows = [
        torch.as_tensor(r, dtype=torch.long, device=device).reshape(-1) for r in model.context_ids(prompt)
    ]
    width = slack + max((r.numel() for r in rows), default=0)
    return torch.stack([torch.cat([r.new_full((width - r.numel(),), -1), r]) for r in rows])


def _as_rows(value, batch: int, device) -> torch.Tensor:
    return torch.as_tensor(value, dtype=torch.long, device=device).expand(batch).clone()


def _first_token(logits, cfg, out, min_len, generator):
    law = distribution(cfg, logits.to(torch.float32), out.last_window(), out.count, min_len)
    token = sample(law, generator)
    out.emit(token.unsqueeze(-1), torch.ones_like(token))
    return token


def decode_ar(
    model: SpeechLM,
    prompt,
    sampling: SamplingConfig,
    *,
    max_len,
    min_len=0,
    batch_size: int | None = None,
    generator: torch.Generator | None = None,
    role: str = "target",
) -> DecodeResult:
    """Autoregressive sampling from `sampling`'s law, one model call per token. `role` names the model in
    errors ("target", or "draft" for the draft alone)."""
    stats = DecodeStats()
    cache, logits = model.prefill(prompt, int(torch.as_tensor(max_len).max()) + 1)
    device, batch = logits.device, logits.shape[0]
    clock = _Clock(device)
    max_len, min_len = _as_rows(max_len, batch, device), _as_rows(min_len, batch, device)
    out = _Output(batch, max_len, sampling, device, model, prompt)
    with _naming_non_finite_logits(lambda: {role: logits}, out):
        token = _first_token(logits, sampling, out, min_len, generator)
        stats.time_prefill = clock.lap()
        while not out.done.all():
            logits = model.extend(cache, token.unsqueeze(-1))[:, -1]
            stats.target_calls += 1
            stats.time_verify += clock.lap()
            token = _first_token(logits, sampling, out, min_len, generator)
            stats.time_accept += clock.lap()
    stats.tokens = int(out.count.sum())
    return DecodeResult(out.tokens(), out.reason, stats)


@contextmanager
def _naming_non_finite_logits(latest: Callable[[], dict[str, torch.Tensor | None]], out: _Output):
    """torch.multinomial only says "probability tensor contains inf/nan"; name the model and the step.
    The check runs only after such a failure, so the decode loop stays free of extra host syncs."""
    try:
        yield
    except RuntimeError as err:
        if "probability tensor" not in str(err):
            raise
        for role, logits in latest().items():
            finite = (
                torch.isfinite(logits).reshape(logits.shape[0], -1).all(-1) if logits is not None else None
            )
            if finite is not None and not finite.all():
                raise FloatingPointError(
                    f"the {role}'s logits are NaN/inf at generated token {int(out.count.min())} (batch rows "
                    f"{(~finite).nonzero().flatten().tolist()}): check the {role}'s weights (its checkpoint, and its "
                    "dtype: float16 can overflow)"
                ) from err
        raise


def _verification_windows(last_window: torch.Tensor, draft_tokens: torch.Tensor, window: int) -> torch.Tensor:
    """History windows for draft positions 0..k: position i sees the generated tokens
    extended by the draft tokens x_<i (the target's law q_i depends on them). [B, k+1, W]"""
    if window == 0:
        return last_window.new_empty(last_window.shape[0], draft_tokens.shape[1] + 1, 0)
    return torch.cat([last_window, draft_tokens], dim=1).unfold(1, window, 1)


def _draft_token(cfg: SamplingConfig, logits, window, step, min_len, generator):
    """The draft's token and the law it was ACTUALLY drawn from."""
    law = distribution(cfg, logits.to(torch.float32), window, step, min_len)
    return sample(law, generator), law


def decode_speculative(
    target: SpeechLM,
    draft: SpeechLM,
    prompt,
    sampling: SamplingConfig,
    rule: AcceptanceRule,
    *,
    draft_len: int,
    max_len,
    min_len=0,
    draft_sampling: SamplingConfig | None = None,
    adaptive: AdaptiveDraftLength | None = None,
    generator: torch.Generator | None = None,
    track_tv: bool | None = None,
    verify_rows: int | None = None,
    propose: Callable = _draft_token,
    history_windows: Callable = _verification_windows,
) -> DecodeResult:
    """Speculative decoding of `target` with `draft`, verified by `rule`.

    sampling: the target's law (also the draft's unless draft_sampling is given).
    track_tv: log the exact per-step TV between the rule's output law and q
              (default: on for inexact rules whose law is O(V) to compute, e.g. tolerance β > 0).
    verify_rows: pad every verify call to this many rows (filler rows are rolled back unread).
              On CPUs a matmul of 8 rows can cost less than one of 4-5 (docs/cpu-physics.md);
              `scripts/bench_decoding.py --verify-rows 8` measures whether it pays on yours.
    propose, history_windows: seams for research variants and the certificates' negative controls.
              propose(cfg, logits, window, step, min_len, generator) -> (draft token, the law it was drawn
              from); history_windows(last_window, draft_tokens, W) -> the RAS history [B, k+1, W] of each
              verified position (the generated tokens extended by the earlier draft tokens).
    """
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"draft and target speak different vocabularies ({draft.vocab_size} vs {target.vocab_size} head "
            "entries): build the draft from this target (ssd.models.draft.build_draft)"
        )
    draft_sampling = draft_sampling or sampling
    track_tv = (not rule.exact and getattr(rule, "cheap_output_law", False)) if track_tv is None else track_tv
    stats = DecodeStats()
    k_max = adaptive.max_len if adaptive else draft_len
    # Finished rows keep running and grow one token a round; a verify block holds up to k_max+1 rows.
    room = 2 * int(torch.as_tensor(max_len).max()) + max(k_max + 1, verify_rows or 0) + 1
    cache_t, logits_t = target.prefill(prompt, room)
    cache_d, _ = draft.prefill(prompt, room)
    device, batch = logits_t.device, logits_t.shape[0]
    clock = _Clock(device)
    max_len, min_len = _as_rows(max_len, batch, device), _as_rows(min_len, batch, device)
    out = _Output(batch, max_len, sampling, device, target, prompt, slack=k_max + 1)
    logits_d = logits_v = None

    def latest() -> dict:  # the logits each model gave last (read only after a sampling failure)
        return {"draft": logits_d, "target": logits_v if logits_v is not None else logits_t}

    with _naming_non_finite_logits(latest, out):
        first = _first_token(logits_t, sampling, out, min_len, generator)  # exact: q of the prompt
        pending_t, pending_d = first.unsqueeze(-1), first.unsqueeze(-1)
        stats.time_prefill = clock.lap()
        k = draft_len
        rows = torch.arange(batch, device=device)

        while not out.done.all():
            active = ~out.done
            window, step = out.last_window(), out.count
            # Draft k tokens.
            logits_d = draft.extend(cache_d, pending_d)[:, -1]
            xs, ps = [], []
            for i in range(k):
                hist = history_windows(window, torch.stack(xs, 1) if xs else window[:, :0], out.window)
                x, p = propose(draft_sampling, logits_d, hist[:, -1], step + i, min_len, generator)
                xs.append(x)
                ps.append(p)
                if i < k - 1:
                    logits_d = draft.extend(cache_d, x.unsqueeze(-1))[:, -1]
            stats.draft_calls += k
            xs, ps = torch.stack(xs, 1), torch.stack(ps, 1)
            stats.time_draft += clock.lap()

            # Verify all k in one target call.
            block = torch.cat([pending_t, xs], 1)
            pad = max(0, (verify_rows or 0) - (k + 1))
            if pad:
                block = torch.cat([block, xs[:, -1:].expand(-1, pad)], 1)
            logits_v = target.extend(cache_t, block)[:, : k + 1].to(torch.float32)
            stats.target_calls += 1
            vocab = logits_v.shape[-1]
            steps = (step.unsqueeze(-1) + torch.arange(k + 1, device=device)).reshape(-1)
            qs = distribution(
                sampling,
                logits_v.reshape(-1, vocab),
                history_windows(window, xs, out.window).reshape(batch * (k + 1), -1),
                steps,
                min_len.repeat_interleave(k + 1),
            ).reshape(batch, k + 1, vocab)
            stats.time_verify += clock.lap()

            n_acc, y = rule.verify(ps, qs, xs, generator)
            n_acc = torch.where(active, n_acc, 0)
            _record_round(stats, rule, ps, qs[:, :k], n_acc, active, k, track_tv)
            block = torch.cat([xs, y.unsqueeze(-1)], 1)
            block[rows, n_acc] = y
            out.emit(block, n_acc + 1)

            target.rollback(cache_t, k - n_acc + pad)
            draft.rollback(cache_d, k - n_acc)
            before_y = torch.where(n_acc > 0, xs[rows, (n_acc - 1).clamp_min(0)], pending_t[:, 0])
            pending_t, pending_d = y.unsqueeze(-1), torch.stack([before_y, y], 1)
            stats.time_accept += clock.lap()
            if adaptive:
                k = adaptive.next(k, bool((n_acc[active] == k).all()))
    stats.tokens = int(out.count.sum())
    return DecodeResult(out.tokens(), out.reason, stats)


def _record_round(stats, rule, ps, qs, n_acc, active, k, track_tv) -> None:
    stats.rounds += 1
    stats.draft_len_per_round.append(k)
    stats.accepted_per_round.append(n_acc[active].tolist())
    stats._grow(k)
    # Position i was tested by the rule iff tokens before it were kept: i <= n_acc.
    reached = (torch.arange(k, device=n_acc.device) <= n_acc.unsqueeze(-1)) & active.unsqueeze(-1)
    kept = (torch.arange(k, device=n_acc.device) < n_acc.unsqueeze(-1)) & active.unsqueeze(-1)
    overlap = torch.minimum(ps, qs).sum(-1)
    tv = 0.5 * (rule.output_law(ps, qs) - qs).abs().sum(-1) if track_tv else torch.zeros_like(overlap)
    for i in range(k):
        stats.proposed[i] += int(reached[:, i].sum())
        stats.accepted[i] += int(kept[:, i].sum())
        stats.overlap_sum[i] += float(overlap[:, i][reached[:, i]].sum())
        stats.tv_sum[i] += float(tv[:, i][reached[:, i]].sum())
