"""The decoding loops: autoregressive and speculative, batch-first, for any drafter and any acceptance rule.

One speculative round (every row its own length; rows that finished keep running with nothing kept, so the
batch stays rectangular, and their output is frozen):

    xs, ps = draft.propose(k, seqs.draw)                  # k draft tokens and the laws they were drawn from
    logits = target.extend(cache, [pending, xs])          # ONE target call (+ hidden states if asked)
    qs = seqs.verify_laws(logits, xs)                     # the target's law at every position
    n, y = rule.verify(ps, qs, xs, generator)             # how many stay, and the next token
    emit; the round's one host sync; roll the target back; draft.accept(n, y, features)

Streaming: an observer with `streams` (`ssd.decoding.observe.Streaming`) gets each round's emitted tokens, read
on that same sync, after verification (`Observer.emitted`): a vocoder fed from it never sees a draft token the
rule did not keep. A round whose SettlingRule left a token unsettled reads the settled tokens once more.

Batch invariance: every random number comes from the row's own stream (`RowRandom`) and a row draws the same
count per round whatever its verdict, so row b decodes exactly as it would alone (with a fixed draft length:
an adaptive one is shared by the batch, so it decodes one row at a time).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ssd.contracts import Drafter, SettlingRule, SpeechLM
from ssd.decoding.observe import DecodeStats, Observer
from ssd.decoding.rng import RowRandom
from ssd.decoding.sampling import SamplingConfig
from ssd.decoding.sequences import UNSETTLED, Sequences


@dataclass
class Request:
    """What to decode: a prompt batch (the target's own format), each row's length limits (ints or [B]) and
    random streams (a RowRandom gives row b the same tokens in any batch; a torch.Generator or None seeds
    fresh streams)."""

    prompt: Any
    max_len: Any
    min_len: Any = 0
    generator: RowRandom | torch.Generator | None = None


@dataclass
class DecodeResult:
    """tokens, finish_reason and rows: one entry per batch row; stats: the batch as a whole.

    stats and rows come from the observer (`ssd.decoding.observe.Instruments`; None and [] without one).
    rows[b] holds row b's own counts while it was active, keys: rounds, target_calls, draft_calls, tokens
    (int); proposed, accepted ([k_max] ints); overlap_sum ([k_max] floats, None without diagnostics); tv_sum
    ([k_max] floats, None when not computed); accepted_per_round and draft_len_per_round ([rounds] ints);
    beta_audit (a rule that audits). A row's entry is the same whatever batch it was decoded in.
    """

    tokens: list[list[int]]  # per row, stop token excluded
    finish_reason: list[str]  # "stop" | "max_len"
    stats: DecodeStats | None = None
    rows: list[dict] = field(default_factory=list)


@dataclass(frozen=True)
class AdaptiveDraftLength:
    """HF assisted generation's heuristic: start at `start`, +increase after a round that kept every draft
    token, -decrease otherwise, within [min_len, max_len]."""

    start: int = 3
    min_len: int = 1
    max_len: int = 8
    increase: int = 2
    decrease: int = 1

    def __post_init__(self) -> None:
        for name in ("start", "min_len", "max_len", "increase", "decrease"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"adaptive draft length: {name}={value!r} must be an integer")
        if not 1 <= self.min_len <= self.start <= self.max_len or self.increase < 0 or self.decrease < 0:
            raise ValueError(
                f"adaptive draft length needs 1 <= min_len ({self.min_len}) <= start ({self.start}) <= max_len "
                f"({self.max_len}) and increase, decrease >= 0"
            )

    def next(self, k: int, kept: list[int]) -> int:
        k = k + self.increase if all(n == k for n in kept) else k - self.decrease
        return max(self.min_len, min(self.max_len, k))


def decode_ar(model: SpeechLM, request: Request, sampling: SamplingConfig, observer: Observer | None = None
              ) -> DecodeResult:  # fmt: skip
    """Autoregressive sampling from `sampling`'s law, one model call per token, one host sync per token."""
    observer = observer or Observer()
    observer.begin(_device(model))
    cache, logits = model.prefill(request.prompt, int(torch.as_tensor(request.max_len).max()) + 1)
    seqs = Sequences(request, sampling, model, logits)
    mark = _mark(seqs, observer)
    token = seqs.first(logits)
    finished, *fresh = seqs.sync(*_fresh(seqs, observer, mark, 1))
    observer.lap("prefill")
    _hand_over(observer, fresh)
    while not finished:
        observer.step(~seqs.done)
        logits = model.extend(cache, token.unsqueeze(-1))[:, -1]
        observer.lap("verify")
        mark = _mark(seqs, observer)
        token = seqs.first(logits)
        finished, *fresh = seqs.sync(*_fresh(seqs, observer, mark, 1))
        observer.lap("accept")
        _hand_over(observer, fresh)
    return DecodeResult(seqs.tokens(), seqs.reasons(), *observer.result(seqs.count.tolist()))


def decode_speculative(target: SpeechLM, drafter: Drafter, request: Request, sampling: SamplingConfig, rule: Any,
                       draft_len: int | AdaptiveDraftLength, observer: Observer | None = None) -> DecodeResult:  # fmt: skip
    """Speculative decoding of `target` with `drafter`'s proposals, verified by `rule` against `sampling`'s law
    (which also gives the drafter its law, through `draw`). draft_len: a fixed L_d or an AdaptiveDraftLength."""
    _check(target, drafter, rule)
    adaptive = draft_len if isinstance(draft_len, AdaptiveDraftLength) else None
    k = adaptive.start if adaptive else int(draft_len)
    k_max = adaptive.max_len if adaptive else k
    observer = observer or Observer()
    observer.begin(_device(target), k_max)
    # Finished rows keep running and grow one token a round; a verify block holds up to k_max + 1 tokens.
    room = 2 * int(torch.as_tensor(request.max_len).max()) + k_max + 2
    cache, logits = target.prefill(request.prompt, room, taps=drafter.taps)
    if adaptive and logits.shape[0] > 1:
        raise ValueError(
            f"adaptive draft length shares one k across the batch, so a row's tokens would depend on the other "
            f"rows: decode adaptive runs one utterance at a time (got a batch of {logits.shape[0]}), or set a "
            "fixed draft_len"
        )
    seqs = Sequences(request, sampling, target, logits, slack=k_max + 1)
    mark = _mark(seqs, observer)
    pending = seqs.first(logits).unsqueeze(-1)
    draft = drafter.start(request.prompt, pending[:, 0], cache.features, room)
    verify, settles = observer.verifier(rule), isinstance(rule, SettlingRule)
    rows = torch.arange(seqs.batch, device=seqs.device)
    finished, *fresh = seqs.sync(*_fresh(seqs, observer, mark, 1))
    observer.lap("prefill")
    _hand_over(observer, fresh)
    while not finished:
        xs, ps = draft.propose(k, seqs.draw)
        seqs.watch(ps)
        observer.lap("draft")
        qs = seqs.verify_laws(target.extend(cache, torch.cat([pending, xs], 1)), xs)
        observer.lap("verify")
        n_acc, y = verify(ps, qs, xs, seqs.generator)
        active = ~seqs.done
        n_acc = torch.where(active, n_acc, 0)
        block = torch.cat([xs, y.unsqueeze(-1)], 1)
        block[rows, n_acc] = y
        mark = _mark(seqs, observer)
        seqs.emit(block, n_acc + 1)
        unsettled = (y == UNSETTLED) & active if settles else y.new_zeros((), dtype=torch.bool)
        finished, kept, any_unsettled, *fresh = seqs.sync(
            n_acc, unsettled.any(), *_fresh(seqs, observer, mark, k + 1)
        )
        if any_unsettled:
            y = rule.settle(y)
            seqs.settle_last(unsettled, y)
            # A settled stop token may end the last active row (this branch reads the host anyway).
            finished, *fresh = seqs.sync(*seqs.since(mark, k + 1)) if observer.streams else seqs.sync()
        if settles:  # a finished row's token is never kept, but it is fed to the models: make it an id
            y = y.clamp_min(0)
        target.rollback(cache, [k - n for n in kept])
        observer.lap("accept")
        _hand_over(observer, fresh)
        draft.accept(kept, y, cache.features)
        observer.lap("draft")
        observer.round(k, xs, ps, qs, n_acc, active)
        pending, k = y.unsqueeze(-1), adaptive.next(k, kept) if adaptive else k
    return DecodeResult(seqs.tokens(), seqs.reasons(), *observer.result(seqs.count.tolist()))


def _mark(seqs: Sequences, observer: Observer) -> torch.Tensor | None:
    """Each row's count before a step emits, when the observer streams (a decode that does not pays nothing)."""
    return seqs.count.clone() if observer.streams else None


def _fresh(seqs: Sequences, observer: Observer, mark: torch.Tensor, width: int) -> tuple[torch.Tensor, ...]:
    """The round's emitted tokens for the sync to read, when the observer streams; else nothing extra."""
    return seqs.since(mark, width) if observer.streams else ()


def _hand_over(observer: Observer, fresh: list) -> None:
    """Each row's verified tokens of the round, as the sync read them, to a streaming observer."""
    if fresh:
        tokens, counts = fresh
        observer.emitted([row[:n] for row, n in zip(tokens, counts)])


def _device(model: Any) -> torch.device:
    """Where the model runs, known before its first call (the clock starts before prefill)."""
    return torch.device(getattr(model, "device", "cpu"))


def _check(target: SpeechLM, drafter: Drafter, rule: Any) -> None:
    if drafter.vocab_size != target.vocab_size:
        raise ValueError(
            f"drafter and target speak different vocabularies ({drafter.vocab_size} vs {target.vocab_size} head "
            "entries): build the drafter from this target"
        )
    if not hasattr(rule, "preserves_target_law"):
        raise TypeError(
            f"acceptance rule {type(rule).__name__} has no preserves_target_law: declare whether its output law "
            "is the target's q (ssd.contracts.AcceptanceRule)"
        )


class PaddedVerify:
    """A target whose multi-token calls are padded to `rows` positions (the padding is rolled back unread).
    On CPUs a matmul of 8 rows can cost less than one of 4-5 (docs/cpu-physics.md); `scripts/bench_decoding.py
    --verify-rows 8` measures whether it pays on yours. Tokens and laws are unchanged."""

    def __init__(self, target: SpeechLM, rows: int):
        self.target, self.rows = target, int(rows)
        self.vocab_size = target.vocab_size

    def __getattr__(self, name: str) -> Any:  # everything else (device, context_ids, ...) is the target's
        return getattr(self.target, name)

    def prefill(self, prompt: Any, max_new_tokens: int, taps=()):
        return self.target.prefill(prompt, max_new_tokens + self.rows, taps=taps)

    def extend(self, cache: Any, tokens: torch.Tensor) -> torch.Tensor:
        k = tokens.shape[1]
        pad = max(0, self.rows - k) if k > 1 else 0
        if not pad:
            return self.target.extend(cache, tokens)
        logits = self.target.extend(cache, torch.cat([tokens, tokens[:, -1:].expand(-1, pad)], 1))
        self.target.rollback(cache, pad)
        if cache.features is not None:
            cache.features = cache.features[:, :k]
        return logits[:, :k]

    def rollback(self, cache: Any, n) -> None:
        self.target.rollback(cache, n)
