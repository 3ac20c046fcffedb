"""Acceptance rules: given draft laws p, target laws q and the draft tokens, decide
how many draft tokens stay and what the next token is.

Convention (docs/algorithms.md §1.1): q = the target's per-step sampling law, p = the law the
draft actually sampled its token from.

A ratio-style rule is two functions, and the same two functions serve the sampler
and the analytic certificate (`output_law`):
    accept_prob(p, q, x) -> probability of keeping draft token x
    residual(p, q, x)    -> law of the replacement when x is rejected
PCG works on groups of tokens and overrides `verify` and adds `group_law`.

Two properties a rule declares, not to be confused:
    preserves_target_law: the emitted tokens are an exact sample of q (speculative sampling);
    deterministic:        no randomness in the verdict; greedy equals greedy AR decoding of q,
                          which is a sample of q only when q itself is one-hot (temperature 0).
Random numbers come from per-row streams (`RowRandom`), a FIXED count per row and round whatever
the data, so that a row verifies the same way in any batch.

A rule is a Hydra `_target_` node (configs/acceptance/): a rule class of any module plugs in with
`acceptance._target_=my_module.MyRule` when it speaks `ssd.contracts.AcceptanceRule`. It names the
parameters that label its runs in `label_params`, and takes what it needs from the target in `bind`.
"""

from __future__ import annotations

from typing import Any

import torch

from ssd.decoding.rng import RowRandom
from ssd.decoding.sampling import sample


def _normalize(weights: torch.Tensor) -> torch.Tensor:
    total = weights.sum(-1, keepdim=True)
    return weights / total.clamp_min(torch.finfo(weights.dtype).tiny)


def _gather(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """t[..., index]: index is t.shape[:-1] (one token per law) or t.shape[:-1] + [M]."""
    if index.dim() == t.dim():
        return t.gather(-1, index)
    return t.gather(-1, index.unsqueeze(-1)).squeeze(-1)


def _per_law(value: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Broadcast a per-law value [...] against tokens x ([...] or [..., M])."""
    return value.unsqueeze(-1) if x.dim() > value.dim() else value


class AcceptanceRule:
    """Base class: ratio-style acceptance, vectorised over rows and draft positions."""

    name = "base"
    preserves_target_law = False  # the token-level output law equals q
    deterministic = False  # the verdict uses no random numbers
    residual_depends_on_draft_token = False
    label_params: tuple[str, ...] = ()  # attributes that identify a run of the rule (tables, run labels)

    def labels(self) -> dict[str, float]:
        return {key: getattr(self, key) for key in self.label_params}

    def bind(self, target) -> AcceptanceRule:
        """Take what the rule needs from the target (see PCGRule); most rules need nothing."""
        return self

    @property
    def cheap_output_law(self) -> bool:
        """output_law costs O(V) per position (no enumeration of draft tokens)."""
        return not self.residual_depends_on_draft_token

    def accept_prob(self, p: torch.Tensor, q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def residual(self, p: torch.Tensor, q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def verify(
        self,
        p: torch.Tensor,
        q: torch.Tensor,
        x: torch.Tensor,
        generator: RowRandom | torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """p [B, k, V], q [B, k+1, V] (last = bonus position), x [B, k].

        Returns (n_accepted [B] in 0..k, next_token [B]): the replacement at the first
        rejected position, or a bonus token from q[:, k] when all k were accepted.
        Draws k + 1 numbers per row (k + 0 for a deterministic rule).
        """
        n_acc, next_token, _ = self._verify(p, q, x, generator)
        return n_acc, next_token

    def _verify(self, p, q, x, generator=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """verify() plus the uniforms u [B, k] its verdicts compared with accept_prob."""
        batch, k = x.shape
        generator = RowRandom.of(generator, batch, x.device)
        accept = self.accept_prob(p, q[:, :k], x)
        u = generator.uniform(k, dtype=accept.dtype)
        n_acc = (u < accept).long().cumprod(-1).sum(-1)
        rejected = n_acc < k
        pos = n_acc.clamp(max=k - 1)
        rows = generator.row_ids
        replacement = self.residual(p[rows, pos], q[rows, pos], x[rows, pos])
        law = torch.where(rejected.unsqueeze(-1), replacement, q[:, k])
        return n_acc, self.sample_next(law, generator), u

    def sample_next(self, law: torch.Tensor, generator: RowRandom) -> torch.Tensor:
        return sample(law, generator)

    def output_law(self, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """Exact one-step law of the emitted token [..., V] when x ~ p is verified against q."""
        vocab = p.shape[-1]
        xs = torch.arange(vocab, device=p.device)
        if not self.residual_depends_on_draft_token:
            a = self.accept_prob(p, q, xs.expand(p.shape))
            kept = p * a
            return kept + (1 - kept.sum(-1, keepdim=True)) * self.residual(p, q, xs[..., 0])
        # General case: enumerate the draft token (small vocabularies; certificates).
        pe, qe = p.unsqueeze(-2).expand(*p.shape, vocab), q.unsqueeze(-2).expand(*q.shape, vocab)
        xe = xs.expand(*p.shape[:-1], vocab)
        a = self.accept_prob(pe, qe, xe)  # [..., x]
        res = self.residual(pe, qe, xe)  # [..., x, V]
        return p * a + ((p * (1 - a)).unsqueeze(-1) * res).sum(-2)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class ExactRule(AcceptanceRule):
    """Speculative sampling (Leviathan et al.; Chen et al.): exact in law."""

    name = "exact"
    preserves_target_law = True

    def accept_prob(self, p, q, x):
        px, qx = _gather(p, x), _gather(q, x)
        return torch.where(px > 0, (qx / px.clamp_min(torch.finfo(p.dtype).tiny)).clamp(max=1.0), 1.0)

    def residual(self, p, q, x):
        diff = (q - p).clamp_min(0)
        # Where p == q everywhere the residual is never reached; fall back to q to stay a law.
        return torch.where(diff.sum(-1, keepdim=True) > 0, _normalize(diff), q)


class ToleranceRule(ExactRule):
    """SSD (Lin et al. 2025): accept if r < min(1, q/p) + β. β = 0 is ExactRule."""

    name = "tolerance"
    label_params = ("beta",)

    audit_fields = ("beta_only", "q", "q_over_max", "is_argmax", "in_argmax_group", "group_q_mass")

    def __init__(self, beta: float = 0.4, audit_groups: Any = None):
        """audit_groups: a PCGRule (ssd.decoding.pcg) whose groups the β audit (`audit`) asks about; None: no
        audit."""
        if beta < 0:
            raise ValueError(f"tolerance beta must be >= 0, got {beta}")
        if audit_groups is not None and not callable(getattr(audit_groups, "members", None)):
            raise TypeError(
                f"tolerance audit_groups must be a PCGRule (acceptance.audit_groups._target_="
                f"ssd.decoding.pcg.PCGRule), got {type(audit_groups).__name__}"
            )
        self.beta = float(beta)
        self.preserves_target_law = self.beta == 0
        self.audit_groups = audit_groups

    @property
    def audits_acceptance(self) -> bool:
        """The engine runs `audit` as a diagnostic (β > 0 and groups to audit against)."""
        return self.audit_groups is not None and self.beta > 0

    def bind(self, target) -> ToleranceRule:
        if self.audit_groups is not None:
            self.audit_groups.bind(target)
        return self

    def accept_prob(self, p, q, x):
        return (super().accept_prob(p, q, x) + self.beta).clamp(max=1.0)

    def verify_draws(self, p, q, x, generator=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """verify() plus the uniforms u [B, k] its verdicts compared with accept_prob (the β audit reads
        them; the same numbers, so auditing does not change the decode)."""
        return self._verify(p, q, x, generator)

    def audit(self, p, q, x, u) -> torch.Tensor:
        """Per draft token [B, k, len(audit_fields)]: was it accepted only because of β
        (min(1, q/p)(x) <= u < min(1, q/p)(x) + β), q(x), q(x)/max q, is it argmax q, is it in the PCG group
        of argmax q, and the q-mass of its group (the chance that a draw y ~ q at that step shares a group
        with x: Σ_{y in G_x} q(y), groups being symmetric). q here is the verified positions' q [B, k, V]."""
        exact = ExactRule.accept_prob(self, p, q, x)
        qx = _gather(q, x)
        top = q.argmax(-1)
        members, mask = self.audit_groups.members(x)  # G_x [B, k, G]
        in_top_group = ((members == top.unsqueeze(-1)) & mask).any(-1)
        group_mass = (q.gather(-1, members) * mask).sum(-1)
        fields = [u >= exact, qx, qx / q.max(-1).values, x == top, in_top_group, group_mass]
        return torch.stack([f.to(q.dtype) for f in fields], -1)

    def __repr__(self):
        return f"ToleranceRule(beta={self.beta})"


class GreedyRule(AcceptanceRule):
    """Accept while x == argmax q; replacement and bonus are argmax q."""

    name = "greedy"
    deterministic = (
        True  # equals greedy AR decoding of q (up to float ties); a sample of q only at temperature 0
    )

    def accept_prob(self, p, q, x):
        return (_per_law(q.argmax(-1), x) == x).to(q.dtype)

    def residual(self, p, q, x):
        return torch.nn.functional.one_hot(q.argmax(-1), q.shape[-1]).to(q.dtype)

    def sample_next(self, law, generator):
        return law.argmax(-1)


class TargetOnlyRule(AcceptanceRule):
    """Accept x with probability q(x); on rejection draw from q without x.

    Exact for ANY draft law, deterministic drafts included, since it never uses p.
    """

    name = "target_only"
    preserves_target_law = True
    residual_depends_on_draft_token = True

    def accept_prob(self, p, q, x):
        return _gather(q, x)

    def residual(self, p, q, x):
        without_x = q.scatter(-1, x.unsqueeze(-1), 0.0)
        return torch.where(without_x.sum(-1, keepdim=True) > 0, _normalize(without_x), q)


class TypicalRule(AcceptanceRule):
    """Medusa-style typical acceptance: keep x if q(x) > min(ε, δ·exp(-H(q))).

    Not exact; the replacement is drawn from q.
    """

    name = "typical"
    label_params = ("epsilon", "delta")

    def __init__(self, epsilon: float = 0.09, delta: float = 0.3):
        self.epsilon, self.delta = float(epsilon), float(delta)

    def accept_prob(self, p, q, x):
        entropy = -(q * q.clamp_min(torch.finfo(q.dtype).tiny).log()).sum(-1)
        threshold = torch.minimum(torch.full_like(entropy, self.epsilon), self.delta * torch.exp(-entropy))
        return (_gather(q, x) > _per_law(threshold, x)).to(q.dtype)

    def residual(self, p, q, x):
        return q

    def __repr__(self):
        return f"TypicalRule(epsilon={self.epsilon}, delta={self.delta})"


class SyntheticRule(AcceptanceRule):
    """SYNTHETIC: accept each draft token with a fixed probability α, whatever p and q.

    Only for speed benchmarks on random weights, where real acceptance is meaningless;
    its output is NOT a sample of the target. Replacement and bonus come from q.
    """

    name = "synthetic"
    label_params = ("alpha",)

    def __init__(self, alpha: float = 0.8):
        if not 0 <= alpha <= 1:
            raise ValueError(f"synthetic alpha must be in [0, 1], got {alpha}")
        self.alpha = float(alpha)

    def accept_prob(self, p, q, x):
        return torch.full(x.shape, self.alpha, dtype=q.dtype, device=q.device)

    def residual(self, p, q, x):
        return q

    def __repr__(self):
        return f"SyntheticRule(alpha={self.alpha})"
