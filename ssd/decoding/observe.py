"""What a decode reports beyond its tokens: phase times, acceptance tallies, β_t overlaps, the exact TV drift
of inexact rules and the β audit. All of it lives in one observer handed to the loop; the loops themselves
only call its hooks, and without an observer (`Observer()`, the default) a decode computes none of it.

`Instruments` keeps its counts on the device and reads them once, at the end; its diagnostics (overlap, TV,
audit) run after the round's accept phase and are timed apart (`time_diagnostics`), so the phase times are
what a deployment pays.

Streaming (`Streaming`): an observer with `streams = True` is handed each round's tokens after verification
(`emitted`), read on the round's one host sync; nothing the drafter proposed reaches it unless the rule kept it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ssd.contracts import AuditedRule, ExplicitLawRule

PHASES = ("prefill", "draft", "verify", "accept", "diagnostics", "stream")


@dataclass
class DecodeStats:
    """What a decode did, summed over rows. Counts only rows that were still generating.

    tv_sum is None when TV was not computed (an inexact rule without diagnostics); it is 0 for a rule
    that preserves the target law (known, not computed). overlap_sum is None without diagnostics.
    draft_calls counts drafted positions (the model calls of an autoregressive drafter).
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
    time_diagnostics: float = 0.0  # overlap, TV and audit bookkeeping: not part of time_total
    time_stream: float = 0.0  # a streaming observer's sink (the vocoder's chunks): not part of time_total

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


def _per_position(sums: list[float] | None, proposed: list[int]) -> list[float]:
    if sums is None:
        return [float("nan")] * len(proposed)
    return [s / p if p else float("nan") for s, p in zip(sums, proposed)]


class Observer:
    """The hooks a decode calls; this base observes nothing and costs nothing."""

    # True: the loops read each round's verified tokens on the round's sync and hand them to `emitted`.
    streams: bool = False

    def begin(self, device: torch.device, positions: int = 0) -> None:
        """Before prefill (the clock starts here); `positions`: the most draft positions a round will have."""

    def lap(self, phase: str) -> None:
        """The time since the previous lap belongs to `phase` (one of PHASES)."""

    def verifier(self, rule: Any) -> Any:
        """The verify the loop calls: the rule's own, or one that also keeps what a diagnostic needs."""
        return rule.verify

    def step(self, active: torch.Tensor) -> None:
        """An autoregressive step of the rows `active` [B] (bool)."""

    def round(self, k: int, xs: torch.Tensor, ps: torch.Tensor, qs: torch.Tensor, n_acc: torch.Tensor,
              active: torch.Tensor) -> None:  # fmt: skip
        """A speculative round: k drafted, n_acc [B] kept (0 for inactive rows), after its accept phase."""

    def emitted(self, tokens: list[list[int]]) -> None:
        """Each row's tokens emitted by the step or round just verified (host ints, in order, stop tokens
        excluded; [] for a row that emitted none). Called only when `streams`, after the round's sync (and a
        SettlingRule's settle), before the drafter is told; the concatenation over a decode is its result's
        tokens, and a proposed token reaches it only once the rule has kept it."""

    def result(self, counts: list[int]) -> tuple[DecodeStats | None, list[dict]]:
        """(batch stats, one dict per row) at the end, from the rows' emitted token counts."""
        return None, []


class _Clock:
    """Phase timer without host syncs: CUDA events on GPU (read once, in `totals`), perf_counter on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.laps: list[tuple[str, Any]] = []
        self.start = self._mark()

    def _mark(self) -> Any:
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


class Instruments(Observer):
    """Phase times, per-row tallies and (with `diagnostics`) β_t overlaps, TV drift and the β audit.

    diagnostics: compute β_t = Σ_x min(p_t, q_t) at every verified position and (see track_tv) the exact TV of
        the rule's output law to q, and run the β audit of a rule that `audits_acceptance`; timed apart.
    track_tv: log the exact per-step TV (default: on for rules that do not preserve q and whose output law is
        cheap, e.g. tolerance β > 0, greedy). Untracked TV is None, or 0 for a rule that preserves the law.
    """

    def __init__(self, diagnostics: bool = True, track_tv: bool | None = None):
        if track_tv and not diagnostics:
            raise ValueError("track_tv=True needs diagnostics=True (TV is a diagnostic): drop one of them")
        self.diagnostics, self.track_tv = diagnostics, track_tv
        self.clock: _Clock | None = None
        self.positions = 0
        self.rule: Any = None
        self.calls: list[torch.Tensor] = []  # AR: the rows active at each step
        self.rounds: list[tuple[int, torch.Tensor]] = []  # (k, n accepted per row, -1 where finished)
        self.overlap = self.tv = None  # diagnostic sums [B, positions]
        self.audits: list[
            tuple[torch.Tensor, torch.Tensor]
        ] = []  # per round: (fields [B, k, F], kept [B, k])
        self._uniforms: torch.Tensor | None = None

    def begin(self, device: torch.device, positions: int = 0) -> None:
        self.clock, self.positions = _Clock(device), positions

    def lap(self, phase: str) -> None:
        self.clock.lap(phase)

    def verifier(self, rule: Any) -> Any:
        self.rule = rule
        if self.track_tv is None:
            self.track_tv = (not rule.preserves_target_law and isinstance(rule, ExplicitLawRule)
                             and rule.cheap_output_law)  # fmt: skip
        self.track_tv = bool(self.track_tv and self.diagnostics)
        if not (self.diagnostics and isinstance(rule, AuditedRule) and rule.audits_acceptance):
            return rule.verify

        def verify_and_keep_uniforms(p, q, x, generator=None):
            n_acc, next_token, self._uniforms = rule.verify_draws(p, q, x, generator)
            return n_acc, next_token

        return verify_and_keep_uniforms

    def step(self, active: torch.Tensor) -> None:
        self.calls.append(active.clone())

    def round(self, k, xs, ps, qs, n_acc, active) -> None:
        # Only the verdicts are kept per round; the tallies are derived from them at the end (`result`), so a
        # round without diagnostics costs the decode one small op.
        self.rounds.append((k, torch.where(active, n_acc, -1)))
        if not self.diagnostics:
            return
        batch, device = n_acc.shape[0], n_acc.device
        if self.overlap is None:
            zeros = torch.zeros(batch, self.positions, dtype=torch.float64, device=device)
            self.overlap = zeros.clone()
            self.tv = zeros.clone() if self.track_tv else None
        self._widen(k)
        pos = torch.arange(k, device=device)
        reached = (pos <= n_acc.unsqueeze(-1)) & active.unsqueeze(-1)
        kept = (pos < n_acc.unsqueeze(-1)) & active.unsqueeze(-1)
        q = qs[:, :k]
        self.overlap[:, :k] += torch.where(reached, torch.minimum(ps, q).sum(-1).double(), 0.0)
        if self.tv is not None:
            tv = 0.5 * (self.rule.output_law(ps, q) - q).abs().sum(-1)
            self.tv[:, :k] += torch.where(reached, tv.double(), 0.0)
        if self._uniforms is not None:
            self.audits.append((self.rule.audit(ps, q, xs, self._uniforms), kept))
        self.lap("diagnostics")

    def _widen(self, k: int) -> None:
        """Grow the per-position diagnostic sums to k positions (adaptive draft lengths)."""
        extra = k - self.overlap.shape[1]
        if extra > 0:
            pad = torch.nn.functional.pad
            self.overlap = pad(self.overlap, (0, extra))
            self.tv = None if self.tv is None else pad(self.tv, (0, extra))

    def _tallies(self, verdicts: torch.Tensor, width: int) -> tuple[list, list]:
        """(proposed, accepted) [B][width] per row from the verdicts [B, rounds] (-1: finished): draft position i
        of a round was reached when i <= n kept, and kept when i < n, within the round's k."""
        ks = torch.tensor([k for k, _ in self.rounds], device=verdicts.device)
        pos = torch.arange(width, device=verdicts.device)[:, None]  # [width, 1] against [B, 1, rounds]
        live, n = (verdicts >= 0)[:, None], verdicts[:, None]
        within = pos < ks
        proposed = (live & within & (pos <= n)).sum(-1)
        accepted = (live & within & (pos < n)).sum(-1)
        return proposed.tolist(), accepted.tolist()

    # --- the end: one read of everything ----------------------------------------------------------------
    def result(self, counts: list[int]) -> tuple[DecodeStats, list[dict]]:
        stats = DecodeStats(tokens=sum(counts))
        for phase, seconds in self.clock.totals().items():
            setattr(stats, f"time_{phase}", seconds)
        if not self.rounds:
            rows = self._ar_rows(counts)
            stats.target_calls = len(self.calls)
        else:
            rows, per_round = self._speculative_rows(counts)
            stats.rounds = stats.target_calls = len(self.rounds)
            stats.draft_len_per_round = [k for k, _ in self.rounds]
            stats.draft_calls = sum(stats.draft_len_per_round)
            stats.accepted_per_round = [[n for n in r if n >= 0] for r in zip(*per_round)]

        def total(key):
            if any(row[key] is None for row in rows):
                return None
            return [sum(values) for values in zip(*(row[key] for row in rows))]

        stats.proposed, stats.accepted = total("proposed"), total("accepted")
        stats.overlap_sum, stats.tv_sum = total("overlap_sum"), total("tv_sum")
        return stats, rows

    def _ar_rows(self, counts: list[int]) -> list[dict]:
        calls = torch.stack(self.calls).sum(0).tolist() if self.calls else [0] * len(counts)
        return [
            {"rounds": 0, "target_calls": c, "draft_calls": 0, "tokens": n, "proposed": [], "accepted": [],
             "overlap_sum": [], "tv_sum": [], "accepted_per_round": [], "draft_len_per_round": []}
            for c, n in zip(calls, counts)
        ]  # fmt: skip

    def _speculative_rows(self, counts: list[int]) -> tuple[list[dict], list[list[int]]]:
        """One dict per row (the DecodeResult.rows contract) and each row's verdict per round (-1: finished); the
        only device reads of the tallies."""
        draft_len = [k for k, _ in self.rounds]
        verdicts = torch.stack([n for _, n in self.rounds], 1)  # [row, round], -1: finished
        width = max(self.positions, *draft_len)
        proposed, accepted = self._tallies(verdicts, width)
        per_round = verdicts.tolist()
        overlap = self.overlap.tolist() if self.overlap is not None else [None] * len(counts)
        if self.tv is not None:
            tv = self.tv.tolist()
        else:
            tv = [[0.0] * width if self.rule.preserves_target_law else None for _ in counts]
        audits = self._audit_rows(len(counts), width)
        rows = []
        for b, n_tokens in enumerate(counts):
            live = [r for r, n in enumerate(per_round[b]) if n >= 0]
            rows.append({
                "rounds": len(live), "target_calls": len(live), "draft_calls": sum(draft_len[r] for r in live),
                "tokens": n_tokens, "proposed": proposed[b], "accepted": accepted[b], "overlap_sum": overlap[b],
                "tv_sum": tv[b], "accepted_per_round": [per_round[b][r] for r in live],
                "draft_len_per_round": [draft_len[r] for r in live],
            })  # fmt: skip
            if audits[b] is not None:
                rows[-1]["beta_audit"] = audits[b]
        return rows, per_round

    def _audit_rows(self, batch: int, width: int) -> list[dict | None]:
        """Per row: {field: [value per kept draft token, in order]} (one device read), or None without audit."""
        if not self.audits:
            return [None] * batch
        pad = torch.nn.functional.pad
        fields = torch.stack([pad(f, (0, 0, 0, width - f.shape[1])) for f, _ in self.audits], 1).cpu()
        kept = torch.stack([pad(m, (0, width - m.shape[1])) for _, m in self.audits], 1).cpu()
        names = self.rule.audit_fields
        out = []
        for b in range(batch):
            values = fields[b][kept[b]]  # [n kept, F], in round then position order
            out.append({name: values[:, i].tolist() for i, name in enumerate(names)})
        return out


class Streaming(Instruments):
    """`Instruments` that also hand every row's verified tokens to `sink(tokens per row)` as soon as their round
    is verified (a streaming vocoder's session, between LM rounds as a server would run it). The sink's time is
    its own phase, `time_stream`, outside `time_total`, so LM times stay comparable with a decode that does not
    stream."""

    streams = True

    def __init__(self, sink: Any, diagnostics: bool = True, track_tv: bool | None = None):
        super().__init__(diagnostics, track_tv)
        self.sink = sink

    def emitted(self, tokens: list[list[int]]) -> None:
        if any(tokens):
            self.sink(tokens)
            self.lap("stream")

    def seconds(self, phase: str) -> float:
        """Seconds spent in `phase` so far (the diagnostics a streaming clock leaves out; read after a sync)."""
        return self.clock.totals().get(phase, 0.0) if self.clock is not None else 0.0
