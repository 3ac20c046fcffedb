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

Batch invariance: every random number comes from the row's own stream (`RowRandom`), and a row
draws the same count per round whatever its verdict, so row b decodes exactly as it would alone
(with a fixed draft length: adaptive k is shared by the batch).
Host syncs: one per round, the "all rows done?" check (the accepted counts, for the caches' rollback,
and adaptive's verdict ride on it). Statistics
stay on the device (`_Tally`) and are read once at the end; phase times are CUDA events on GPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ssd.contracts import SpeechLM
from ssd.decoding.acceptance import AUDIT_FIELDS, AcceptanceRule
from ssd.decoding.rng import RowRandom
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
    """What a decode did, summed over rows. Counts only rows that were still generating.

    tv_sum is None when TV was not computed (an inexact rule without diagnostics); it is 0 for a rule
    that preserves the target law (known, not computed). overlap_sum is None without diagnostics.
    """

    rounds: int = 0
    target_calls: int = 0  # forward passes after prefill
    draft_calls: int = 0
    tokens: int = 0  # emitted tokens (stop tokens not counted)
    proposed: list[int] = field(default_factory=list)  # [position] rows that reached draft position i
    accepted: list[int] = field(default_factory=list)  # [position] rows that kept draft token i
    overlap_sum: list[float] | None = field(default_factory=list)  # [position] Σ_t Σ_x min(p_t, q_t)
    tv_sum: list[float] | None = field(default_factory=list)  # [position] Σ_t TV(rule's output law, q_t)
    accepted_per_round: list[list[int]] = field(default_factory=list)  # [round] kept per active row
    draft_len_per_round: list[int] = field(default_factory=list)
    time_prefill: float = 0.0
    time_draft: float = 0.0
    time_verify: float = 0.0
    time_accept: float = 0.0
    time_diagnostics: float = 0.0  # overlap and TV bookkeeping: not part of time_total

    @property
    def time_total(self) -> float:
        """The decode's time as a deployment runs it (diagnostics excluded)."""
        return self.time_prefill + self.time_draft + self.time_verify + self.time_accept

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / proposed draft tokens (positions reached)."""
        return sum(self.accepted) / max(1, sum(self.proposed))

    @property
    def alpha_per_position(self) -> list[float]:
        """P(draft token i kept | tokens before it kept)."""
        return _per_position(self.accepted, self.proposed)

    @property
    def overlap_per_position(self) -> list[float]:
        """Mean β_t = Σ_x min(p_t, q_t) at each position (no sampling noise); NaN where not computed."""
        return _per_position(self.overlap_sum, self.proposed)

    @property
    def tv_per_position(self) -> list[float]:
        """Mean TV(output law, q_t) at each position; NaN where not computed."""
        return _per_position(self.tv_sum, self.proposed)

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
            "time_diagnostics": self.time_diagnostics,
            "time_total": self.time_total,
        }


def _per_position(sums: list[float] | None, proposed: list[int]) -> list[float]:
    if sums is None:
        return [float("nan")] * len(proposed)
    return [s / p if p else float("nan") for s, p in zip(sums, proposed)]


@dataclass
class DecodeResult:
    """tokens, finish_reason and rows: one entry per batch row; stats: the batch as a whole.

    rows[b] holds row b's own counts while it was active, keys: rounds, target_calls, draft_calls,
    tokens (int); proposed, accepted ([k_max] ints); overlap_sum ([k_max] floats, None without
    diagnostics); tv_sum ([k_max] floats, None when not computed); accepted_per_round and
    draft_len_per_round ([rounds] ints). A row's entry is the same whatever batch it was decoded in.
    """

    tokens: list[list[int]]  # per row, stop token excluded
    finish_reason: list[str]  # "stop" | "max_len"
    stats: DecodeStats
    rows: list[dict] = field(default_factory=list)


def _model_device(model) -> torch.device:
    """Where the model runs, known before its first call (the clock starts before prefill); a model
    without a `device` attribute is timed as a CPU model."""
    return torch.device(getattr(model, "device", "cpu"))


class _Clock:
    """Phase timer without host syncs: CUDA events on GPU (read once, in `totals`), perf_counter on CPU.

    Starts before prefill; `lap(phase)` charges the time since the previous lap to `phase`.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.laps: list[tuple[str, object]] = []
        self.start = self._mark()

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def lap(self, phase: str) -> None:
        self.laps.append((phase, self._mark()))

    def totals(self) -> dict[str, float]:
        """Seconds per phase (one CUDA sync)."""
        if self.cuda and self.laps:
            self.laps[-1][1].synchronize()
        totals: dict[str, float] = {}
        previous = self.start
        for phase, mark in self.laps:
            elapsed = previous.elapsed_time(mark) / 1000 if self.cuda else mark - previous
            totals[phase] = totals.get(phase, 0.0) + elapsed
            previous = mark
        return totals

    def write(self, stats: DecodeStats) -> None:
        for phase, seconds in self.totals().items():
            setattr(stats, f"time_{phase}", seconds)


class _Output:
    """Emitted tokens per row, the generated-history window, stop/max_len handling (all on the device)."""

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
        self.stopped = torch.zeros(batch, dtype=torch.bool, device=device)  # ended by a stop token
        self.bad_law = torch.zeros((), dtype=torch.bool, device=device)  # a law held NaN/inf

    def watch(self, law: torch.Tensor) -> torch.Tensor:
        """Note (on the device) whether a sampling law is NaN/inf; `sync` reports it."""
        self.bad_law |= ~torch.isfinite(law).all()
        return law

    def sync(self, latest: Callable[[], dict], *values: torch.Tensor) -> list:
        """The round's one host sync: [all rows done?, *values], each value a scalar (read as an int) or a
        [B] tensor (read as a list); raises FloatingPointError after a NaN/inf law."""
        parts = [self.done.all(), self.bad_law, *values]
        flat = torch.cat([p.reshape(-1).long() for p in parts]).tolist()
        read, at = [], 0
        for p in parts:
            n = p.numel()
            read.append(flat[at] if p.dim() == 0 else flat[at : at + n])
            at += n
        done, bad, *rest = read
        if bad:
            _raise_non_finite(latest, self)
        return [bool(done), *rest]

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
        self.stopped |= stopped
        self.done |= stopped | (self.count >= self.max_len)
        return n

    def tokens(self) -> list[list[int]]:
        return [row[:n].tolist() for row, n in zip(self.history.cpu(), self.count.cpu().tolist())]

    def reasons(self) -> list[str]:
        return ["stop" if s else "max_len" for s in self.stopped.tolist()]


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
    law = out.watch(distribution(cfg, logits.to(torch.float32), out.last_window(), out.count, min_len))
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
    generator: RowRandom | torch.Generator | None = None,
    role: str = "target",
) -> DecodeResult:
    """Autoregressive sampling from `sampling`'s law, one model call per token. `role` names the model in
    errors ("target", or "draft" for the draft alone).

    generator: one random stream per row (a RowRandom gives row b the same tokens in any batch; a
    torch.Generator or None seeds fresh streams). One host sync per token (the "all rows done?" check).
    """
    stats = DecodeStats()
    clock = _Clock(_model_device(model))
    cache, logits = model.prefill(prompt, int(torch.as_tensor(max_len).max()) + 1)
    device, batch = logits.device, logits.shape[0]
    generator = RowRandom.of(generator, batch, device)
    max_len, min_len = _as_rows(max_len, batch, device), _as_rows(min_len, batch, device)
    out = _Output(batch, max_len, sampling, device, model, prompt)
    calls = torch.zeros(batch, dtype=torch.long, device=device)  # model calls while each row was active

    def latest() -> dict:
        return {role: logits}

    token = _first_token(logits, sampling, out, min_len, generator)
    (finished,) = out.sync(latest)
    clock.lap("prefill")
    while not finished:
        calls += ~out.done
        logits = model.extend(cache, token.unsqueeze(-1))[:, -1]
        stats.target_calls += 1
        clock.lap("verify")
        token = _first_token(logits, sampling, out, min_len, generator)
        (finished,) = out.sync(latest)
        clock.lap("accept")
    clock.write(stats)
    counts = out.count.tolist()
    stats.tokens = sum(counts)
    rows = [
        {"rounds": 0, "target_calls": c, "draft_calls": 0, "tokens": n, "proposed": [], "accepted": [],
         "overlap_sum": [], "tv_sum": [], "accepted_per_round": [], "draft_len_per_round": []}
        for c, n in zip(calls.tolist(), counts)
    ]  # fmt: skip
    return DecodeResult(out.tokens(), out.reasons(), stats, rows)


def _raise_non_finite(latest: Callable[[], dict[str, torch.Tensor | None]], out: _Output) -> None:
    """A sampling law held NaN/inf: name the model whose logits did it, and the step."""
    for role, logits in latest().items():
        finite = torch.isfinite(logits).reshape(logits.shape[0], -1).all(-1) if logits is not None else None
        if finite is not None and not finite.all():
            raise FloatingPointError(
                f"the {role}'s logits are NaN/inf at generated token {int(out.count.min())} (batch rows "
                f"{(~finite).nonzero().flatten().tolist()}): check the {role}'s weights (its checkpoint, and its "
                "dtype: float16 can overflow)"
            )
    raise FloatingPointError(
        f"a sampling law is NaN/inf at generated token {int(out.count.min())} although the logits are finite: "
        "check the sampling config (e.g. every token masked)"
    )


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


class _Tally:
    """Per-row counts of a speculative decode, kept on the device and read once at the end.

    proposed/accepted [B, k_max]: rows that reached / kept draft position i; overlap, tv [B, k_max] float64
    sums over reached positions (None when not computed); per_round: n accepted per round, -1 where the
    row had finished.
    """

    def __init__(self, batch: int, k_max: int, device, overlap: bool, tv: bool):
        def zeros(dtype):
            return torch.zeros(batch, k_max, dtype=dtype, device=device)

        self.proposed, self.accepted = zeros(torch.long), zeros(torch.long)
        self.overlap = zeros(torch.float64) if overlap else None
        self.tv = zeros(torch.float64) if tv else None
        self.per_round: list[torch.Tensor] = []
        self.draft_len: list[int] = []
        self.k_max = k_max
        # The β audit, per round: (fields [B, k, F], kept [B, k]).
        self.audits: list[tuple[torch.Tensor, torch.Tensor]] = []

    def count(self, n_acc: torch.Tensor, active: torch.Tensor, k: int) -> torch.Tensor:
        """Record a round's verdicts; returns reached [B, k]: position i was tested by the rule."""
        pos = torch.arange(k, device=n_acc.device)
        reached = (pos <= n_acc.unsqueeze(-1)) & active.unsqueeze(-1)
        self.proposed[:, :k] += reached
        self.accepted[:, :k] += (pos < n_acc.unsqueeze(-1)) & active.unsqueeze(-1)
        self.per_round.append(torch.where(active, n_acc, -1))
        self.draft_len.append(k)
        return reached

    def diagnose(self, rule: AcceptanceRule, ps, qs, reached) -> None:
        """β_t = Σ_x min(p_t, q_t) and the exact TV of the rule's output law: compute a deployment skips."""
        k = ps.shape[1]
        if self.overlap is not None:
            self.overlap[:, :k] += torch.where(reached, torch.minimum(ps, qs).sum(-1).double(), 0.0)
        if self.tv is not None:
            tv = 0.5 * (rule.output_law(ps, qs) - qs).abs().sum(-1)
            self.tv[:, :k] += torch.where(reached, tv.double(), 0.0)

    def audit(self, fields: torch.Tensor, n_acc: torch.Tensor, active: torch.Tensor) -> None:
        """Keep a round's β-audit fields (`ToleranceRule.audit`) of the draft tokens that were kept."""
        k = fields.shape[1]
        kept = (torch.arange(k, device=n_acc.device) < n_acc.unsqueeze(-1)) & active.unsqueeze(-1)
        pad = self.k_max - k  # adaptive rounds are shorter
        self.audits.append(
            (torch.nn.functional.pad(fields, (0, 0, 0, pad)), torch.nn.functional.pad(kept, (0, pad)))
        )

    def audit_rows(self, batch: int) -> list[dict | None]:
        """Per row: {field: [value per kept draft token, in order]} (one device read), or None without audit."""
        if not self.audits:
            return [None] * batch
        fields = torch.stack([f for f, _ in self.audits], 1).cpu()  # [B, R, k, F]
        kept = torch.stack([m for _, m in self.audits], 1).cpu()
        out = []
        for b in range(batch):
            values = fields[b][kept[b]]  # [n kept, F], in round then position order
            out.append({name: values[:, i].tolist() for i, name in enumerate(AUDIT_FIELDS)})
        return out

    def rows(self, counts: list[int], tv_is_zero: bool) -> list[dict]:
        """One dict per row (the DecodeResult.rows contract); the only device reads of the decode's stats."""
        per_round = torch.stack(self.per_round, 1).tolist() if self.per_round else [[] for _ in counts]
        self.by_round = [list(r) for r in zip(*per_round)]  # [round][row], for the batch-level stats
        proposed, accepted = self.proposed.tolist(), self.accepted.tolist()
        overlap = self.overlap.tolist() if self.overlap is not None else [None] * len(counts)
        k_max = self.proposed.shape[1]
        if self.tv is not None:
            tv = self.tv.tolist()
        else:
            tv = [[0.0] * k_max if tv_is_zero else None for _ in counts]
        audits = self.audit_rows(len(counts))
        rows = []
        for b, n_tokens in enumerate(counts):
            live = [r for r, n in enumerate(per_round[b]) if n >= 0]
            rows.append({
                "rounds": len(live), "target_calls": len(live),
                "draft_calls": sum(self.draft_len[r] for r in live), "tokens": n_tokens,
                "proposed": proposed[b], "accepted": accepted[b], "overlap_sum": overlap[b], "tv_sum": tv[b],
                "accepted_per_round": [per_round[b][r] for r in live],
                "draft_len_per_round": [self.draft_len[r] for r in live],
            })  # fmt: skip
            if audits[b] is not None:
                rows[-1]["beta_audit"] = audits[b]
        return rows


def _batch_stats(stats: DecodeStats, rows: list[dict], tally: _Tally) -> None:
    """The batch-level sums of the per-row counts (after `tally.rows`)."""

    def total(key):
        if any(row[key] is None for row in rows):
            return None
        return [sum(values) for values in zip(*(row[key] for row in rows))]

    stats.tokens = sum(row["tokens"] for row in rows)
    stats.proposed, stats.accepted = total("proposed"), total("accepted")
    stats.overlap_sum, stats.tv_sum = total("overlap_sum"), total("tv_sum")
    stats.accepted_per_round = [[n for n in r if n >= 0] for r in tally.by_round]
    stats.draft_len_per_round = list(tally.draft_len)


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
    generator: RowRandom | torch.Generator | None = None,
    diagnostics: bool = True,
    track_tv: bool | None = None,
    verify_rows: int | None = None,
    propose: Callable = _draft_token,
    history_windows: Callable = _verification_windows,
) -> DecodeResult:
    """Speculative decoding of `target` with `draft`, verified by `rule`.

    sampling: the target's law (also the draft's unless draft_sampling is given).
    generator: one random stream per row. With a RowRandom, row b gets exactly the tokens and per-row
              stats it gets decoded alone with its seed (a fixed draft_len; adaptive k is shared by the
              batch, so adaptive decoding accepts batch 1 only). A torch.Generator or None seeds fresh streams.
    diagnostics: compute β_t overlaps and (see track_tv) the exact TV, timed apart in stats.time_diagnostics
              (not in time_total); off, overlap_sum is None and TV is not computed. A rule that
              `audits_acceptance` (tolerance with audit_groups) also fills rows[b]["beta_audit"]:
              `ToleranceRule.audit`'s fields for every kept draft token.
    track_tv: log the exact per-step TV between the rule's output law and q (default: on for rules that do
              not preserve q and whose law is O(V) to compute, e.g. tolerance β > 0, greedy). Untracked TV is
              None, or 0 for a rule that preserves the target law.
    verify_rows: pad every verify call to this many rows (filler rows are rolled back unread).
              On CPUs a matmul of 8 rows can cost less than one of 4-5 (docs/cpu-physics.md);
              `scripts/bench_decoding.py --verify-rows 8` measures whether it pays on yours.
    propose, history_windows: seams for research variants and the certificates' negative controls.
              propose(cfg, logits, window, step, min_len, generator) -> (draft token, the law it was drawn
              from); history_windows(last_window, draft_tokens, W) -> the RAS history [B, k+1, W] of each
              verified position (the generated tokens extended by the earlier draft tokens).
    Host syncs: one per round (the "all rows done?" check, which also reads the accepted counts the caches
    roll back by, and adaptive's verdict); the statistics are read once at the end.
    """
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"draft and target speak different vocabularies ({draft.vocab_size} vs {target.vocab_size} head "
            "entries): build the draft from this target (ssd.models.draft.build_draft)"
        )
    if not hasattr(rule, "preserves_target_law"):
        raise TypeError(
            f"acceptance rule {type(rule).__name__} has no preserves_target_law: declare whether its output law "
            "is the target's q (ssd.contracts.AcceptanceRule)"
        )
    if track_tv and not diagnostics:
        raise ValueError("track_tv=True needs diagnostics=True (TV is a diagnostic): drop one of them")
    draft_sampling = draft_sampling or sampling
    if track_tv is None:
        track_tv = not rule.preserves_target_law and getattr(rule, "cheap_output_law", False)
    track_tv = track_tv and diagnostics
    # The β audit (ToleranceRule.audit): which kept draft tokens only β admitted; a diagnostic, off the clock.
    audit = diagnostics and getattr(rule, "audits_acceptance", False)
    stats = DecodeStats()
    k_max = adaptive.max_len if adaptive else draft_len
    # Finished rows keep running and grow one token a round; a verify block holds up to k_max+1 rows.
    room = 2 * int(torch.as_tensor(max_len).max()) + max(k_max + 1, verify_rows or 0) + 1
    clock = _Clock(_model_device(target))
    cache_t, logits_t = target.prefill(prompt, room)
    cache_d, _ = draft.prefill(prompt, room)
    device, batch = logits_t.device, logits_t.shape[0]
    if adaptive and batch > 1:
        raise ValueError(
            f"adaptive draft length shares one k across the batch, so a row's tokens would depend on the "
            f"other rows: decode adaptive runs one utterance at a time (got a batch of {batch}), or set a "
            "fixed draft_len"
        )
    generator = RowRandom.of(generator, batch, device)
    max_len, min_len = _as_rows(max_len, batch, device), _as_rows(min_len, batch, device)
    out = _Output(batch, max_len, sampling, device, target, prompt, slack=k_max + 1)
    tally = _Tally(batch, k_max, device, overlap=diagnostics, tv=track_tv)
    logits_d = logits_v = None

    def latest() -> dict:  # the logits each model gave last (read only after a sampling failure)
        return {"draft": logits_d, "target": logits_v if logits_v is not None else logits_t}

    first = _first_token(logits_t, sampling, out, min_len, generator)  # exact: q of the prompt
    pending_t, pending_d = first.unsqueeze(-1), first.unsqueeze(-1)
    (finished,) = out.sync(latest)
    clock.lap("prefill")
    k = draft_len
    rows = torch.arange(batch, device=device)

    while not finished:
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
        xs, ps = torch.stack(xs, 1), out.watch(torch.stack(ps, 1))
        clock.lap("draft")

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
        out.watch(qs)
        clock.lap("verify")

        if audit:  # the same verdicts and draws; the uniforms are kept for the diagnostic below
            n_acc, y, uniforms = rule.verify_draws(ps, qs, xs, generator)
        else:
            n_acc, y = rule.verify(ps, qs, xs, generator)
        n_acc = torch.where(active, n_acc, 0)
        stats.rounds += 1
        reached = tally.count(n_acc, active, k)
        block = torch.cat([xs, y.unsqueeze(-1)], 1)
        block[rows, n_acc] = y
        out.emit(block, n_acc + 1)

        before_y = torch.where(n_acc > 0, xs[rows, (n_acc - 1).clamp_min(0)], pending_t[:, 0])
        pending_t, pending_d = y.unsqueeze(-1), torch.stack([before_y, y], 1)
        # The round's one sync also reads the accepted counts, so the caches roll back by host ints
        # (an eager cache, sliced by ints, then needs no sync of its own) and adaptive gets its verdict.
        verdict = (((n_acc == k) | ~active).all(),) if adaptive else ()
        finished, *all_kept, accepted = out.sync(latest, *verdict, n_acc)
        target.rollback(cache_t, [k - a + pad for a in accepted])
        draft.rollback(cache_d, [k - a for a in accepted])
        if adaptive:
            k = adaptive.next(k, bool(all_kept[0]))
        clock.lap("accept")
        if diagnostics:
            tally.diagnose(rule, ps, qs[:, : ps.shape[1]], reached)
            if audit:
                tally.audit(rule.audit(ps, qs[:, : ps.shape[1]], xs, uniforms), n_acc, active)
            clock.lap("diagnostics")
    clock.write(stats)
    result_rows = tally.rows(out.count.tolist(), tv_is_zero=rule.preserves_target_law)
    _batch_stats(stats, result_rows, tally)
    return DecodeResult(out.tokens(), out.reasons(), stats, result_rows)
