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

import math

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
        n_acc, next_token, _ = self.verify_draws(p, q, x, generator)
        return n_acc, next_token

    def verify_draws(self, p, q, x, generator=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """verify() plus the uniforms u [B, k] its verdicts compared with accept_prob (the β audit reads
        them; the same numbers, so auditing does not change the decode)."""
        batch, k = x.shape
        generator = RowRandom.of(generator, batch, x.device)
        accept = self.accept_prob(p, q[:, :k], x)
        u = generator.uniform(k, dtype=accept.dtype)
        n_acc = (u < accept).long().cumprod(-1).sum(-1)
        rejected = n_acc < k
        pos = n_acc.clamp(max=k - 1)
        rows = torch.arange(batch, device=x.device)
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

    def __init__(self, beta: float = 0.4, audit_groups: PCGRule | None = None):
        """audit_groups: a PCGRule whose groups the β audit (`audit`) asks about; None: no audit."""
        if beta < 0:
            raise ValueError(f"tolerance beta must be >= 0, got {beta}")
        if audit_groups is not None and not isinstance(audit_groups, PCGRule):
            raise TypeError(
                f"tolerance audit_groups must be a PCGRule (acceptance.audit_groups._target_="
                f"ssd.decoding.acceptance.PCGRule), got {type(audit_groups).__name__}"
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

    def audit(self, p, q, x, u) -> torch.Tensor:
        """Per draft token [B, k, len(AUDIT_FIELDS)]: was it accepted only because of β
        (min(1, q/p)(x) <= u < min(1, q/p)(x) + β), q(x), q(x)/max q, is it argmax q, is it in the PCG group
        of argmax q, and the q-mass of its group (the chance that a draw y ~ q at that step shares a group
        with x: Σ_{y in G_x} q(y), groups being symmetric). q here is the verified positions' q [B, k, V]."""
        groups = self.audit_groups
        if groups.neighbors.device != x.device:
            groups.to(x.device)
        exact = ExactRule.accept_prob(self, p, q, x)
        qx = _gather(q, x)
        top = q.argmax(-1)
        members, mask = groups.neighbors[x], groups.neighbor_mask[x]  # G_x [B, k, G]
        in_top_group = ((members == top.unsqueeze(-1)) & mask).any(-1)
        group_mass = (q.gather(-1, members) * mask).sum(-1)
        fields = [u >= exact, qx, qx / q.max(-1).values, x == top, in_top_group, group_mass]
        return torch.stack([f.to(q.dtype) for f in fields], -1)

    def __repr__(self):
        return f"ToleranceRule(beta={self.beta})"


# The β audit's per-token fields (ToleranceRule.audit), in order.
AUDIT_FIELDS = ("beta_only", "q", "q_over_max", "is_argmax", "in_argmax_group", "group_q_mass")


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


class PCGRule(AcceptanceRule):
    """Principled coarse-grained acceptance (Yanuka et al. 2025, docs/algorithms.md §1.3).

    Groups G_v = {u : cos(e_u, e_v) > θ} over vectors e of the speech tokens: the target's speech-token
    input embeddings (the paper), or, from a toy codec, the log-mel frames each token decodes to (the
    paper's ablation) or the codebook's centroids (`source`). θ is an absolute cosine (the paper's knob),
    or it is resolved per target from a requested mean group size (`group_size`): cosine scales differ
    between embedding spaces, so one θ means singletons on one target and huge groups on another. Stop
    tokens (head ids >= the target's speech_token_size) are always alone in their group.

    Token u lies in m(u) = |G_u| groups (cosine is symmetric) and gives
    each of them P(u)/m(u). Draft token x ~ P, group label v uniform in G_x (so v ~ P_c);
    accept with min(1, Q_c(v)/P_c(v)) and keep x. On rejection draw v from
    normalize(max(0, Q_c - P_c)) by thinning (propose v ~ Q_c by u ~ Q, v uniform in G_u;
    keep with prob max(0, 1 - P_c(v)/Q_c(v))); after `max_thinning_trials` failures the
    enumerated residual is used (still exact; it is computed for every row, so that the work and
    the random numbers a row uses never depend on the data or on the other rows). The emitted
    token is then drawn inside G_v from Q's mass split, Q(u)/m(u) normalised over G_v.
    Guarantee: the emitted GROUP sequence is an exact sample of Q_c.
    """

    name = "pcg"
    preserves_target_law = False  # the GROUP law is Q_c's; the token law is not q
    cheap_output_law = False  # needs a dense [groups, tokens] matrix
    label_params = ("theta", "group_size", "source")

    def __init__(
        self,
        embeddings: torch.Tensor | None = None,
        theta: float = 0.4,
        max_thinning_trials: int = 8,
        group_size: float | None = None,
        source: str = "embedding",
        codec_dir: str | None = None,
    ):
        """embeddings [V, H]: the vectors the groups are built from (every id a speech token); None = built
        in `bind(target)` from `source`: "embedding" (the target's speech-token input embeddings, the
        paper's choice), "mel" or "codec" (the toy codec in `codec_dir`: decoded log-mel frames, centroids),
        or "random" (a control: random vectors, groups of unrelated tokens).
        group_size: a mean group size over the speech tokens (>= 1); θ is then resolved at bind (the
        given theta is replaced and the resolved one labels the run)."""
        if source not in GROUP_SOURCES:
            raise ValueError(f"acceptance.source={source!r}: choose one of {list(GROUP_SOURCES)}")
        if source in ("mel", "codec") and embeddings is None and not codec_dir:
            raise ValueError(
                f"acceptance.source={source} builds groups from a toy codec: set acceptance.codec_dir "
                "(e.g. ${toy_world.dir}/codec), or use acceptance.source=embedding"
            )
        if group_size is not None and not group_size >= 1:
            raise ValueError(
                f"acceptance.group_size={group_size}: a mean group size is >= 1 (1 = every token alone, exact "
                "decoding); or set acceptance.group_size=null and give theta"
            )
        self.theta = float(theta)
        self.group_size = None if group_size is None else float(group_size)
        self.source, self.codec_dir = source, codec_dir
        self.max_thinning_trials = int(max_thinning_trials)
        if embeddings is not None:
            self._set_groups(embeddings, len(embeddings))

    def _set_groups(self, vectors: torch.Tensor, vocab: int) -> None:
        """Groups over the first len(vectors) ids (speech tokens); ids up to `vocab` are singletons."""
        if self.group_size is not None:
            self.theta = theta_for_mean_group_size(vectors, self.group_size)
        neighbors, mask = similarity_groups(vectors, self.theta)
        extra = vocab - len(vectors)
        if extra > 0:
            pad = torch.arange(len(vectors), vocab).unsqueeze(-1)
            neighbors = torch.cat(
                [neighbors, torch.cat([pad, pad.new_zeros(extra, neighbors.shape[1] - 1)], 1)]
            )
            first = torch.zeros(extra, mask.shape[1], dtype=torch.bool)
            first[:, 0] = True
            mask = torch.cat([mask, first])
        self.neighbors, self.neighbor_mask = neighbors, mask
        self.sizes = self.neighbor_mask.sum(-1)  # m(u) = |G_u|
        self.speech_tokens = len(vectors)

    def bind(self, target) -> PCGRule:
        if not hasattr(self, "neighbors"):
            speech = int(getattr(target, "speech_token_size", target.vocab_size))
            with torch.no_grad():
                self._set_groups(
                    group_vectors(self.source, target, speech, self.codec_dir), target.vocab_size
                )
        return self

    def group_stats(self) -> dict[str, float]:
        """Mean / median group size and singleton fraction over the speech tokens, and the θ in use."""
        sizes = self.sizes[: self.speech_tokens].float()
        return {
            "group_mean_size": float(sizes.mean()),
            "group_median_size": float(sizes.median()),
            "group_singleton_fraction": float((sizes == 1).float().mean()),
            "group_theta": self.theta,
        }

    @property
    def vocab_size(self) -> int:
        return self.neighbors.shape[0]

    def to(self, device) -> PCGRule:
        self.neighbors = self.neighbors.to(device)
        self.neighbor_mask = self.neighbor_mask.to(device)
        self.sizes = self.sizes.to(device)
        return self

    def coarse_mass(self, law: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
        """P_c(v) = sum_{u in G_v} P(u)/m(u) for group ids `groups` [...]; law [..., V]."""
        members = self.neighbors[groups]  # [..., G]
        mask = self.neighbor_mask[groups]
        split = law / self.sizes.to(law.dtype)
        return (split.gather(-1, members) * mask).sum(-1)

    def _uniform_member(self, tokens: torch.Tensor, generator: RowRandom) -> torch.Tensor:
        """A group label chosen uniformly among the groups containing each token; tokens [B] or [B, k]."""
        size = self.sizes[tokens]
        u = generator.uniform(tokens[0].numel(), dtype=torch.float32).reshape(tokens.shape)
        slot = (u * size).long().clamp(max=size - 1)
        return self.neighbors[tokens].gather(-1, slot.unsqueeze(-1)).squeeze(-1)

    def verify(self, p, q, x, generator=None):
        n_acc, next_token, _ = self.verify_groups(p, q, x, generator)
        return n_acc, next_token

    def verify_groups(self, p, q, x, generator=None):
        """verify() plus the group label [B] of the token emitted at the first draft position.

        Every row runs the residual branch (used only where it rejected), so every row draws the same
        count of numbers whatever its verdict: 2k + 3·max_thinning_trials + 3.
        """
        if self.neighbors.device != x.device:
            self.to(x.device)
        batch, k = x.shape
        generator = RowRandom.of(generator, batch, x.device)
        labels = self._uniform_member(x, generator)  # [B, k], ~ P_c at each position
        pc, qc = self.coarse_mass(p, labels), self.coarse_mass(q[:, :k], labels)
        accept = (qc / pc.clamp_min(torch.finfo(p.dtype).tiny)).clamp(max=1.0)
        u = generator.uniform(k, dtype=accept.dtype)
        n_acc = (u < accept).long().cumprod(-1).sum(-1)
        rejected = n_acc < k
        rows = torch.arange(batch, device=x.device)
        pos = n_acc.clamp(max=k - 1)
        bonus = sample(q[:, k], generator)
        groups = self.residual_group(p[rows, pos], q[rows, pos], generator)
        replacement = self.token_in_group(q[rows, pos], groups, generator)
        next_token = torch.where(rejected, replacement, bonus)
        first_group = torch.where(n_acc == 0, groups, labels[:, 0])
        return n_acc, next_token, first_group

    def residual_group(self, p: torch.Tensor, q: torch.Tensor, generator: RowRandom) -> torch.Tensor:
        """Group ids [N] ~ normalize(max(0, Q_c - P_c)), by thinning, then enumeration.

        A fixed block of trials for every row (a row that succeeded keeps its first success), so the
        count of numbers drawn does not depend on the data; the enumerated fallback is computed for every
        row and used where all trials failed.
        """
        result = torch.full((p.shape[0],), -1, dtype=torch.long, device=p.device)
        tiny = torch.finfo(q.dtype).tiny
        for _ in range(self.max_thinning_trials):
            proposal = self._uniform_member(sample(q, generator), generator)  # ~ Q_c
            qc, pc = self.coarse_mass(q, proposal), self.coarse_mass(p, proposal)
            keep_prob = (1 - pc / qc.clamp_min(tiny)).clamp_min(0)
            ok = generator.uniform(1, dtype=keep_prob.dtype).squeeze(-1) < keep_prob
            result = torch.where((result < 0) & ok, proposal, result)
        all_groups = torch.arange(self.vocab_size, device=p.device)
        diff = (self.coarse_law(q, all_groups) - self.coarse_law(p, all_groups)).clamp_min(0)
        return torch.where(result < 0, sample(_normalize(diff), generator), result)

    def coarse_law(self, law: torch.Tensor, all_groups: torch.Tensor | None = None) -> torch.Tensor:
        """Q_c over every group [N, V] (enumerates all groups; fallback and certificates)."""
        if all_groups is None:
            all_groups = torch.arange(self.vocab_size, device=law.device)
        split = law / self.sizes.to(law.dtype)
        return (split[:, self.neighbors[all_groups]] * self.neighbor_mask[all_groups]).sum(-1)

    def token_in_group(self, q: torch.Tensor, groups: torch.Tensor, generator: RowRandom) -> torch.Tensor:
        members, mask = self.neighbors[groups], self.neighbor_mask[groups]
        weight = q.gather(-1, members) / self.sizes[members].to(q.dtype) * mask
        return members.gather(-1, sample(_normalize(weight), generator).unsqueeze(-1)).squeeze(-1)

    def group_law(self, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """Exact one-step law of the emitted group label [N, V] (certificate)."""
        pc, qc = self.coarse_law(p), self.coarse_law(q)
        accept = (qc / pc.clamp_min(torch.finfo(p.dtype).tiny)).clamp(max=1.0)
        kept = pc * accept
        return kept + (1 - kept.sum(-1, keepdim=True)) * _normalize((qc - pc).clamp_min(0))

    def output_law(self, p, q):
        """Token-level law: accepted draft tokens, plus residual groups' Q-split members."""
        pc, qc = self.coarse_law(p), self.coarse_law(q)
        accept_group = (qc / pc.clamp_min(torch.finfo(p.dtype).tiny)).clamp(max=1.0)  # [N, V groups]
        split_p = p / self.sizes.to(p.dtype)
        member = self.membership(p.dtype)  # [groups, tokens]
        kept = split_p * (accept_group @ member)  # token x kept via each of its groups
        residual = _normalize((qc - pc).clamp_min(0))
        split_q = q / self.sizes.to(q.dtype)
        in_group = member * split_q.unsqueeze(-2)  # [N, groups, tokens]
        token_given_group = in_group / in_group.sum(-1, keepdim=True).clamp_min(torch.finfo(q.dtype).tiny)
        reject = 1 - kept.sum(-1, keepdim=True)
        return kept + reject * (residual.unsqueeze(-1) * token_given_group).sum(-2)

    def membership(self, dtype=torch.float64) -> torch.Tensor:
        """Dense [groups, tokens] 0/1 matrix (small vocabularies only)."""
        v = self.vocab_size
        dense = torch.zeros(v, v, dtype=dtype, device=self.neighbors.device)
        rows = torch.arange(v, device=self.neighbors.device).unsqueeze(-1).expand_as(self.neighbors)
        dense[rows[self.neighbor_mask], self.neighbors[self.neighbor_mask]] = 1
        return dense

    def __repr__(self):
        if not hasattr(self, "neighbors"):
            return f"PCGRule(theta={self.theta}, groups not built yet: bind(target))"
        return f"PCGRule(theta={self.theta:.4f}, source={self.source}, vocab={self.vocab_size}, mean_group={self.sizes.float().mean():.2f})"


# Where PCG's token vectors come from (PCGRule.source).
GROUP_SOURCES = ("embedding", "mel", "codec", "random")


def group_vectors(source: str, target, speech_tokens: int, codec_dir: str | None = None) -> torch.Tensor:
    """[speech_tokens, H] vectors of head ids 0..speech_tokens-1 (head id N is codec token N):
    "embedding": the target's speech-token input embeddings; "mel": the log-mel frames a toy codec's decoder
    gives each token alone (average voice), flattened and centred over the vocabulary; "codec": the toy
    codec's codebook centroids; "random": seeded random vectors (a control: groups of acoustically
    unrelated tokens)."""
    if source == "embedding":
        return target.embed_speech(torch.arange(speech_tokens, device=target.device)).float().cpu()
    if source == "random":
        return torch.randn(speech_tokens, 64, generator=torch.Generator().manual_seed(0))
    from ssd.toy_world.codec import ToyCodec

    codec = ToyCodec.load(codec_dir)
    if codec.codebook_size != speech_tokens:
        raise ValueError(
            f"acceptance.codec_dir={codec_dir}: the codec has {codec.codebook_size} tokens but the target "
            f"{speech_tokens} speech tokens: point it at this target's codec"
        )
    if source == "codec":
        return torch.from_numpy(codec.centroids).float()
    with torch.inference_mode():
        tokens = torch.arange(speech_tokens).unsqueeze(-1)  # each token decoded alone
        voice = torch.from_numpy(codec.mean_voice).expand(speech_tokens, -1)
        out = codec.decoder(tokens, voice)  # [V, n_out, frames]
        if codec.cfg.decoder_target == "log_mel":
            log_mel = out
        else:
            log_mel = torch.log(torch.einsum("mf,vft->vmt", codec.mel_fb, out.exp()).clamp_min(1e-5))
    frames = log_mel.flatten(1)
    return frames - frames.mean(0)  # cosine of deviations from the average frame, not of loudness


def theta_for_mean_group_size(vectors: torch.Tensor, mean_size: float, chunk: int = 2048) -> float:
    """The cosine θ at which the groups {u : cos(e_u, e_v) > θ} have mean size `mean_size` over the rows of
    `vectors`: sum_v |G_v| = V + #{ordered pairs u != v with cos > θ}, so θ sits between the N-th and
    (N+1)-th largest off-diagonal cosine, N = round((mean_size - 1)·V). One chunked pass (V can be 65k);
    ties at the boundary can make the mean differ from the request by their count / V."""
    e = torch.nn.functional.normalize(vectors.detach().float(), dim=-1)
    vocab = e.shape[0]
    n_pairs = round((mean_size - 1) * vocab)
    if n_pairs <= 0:
        return 1.0  # no cosine exceeds 1: every token alone
    if n_pairs >= vocab * (vocab - 1):
        return -1.0 - 1e-6  # every pair: one group
    best = e.new_empty(0)
    for start in range(0, vocab, chunk):
        sim = e[start : start + chunk] @ e.T
        sim[torch.arange(sim.shape[0]), torch.arange(start, start + sim.shape[0])] = -math.inf
        best = torch.cat([best, sim.flatten()]).topk(min(n_pairs + 1, best.numel() + sim.numel())).values
    return float((best[n_pairs - 1] + best[n_pairs]) / 2)


class GroupSwap:
    """The PCG paper's stress test: replace every generated speech token by a member of its group drawn
    uniformly (itself included), before vocoding. Groups come from a PCGRule bound to the target; the
    draws from a generator seeded per utterance, so a rerun swaps the same tokens."""

    def __init__(self, groups: PCGRule):
        if not isinstance(groups, PCGRule):
            raise TypeError(
                f"perturb.groups must be a PCGRule (perturb.groups._target_=ssd.decoding.acceptance.PCGRule), "
                f"got {type(groups).__name__}"
            )
        self.groups = groups

    def bind(self, target) -> GroupSwap:
        self.groups.bind(target)
        return self

    def labels(self) -> dict:
        return {"swap_" + k: v for k, v in self.groups.labels().items()}

    def __call__(self, tokens: list[int], seed: int) -> list[int]:
        groups = self.groups.to("cpu")
        ids = torch.as_tensor(tokens, dtype=torch.long)
        speech = ids < groups.speech_tokens  # stop/text ids stay
        safe = torch.where(speech, ids, 0)
        u = torch.rand(len(tokens), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        size = groups.sizes[safe]
        slot = (u * size).long().clamp(max=size - 1)
        drawn = groups.neighbors[safe].gather(-1, slot.unsqueeze(-1)).squeeze(-1)
        return torch.where(speech, drawn, ids).tolist()


def similarity_groups(embeddings: torch.Tensor, theta: float, chunk: int = 2048):
    """Padded neighbour lists of {u : cos(e_u, e_v) > θ} for every v (chunked: V can be 65k).

    Returns (neighbors [V, G] long, mask [V, G] bool); every token is its own member.
    """
    e = torch.nn.functional.normalize(embeddings.detach().float(), dim=-1)
    vocab = e.shape[0]
    lists = []
    for start in range(0, vocab, chunk):
        sim = e[start : start + chunk] @ e.T
        sim[torch.arange(sim.shape[0]), torch.arange(start, start + sim.shape[0])] = math.inf
        lists.extend(row.nonzero().squeeze(-1) for row in sim > theta)
    width = max(len(ids) for ids in lists)
    neighbors = torch.zeros(vocab, width, dtype=torch.long)
    mask = torch.zeros(vocab, width, dtype=torch.bool)
    for v, ids in enumerate(lists):
        neighbors[v, : len(ids)], mask[v, : len(ids)] = ids, True
    return neighbors, mask
