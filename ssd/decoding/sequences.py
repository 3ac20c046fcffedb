"""The batch's generated sequences: emitted tokens per row, their length limits and stop tokens, and the
sampling law bound to their history (what gives the target its q and every drafter its p).

Everything stays on the device; `sync` is a decode's only device -> host read per round.
"""

from __future__ import annotations

from typing import Any

import torch

from ssd.decoding.rng import RowRandom
from ssd.decoding.sampling import SamplingConfig, distribution, sample

UNSETTLED = -1  # a next token a SettlingRule finishes after the round's sync (ssd.contracts.SettlingRule)


def check_stop_tokens(law: SamplingConfig, vocab: int, min_len: Any, max_len: Any) -> None:
    """Refuse a law whose stop tokens could never end a row: ids outside the head, or none at all (the rows
    would run to max_len and the model's stop ids come out as speech), unless the request asks for a fixed
    length (min_len = max_len for every row: no stop could end a row anyway)."""
    fix = "build the SamplingConfig with the target's stop tokens (SamplingConfig(..., stop_tokens=target.stop_tokens))"
    outside = [t for t in law.stop_tokens if not 0 <= t < vocab]
    if outside:
        raise ValueError(f"sampling stop_tokens {outside} lie outside the model's head of {vocab} entries, so no "
                         f"row could stop on them: {fix}")  # fmt: skip
    fixed = torch.as_tensor(min_len).cpu() >= torch.as_tensor(max_len).cpu()  # host values (a request's ints)
    if not law.stop_tokens and not bool(fixed.all()):
        raise ValueError(
            "sampling stop_tokens is empty: no row would stop before max_len, and the model's stop ids would be "
            f"emitted as speech tokens: {fix}, or ask for a fixed length (Request min_len = max_len)"
        )


def _as_rows(value: Any, batch: int, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(value, dtype=torch.long, device=device).expand(batch).clone()


class Sequences:
    """Per-row emitted tokens, the history window of the sampling law, stop / max_len handling.

    law: the target's sampling transform; `draw` applies it to a drafter's logits, `verify_laws` to the
    target's, each position seeing the emitted history extended by the earlier draft tokens of its round.
    slack: extra leading context columns a whole-context law keeps in every verification window (one per
    draft position, since `windows` shifts by one column per position).
    """

    def __init__(self, request: Any, law: SamplingConfig, model: Any, logits: torch.Tensor, slack: int = 0):
        device, batch = logits.device, logits.shape[0]
        self.law, self.batch, self.device = law, batch, device
        self.generator = RowRandom.of(request.generator, batch, device)
        self.max_len = _as_rows(request.max_len, batch, device)
        self.min_len = _as_rows(request.min_len, batch, device)
        # Host-side: may a row still be short of its min_len? Read on each sync; once none is, the laws skip
        # the stop-token rule (a few torch calls of every law, which is what a CPU step is made of).
        self.before_min_len = bool((torch.as_tensor(request.min_len).cpu() > 0).any())
        check_stop_tokens(law, logits.shape[-1], request.min_len, request.max_len)
        self.stop = torch.tensor(law.stop_tokens or (-2,), dtype=torch.long, device=device)
        cap = int(self.max_len.max()) + 1
        self.history = torch.full((batch, cap), -1, dtype=torch.long, device=device)
        self.context = _context_columns(law, model, request.prompt, batch, slack, device)
        self.generated_window = cap if law.whole_context else law.window  # a whole-context law sees them all
        self.count = torch.zeros(batch, dtype=torch.long, device=device)
        self.done = torch.zeros(batch, dtype=torch.bool, device=device)
        self.stopped = torch.zeros(batch, dtype=torch.bool, device=device)  # ended by a stop token
        self.bad_law = torch.zeros((), dtype=torch.bool, device=device)  # a law held NaN/inf
        self.latest: dict[str, torch.Tensor | None] = {"draft": None, "target": logits}  # named in NaN errors
        self._window: torch.Tensor | None = None  # last_window() of the current count (emit resets it)
        self._written = torch.zeros(batch, dtype=torch.long, device=device)  # tokens the last emit wrote

    # --- the law over the history --------------------------------------------------------------------
    def last_window(self) -> torch.Tensor:
        """[B, W]: the last W generated tokens, -1 where fewer exist (a whole-context law: after the prompt's ids)."""
        if self._window is None:
            w = self.generated_window
            idx = self.count.unsqueeze(-1) - w + torch.arange(w, device=self.device)
            generated = torch.where(idx >= 0, self.history.gather(1, idx.clamp_min(0)), -1)
            self._window = torch.cat([self.context, generated], 1) if self.context.shape[1] else generated
        return self._window

    def draw(self, logits: torch.Tensor, earlier: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A drafter's token at draft position i = earlier.shape[1] of this round, and the law it was drawn
        from (`ssd.contracts.Draw`). The decode loop watches the round's laws for NaN/inf at once (`watch`)."""
        self.latest["draft"] = logits
        window = self.last_window()  # the last window of windows(last_window, earlier): its final W columns
        if earlier.shape[1] and window.shape[1]:
            window = torch.cat([window, earlier], 1)[:, earlier.shape[1] :]
        law = distribution(self.law, logits.float(), window, self.count + earlier.shape[1], self._min_len())
        return sample(law, self.generator), law

    def verify_laws(self, logits: torch.Tensor, drafted: torch.Tensor) -> torch.Tensor:
        """The target's law q [B, k+1, V] at each verified position, from its logits [B, k+1, V]."""
        self.latest["target"] = logits
        batch, k1, vocab = logits.shape
        steps = (self.count.unsqueeze(-1) + torch.arange(k1, device=self.device)).reshape(-1)
        windows = self.law.windows(self.last_window(), drafted)
        q = distribution(self.law, logits.reshape(-1, vocab).float(), windows.reshape(batch * k1, -1), steps,
                         self._min_len(k1))  # fmt: skip
        return self.watch(q.reshape(batch, k1, vocab))

    def first(self, logits: torch.Tensor) -> torch.Tensor:
        """Draw the next token from the target's law at the last position and emit it (AR; round 0)."""
        self.latest["target"] = logits
        law = distribution(self.law, logits.float(), self.last_window(), self.count, self._min_len())
        token = sample(self.watch(law), self.generator)
        self.emit(token.unsqueeze(-1), torch.ones_like(token))
        return token

    def _min_len(self, positions: int = 1) -> torch.Tensor | int:
        """The laws' min_len for each row's next `positions` positions: 0 once every active row is past it."""
        if not self.before_min_len:
            return 0
        return self.min_len.repeat_interleave(positions) if positions > 1 else self.min_len

    def watch(self, law: torch.Tensor) -> torch.Tensor:
        """Note (on the device) whether a sampling law is NaN/inf; `sync` reports it."""
        self.bad_law |= ~torch.isfinite(law).all()
        return law

    # --- emitting -------------------------------------------------------------------------------------
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
        self._window, self._written = None, torch.where(n == block_len, n, 0)
        return n

    def settle_last(self, settled: torch.Tensor, token: torch.Tensor) -> None:
        """Replace the UNSETTLED last token of the rows `settled` [B] by `token` [B] (after a SettlingRule
        finished them): written as the row's last token, or, when it is a stop token, the row ends there."""
        was_written = settled & (self._written > 0)
        last = (self.count - 1).clamp_min(0).unsqueeze(-1)
        ends = was_written & torch.isin(token, self.stop)
        current = self.history.gather(1, last).squeeze(-1)
        self.history.scatter_(
            1, last, torch.where(ends, -1, torch.where(was_written, token, current)).unsqueeze(-1)
        )
        self.count -= ends.long()
        self.stopped |= ends
        self.done |= ends
        self._window = None

    def since(self, mark: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What each row emitted after its count was `mark` [B] (at most `width` tokens): (tokens [B, width],
        how many [B]), on the device, for a streaming loop to read on the round's sync."""
        pos = mark.unsqueeze(-1) + torch.arange(width, device=self.device)
        return self.history.gather(1, pos.clamp(max=self.history.shape[1] - 1)), self.count - mark

    def sync(self, *values: torch.Tensor) -> list:
        """The round's one host sync: [all rows done?, *values], each value a scalar (read as an int), a [B]
        tensor (read as a list) or a [B, W] one (a list of rows); raises FloatingPointError after a NaN/inf law."""
        short = [(~self.done & (self.count < self.min_len)).any()] if self.before_min_len else []
        parts = [self.done.all(), self.bad_law, *short, *values]
        flat = torch.cat([p.reshape(-1).long() for p in parts]).tolist()
        read, at = [], 0
        for p in parts:
            n = p.numel()
            if p.dim() == 0:
                read.append(flat[at])
            elif p.dim() == 1:
                read.append(flat[at : at + n])
            else:
                w = n // max(1, p.shape[0])
                read.append([flat[at + i * w : at + (i + 1) * w] for i in range(p.shape[0])])
            at += n
        done, bad, *rest = read
        if bad:
            self._raise_non_finite()
        if short:
            self.before_min_len = bool(rest.pop(0))
        return [bool(done), *rest]

    def tokens(self) -> list[list[int]]:
        return [row[:n].tolist() for row, n in zip(self.history.cpu(), self.count.cpu().tolist())]

    def reasons(self) -> list[str]:
        return ["stop" if s else "max_len" for s in self.stopped.tolist()]

    def _raise_non_finite(self) -> None:
        """A sampling law held NaN/inf: name the model whose logits did it, and the step."""
        for role, logits in self.latest.items():
            finite = (
                torch.isfinite(logits).reshape(logits.shape[0], -1).all(-1) if logits is not None else None
            )
            if finite is not None and not finite.all():
                raise FloatingPointError(
                    f"the {role}'s logits are NaN/inf at generated token {int(self.count.min())} (batch rows "
                    f"{(~finite).nonzero().flatten().tolist()}): check the {role}'s weights (its checkpoint, "
                    "and its dtype: float16 can overflow)"
                )
        raise FloatingPointError(
            f"a sampling law is NaN/inf at generated token {int(self.count.min())} although the logits are "
            "finite: check the sampling config (e.g. every token masked)"
        )


def _context_columns(
    law: SamplingConfig, model: Any, prompt: Any, batch: int, slack: int, device
) -> torch.Tensor:
    """[B, slack + P]: for a whole-context law, the prompt's ids in head space (model.context_ids), -1-padded
    on the left; the `slack` leading -1 columns keep them in every verification window. [B, 0] for other laws."""
    if not law.whole_context:
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
