"""PCG: principled coarse-grained acceptance (Yanuka et al. 2025, docs/algorithms.md §1.3), its groups, and the
paper's stress test (`GroupSwap`).

Groups G_v = {u : cos(e_u, e_v) > θ} over vectors e of the speech tokens, which a group source gives the rule
at `bind` (configs/groups/): the target's speech-token input embeddings (the paper), random vectors (a
control), or, from the toy world, its codec's mel frames or centroids (`ssd.toy_world.groups`).

The groups are stored sparsely (`Groups`: every group's members in one flat list), so memory and the per-round
work scale with the group sizes, never with V × the largest group.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

from ssd.decoding.acceptance import AcceptanceRule, _normalize
from ssd.decoding.rng import RowRandom
from ssd.decoding.sampling import inverse_cdf
from ssd.decoding.sequences import UNSETTLED


class TargetEmbeddings:
    """The target's speech-token input embeddings (the paper's groups)."""

    name = "embedding"

    def __call__(self, target) -> torch.Tensor:
        speech = int(getattr(target, "speech_token_size", target.vocab_size))
        return target.embed_speech(torch.arange(speech, device=target.device)).float().cpu()


class RandomVectors:
    """Seeded random vectors: groups of acoustically unrelated tokens (a control)."""

    name = "random"

    def __init__(self, dim: int = 64, seed: int = 0):
        self.dim, self.seed = int(dim), int(seed)

    def __call__(self, target) -> torch.Tensor:
        speech = int(getattr(target, "speech_token_size", target.vocab_size))
        return torch.randn(speech, self.dim, generator=torch.Generator().manual_seed(self.seed))


class Groups:
    """One group G_v per vocabulary entry v, symmetric (u ∈ G_v ⇔ v ∈ G_u) and holding v itself, so a token u
    lies in m(u) = |G_u| groups. Stored flat: `members[offsets[v]:offsets[v + 1]]` is G_v."""

    def __init__(self, offsets: torch.Tensor, members: torch.Tensor) -> None:
        self.offsets, self.members = offsets.long(), members.long()
        self.sizes = self.offsets.diff()  # m(u) = |G_u|
        self.width = int(self.sizes.max())  # the largest group: fixed per rule, so gathers need no host read
        group_of = torch.repeat_interleave(torch.arange(len(self.sizes)), self.sizes)  # group of each entry
        self.slots = torch.arange(self.width)  # a member's place in its padded group
        # `padded` holds every group's members followed by one sentinel, a copy of its last member of weight 0
        # (in place of 1/m): a padded gather clamps its slots to the sentinel's, whose share is 0, so no mask
        # multiplies the shares. A uniform pick's floor(u · |G|) stays below |G| for u < 1 (the product rounds
        # down), so it needs no clamp either.
        self.start = self.offsets[:-1] + torch.arange(len(self.sizes))  # where G_v starts in `padded`
        self.padded = self.members.new_zeros(len(self.members) + len(self.sizes))
        self.padded[torch.arange(len(self.members)) + group_of] = self.members
        self.padded[self.start + self.sizes] = self.members[self.offsets[1:] - 1]
        self._sizes_as: dict[torch.dtype, torch.Tensor] = {}
        self._member_weights: dict[torch.dtype, torch.Tensor] = {}
        self._membership: dict[torch.dtype, torch.Tensor] = {}

    @classmethod
    def from_lists(cls, lists: list[torch.Tensor]) -> Groups:
        sizes = torch.tensor([len(ids) for ids in lists])
        return cls(
            torch.cat([sizes.new_zeros(1), sizes.cumsum(0)]), torch.cat([torch.as_tensor(i) for i in lists])
        )

    @classmethod
    def from_vectors(cls, vectors: torch.Tensor, theta: float, vocab: int, chunk: int = 2048) -> Groups:
        """{u : cos(e_u, e_v) > θ} over the rows of `vectors` (speech tokens; chunked: V can be 65k); the ids
        len(vectors)..vocab-1 (stop tokens, text ids) are each alone."""
        e = torch.nn.functional.normalize(vectors.detach().float(), dim=-1)
        lists = []
        for start in range(0, len(e), chunk):
            sim = e[start : start + chunk] @ e.T
            sim[torch.arange(sim.shape[0]), torch.arange(start, start + sim.shape[0])] = math.inf
            lists.extend(row.nonzero().squeeze(-1) for row in sim > theta)
        lists.extend(torch.tensor([v]) for v in range(len(e), vocab))
        return cls.from_lists(lists)

    @classmethod
    def blocks(cls, vocab: int, size: int) -> Groups:
        """A partition into consecutive blocks of `size` tokens (benchmarks at vocabulary sizes where cosine
        groups would take hours to build; every block its members' group)."""
        starts = torch.arange(vocab) // size * size
        sizes = (starts + size).clamp(max=vocab) - starts
        offsets = torch.cat([sizes.new_zeros(1), sizes.cumsum(0)])
        within = torch.arange(int(offsets[-1])) - offsets[:-1].repeat_interleave(sizes)
        return cls(offsets, starts.repeat_interleave(sizes) + within)

    @property
    def vocab_size(self) -> int:
        return len(self.sizes)

    def on(self, device: torch.device) -> Groups:
        """These groups, moved to `device` first if they live elsewhere (one check per call of a rule, not per
        gather)."""
        if self.members.device != device:
            self.to(device)
        return self

    def to(self, device) -> Groups:
        for name in ("offsets", "members", "sizes", "slots", "start", "padded"):
            setattr(self, name, getattr(self, name).to(device))
        self._sizes_as, self._member_weights, self._membership = {}, {}, {}
        return self

    def _index(self, groups: torch.Tensor) -> torch.Tensor:
        """[..., W]: where the members of the groups `groups` [...] lie in `padded` (their sentinel past a
        group's end)."""
        groups = groups.unsqueeze(-1)
        return self.start.take(groups) + self.slots.minimum(self.sizes.take(groups))

    def of(self, groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [..., W], mask [..., W]): the members of the groups `groups` [...], padded to the largest group
        (past a group's end, its last member)."""
        ids = self.padded.take(self._index(groups))
        return ids, self.slots < self.sizes.take(groups.unsqueeze(-1))

    def pick(self, groups: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """One member of each group, chosen uniformly by uniforms u (groups' shape): the member at place
        floor(u · |G|)."""
        place = self.start.take(groups) + (u * self._float_sizes(u.dtype).take(groups)).long()
        return self.padded.take(place)

    def split(self, groups: torch.Tensor, *laws: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(ids [..., T, W], then per law its shares [..., T, W]): the members of the groups `groups` [..., T]
        (padded) and each member's share P(u)/m(u) of each law (0 past a group's end). A law is [..., T', V],
        one per group (T' >= T: the first T read; a row's one law for its T groups is expanded to T). Work: the
        members only, not V."""
        ids, weights = self._members(groups, laws[0].dtype)
        return ids, *(law.gather(-1, ids) * weights for law in laws)

    def masses(self, groups: torch.Tensor, *laws: torch.Tensor) -> list[torch.Tensor]:
        """Per law, the mass P_c(v) = Σ_{u in G_v} P(u)/m(u) of each group v of `groups` [..., T] (the sum of
        its shares in `split`; laws as there): [..., T] each."""
        ids, weights = self._members(groups, laws[0].dtype)
        return [torch.linalg.vecdot(law.gather(-1, ids), weights) for law in laws]

    def _members(self, groups: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, 1/m(u)) of the members of the groups `groups` [...], both [..., W] (0 past a group's end)."""
        index = self._index(groups)
        return self.padded.take(index), self._inverse_sizes(dtype).take(index)

    def _float_sizes(self, dtype: torch.dtype) -> torch.Tensor:
        """|G_v| of every group as `dtype`, made once per dtype (a product of two dtypes costs a cast per call)."""
        if dtype not in self._sizes_as:
            self._sizes_as[dtype] = self.sizes.to(dtype)
        return self._sizes_as[dtype]

    def _inverse_sizes(self, dtype: torch.dtype) -> torch.Tensor:
        """1/m(u) of every entry of `padded`, as `dtype` (0 for the sentinels), made once per dtype."""
        if dtype not in self._member_weights:
            weights = self.sizes.take(self.padded).to(dtype).reciprocal()
            self._member_weights[dtype] = weights.index_fill_(0, self.start + self.sizes, 0)
        return self._member_weights[dtype]

    def law(self, law: torch.Tensor) -> torch.Tensor:
        """The coarse law over every group [N, V] of laws [N, V]: the sparse membership [groups, tokens] times
        the shares P(u)/m(u), Σ|G| work per row."""
        return (self.membership(law.dtype) @ (law / self._float_sizes(law.dtype)).T).T

    def membership(self, dtype: torch.dtype) -> torch.Tensor:
        """[groups, tokens] 0/1 membership as a sparse CSR matrix of `dtype`, made once per dtype. Its product
        with a dense matrix sums each group's members in order, row by row, so a row's coarse law has the same
        bits in any batch."""
        if dtype not in self._membership:
            columns = self.members
            rows = torch.repeat_interleave(torch.arange(self.vocab_size, device=columns.device), self.sizes)
            # CSR wants each row's columns sorted (groups from vectors or blocks already are)
            if not bool(((columns.diff() > 0) | (rows.diff() > 0)).all()):
                columns = columns[(rows * self.vocab_size + columns).argsort()]
            # torch calls all of CSR "beta"; sparse @ dense is what this uses of it
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta state")
                self._membership[dtype] = torch.sparse_csr_tensor(
                    self.offsets, columns, columns.new_ones(len(columns), dtype=dtype),
                    (self.vocab_size, self.vocab_size), check_invariants=True,
                )  # fmt: skip
        return self._membership[dtype]

    def dense(self, dtype=torch.float64) -> torch.Tensor:
        """[groups, tokens] 0/1 membership (small vocabularies only: the certificates)."""
        return self.membership(dtype).to_dense()


class PCGRule(AcceptanceRule):
    """Principled coarse-grained acceptance (Yanuka et al. 2025, docs/algorithms.md §1.3).

    Groups G_v = {u : cos(e_u, e_v) > θ} over vectors e of the speech tokens (`source`, see the module doc).
    θ is an absolute cosine (the paper's knob), or it is resolved per target from a requested mean group size
    (`group_size`): cosine scales differ between embedding spaces, so one θ means singletons on one target and
    huge groups on another. Stop tokens (head ids >= the target's speech_token_size) are always alone.

    Token u lies in m(u) = |G_u| groups and gives each of them P(u)/m(u). Draft token x ~ P, group label v
    uniform in G_x (so v ~ P_c); accept with min(1, Q_c(v)/P_c(v)) and keep x. On rejection draw v from
    normalize(max(0, Q_c - P_c)) by thinning: `thinning_trials` proposals v ~ Q_c at once (u ~ Q, v uniform in
    G_u), the first kept with probability max(0, 1 - P_c(v)/Q_c(v)). The emitted token is the u of the kept
    proposal: given v, u has Q's mass split over G_v, Q(u)/m(u) normalised, which is the token law inside the
    group. When all draft tokens were kept, the bonus position is the same draw with P = 0 (every proposal
    kept, so the bonus token is the first proposal's u ~ Q). A row whose trials all failed (rare: the residual
    has little mass there) is left UNSETTLED, and `settle` draws its group from the enumerated residual after
    the round's host sync, then its token from Q's mass split, with numbers `verify` drew for every row, so the
    work and the draws of a row never depend on the data or on the other rows. Guarantee: the emitted GROUP
    sequence is an exact sample of Q_c.
    """

    name = "pcg"
    preserves_target_law = False  # the GROUP law is Q_c's; the token law is not q
    cheap_output_law = False  # needs the dense [groups, tokens] membership

    def __init__(self, theta: float = 0.4, group_size: float | None = None, source: Any = None,
                 thinning_trials: int = 16, vectors: torch.Tensor | None = None):  # fmt: skip
        """theta: the cosine threshold; group_size: a mean group size over the speech tokens (>= 1) instead,
        resolved to a θ when the groups are built (the resolved one labels the run).
        source: where the token vectors come from, a callable target -> [speech tokens, H] with a `name`
        (configs/groups/: the target's speech embeddings, the paper's choice, by default; random vectors;
        the toy codec's mel frames or centroids in `ssd.toy_world.groups`); vectors [V, H]: the vectors
        themselves (every id a speech token), groups built now instead of at `bind`."""
        if group_size is not None and not group_size >= 1:
            raise ValueError(
                f"acceptance.group_size={group_size}: a mean group size is >= 1 (1 = every token alone, exact "
                "decoding); or set acceptance.group_size=null and give theta"
            )
        if thinning_trials < 1:
            raise ValueError(f"acceptance.thinning_trials={thinning_trials} must be >= 1")
        self.theta = float(theta)
        self.group_size = None if group_size is None else float(group_size)
        self.source = source if source is not None else TargetEmbeddings()
        self.thinning_trials = int(thinning_trials)
        self.groups: Groups | None = None
        if vectors is not None:
            self.build_groups(vectors, len(vectors))

    def labels(self) -> dict[str, Any]:
        return {"theta": self.theta, "group_size": self.group_size, "source": self.source.name}

    def build_groups(self, vectors: torch.Tensor, vocab: int) -> PCGRule:
        """Groups over the first len(vectors) ids (speech tokens); ids up to `vocab` are singletons."""
        if self.group_size is not None:
            self.theta = theta_for_mean_group_size(vectors, self.group_size)
        self.groups = Groups.from_vectors(vectors, self.theta, vocab)
        self.speech_tokens = len(vectors)
        return self

    def bind(self, target) -> PCGRule:
        if self.groups is None:
            with torch.no_grad():
                self.build_groups(self.source(target), target.vocab_size)
        return self

    def group_stats(self) -> dict[str, float]:
        """Mean / median group size and singleton fraction over the speech tokens, and the θ in use."""
        sizes = self.groups.sizes[: self.speech_tokens].float()
        return {
            "group_mean_size": float(sizes.mean()),
            "group_median_size": float(sizes.median()),
            "group_singleton_fraction": float((sizes == 1).float().mean()),
            "group_theta": self.theta,
        }

    @property
    def vocab_size(self) -> int:
        return self.groups.vocab_size

    def members(self, groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [..., W], mask [..., W]): the members of the groups G_v for group ids v [...], padded."""
        return self.groups.on(groups.device).of(groups)

    # --- verification -------------------------------------------------------------------------------
    def verify(self, p, q, x, generator=None):
        """(n_accepted [B], next token [B], UNSETTLED where `settle` must finish the row). Draws 2k + 3T + 2
        numbers per row (T = thinning_trials), whatever the verdicts.

        Two gathers of group members: the draft tokens' labels at every position, then, at the one position
        each row's verdicts select (its first rejection, or the bonus position), the T thinning proposals."""
        batch, k = x.shape
        trials = self.thinning_trials
        streams = RowRandom.of(generator, batch, x.device)
        u = streams.uniform(2 * k + 3 * trials + 2, q.dtype)
        u_label, u_accept, u_draw, u_member, u_keep, u_settle = u.split_with_sizes(
            (k, k, trials, trials, trials, 2), 1
        )
        # The label of each draft token x, uniform in G_x (so ~ P_c), kept with min(1, Q_c / P_c): u < 1, so
        # u · P_c < Q_c decides it (P_c > 0: x was drawn from P)
        groups = self.groups.on(x.device)
        labels = groups.pick(x, u_label)
        p_label, q_label = groups.masses(labels, p, q)
        accepted = u_accept * p_label < q_label
        n_acc = accepted.cumprod(-1).sum(-1)
        rows, pos = streams.row_ids, n_acc.clamp(max=k - 1)
        # At position n_acc: T proposals v ~ Q_c (u ~ Q, v uniform in G_u)
        q_next = q[rows, n_acc]
        tokens = inverse_cdf(q_next, u_draw)
        proposals = groups.pick(tokens, u_member)
        p_proposed, q_proposed = groups.masses(
            proposals,
            p[rows, pos].unsqueeze(1).expand(-1, trials, -1),
            q_next.unsqueeze(1).expand(-1, trials, -1),
        )
        # Thinning: the first proposal kept with probability (1 - P_c(v)/Q_c(v))^+, i.e. where u · Q_c > P_c
        # (Q_c > 0: v is a group of a token Q drew). At the bonus position the draft proposed nothing (P = 0),
        # so the first proposal is kept: its token, a draw of Q, is the bonus token.
        kept = (u_keep * q_proposed > p_proposed) | accepted.all(-1, keepdim=True)
        settled, chosen = kept.max(-1)  # the first kept proposal (max returns the first of equal values)
        self._pending = (p, q, pos, u_settle, proposals, chosen, labels)  # what `settle` reads
        # The token whose proposal was kept: given its group v, its law is Q(u)/m(u) over u in G_v, the share
        # each member gave Q_c(v), which is the law the emitted token must have inside the group
        return n_acc, torch.where(settled, tokens[rows, chosen], UNSETTLED)

    def settle(self, next_token: torch.Tensor) -> torch.Tensor:
        """Finish the UNSETTLED rows of the last `verify`: their group from the enumerated residual
        normalize(max(0, Q_c - P_c)) over every group (Σ|G| work per such row), their token inside it; the draws
        are the two numbers verify kept for each row."""
        rows = (next_token == UNSETTLED).nonzero().squeeze(-1)  # a host read: only after the sync saw some
        p, q, pos, u, proposals, chosen, labels = self._pending
        p_at, q_at = p[rows, pos[rows]], q[rows, pos[rows]]
        q_c, p_c = self.groups.law(torch.cat([q_at, p_at])).chunk(2)  # one sparse product for both laws
        residual = (q_c - p_c).clamp_min(0)
        settled = inverse_cdf(residual, u[rows, :1])[:, 0]
        ids, shares = self.groups.split(settled[:, None], q_at[:, None])
        out = next_token.clone()
        out[rows] = _member(ids[:, 0], shares[:, 0], u[rows, 1:])
        # the settled group takes the place of the (unkept) proposal `chosen` points at
        self._pending = (p, q, pos, u, proposals.index_put((rows, chosen[rows]), settled), chosen, labels)
        return out

    def verify_groups(self, p, q, x, generator=None):
        """verify(), settled, plus the group label [B] emitted at the first draft position (certificates)."""
        n_acc, next_token = self.verify(p, q, x, generator)
        if bool((next_token == UNSETTLED).any()):
            next_token = self.settle(next_token)
        *_, proposals, chosen, labels = self._pending
        group = proposals.gather(1, chosen[:, None])[:, 0]
        return n_acc, next_token, torch.where(n_acc == 0, group, labels[:, 0])

    # --- laws (certificates) -----------------------------------------------------------------------------
    def coarse_law(self, law: torch.Tensor) -> torch.Tensor:
        """Q_c over every group [N, V]."""
        return self.groups.on(law.device).law(law)

    def group_law(self, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """Exact one-step law of the emitted group label [N, V]."""
        pc, qc = self.coarse_law(p), self.coarse_law(q)
        accept = (qc / pc.clamp_min(torch.finfo(p.dtype).tiny)).clamp(max=1.0)
        kept = pc * accept
        return kept + (1 - kept.sum(-1, keepdim=True)) * _normalize((qc - pc).clamp_min(0))

    def output_law(self, p, q):
        """Token-level law: accepted draft tokens, plus residual groups' Q-split members."""
        pc, qc = self.coarse_law(p), self.coarse_law(q)
        accept_group = (qc / pc.clamp_min(torch.finfo(p.dtype).tiny)).clamp(max=1.0)  # [N, V groups]
        sizes = self.groups.sizes.to(p.dtype)
        member = self.groups.on(p.device).dense(p.dtype)  # [groups, tokens]
        kept = p / sizes * (accept_group @ member)  # token x kept via each of its groups
        residual = _normalize((qc - pc).clamp_min(0))
        in_group = member * (q / sizes).unsqueeze(-2)  # [N, groups, tokens]
        token_given_group = in_group / in_group.sum(-1, keepdim=True).clamp_min(torch.finfo(q.dtype).tiny)
        reject = 1 - kept.sum(-1, keepdim=True)
        return kept + reject * (residual.unsqueeze(-1) * token_given_group).sum(-2)

    def __repr__(self):
        if self.groups is None:
            return f"PCGRule(theta={self.theta}, groups not built yet: bind(target))"
        mean = self.groups.sizes.float().mean()
        return f"PCGRule(theta={self.theta:.4f}, source={self.source.name}, vocab={self.vocab_size}, mean_group={mean:.2f})"


def _member(ids: torch.Tensor, shares: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One member [N] of each group, drawn from its members' shares: ids, shares [N, W], uniforms u [N, 1]."""
    return ids.gather(-1, inverse_cdf(shares, u)).squeeze(-1)


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
                f"perturb.groups must be a PCGRule (perturb.groups._target_=ssd.decoding.pcg.PCGRule), "
                f"got {type(groups).__name__}"
            )
        self.groups = groups

    def bind(self, target) -> GroupSwap:
        self.groups.bind(target)
        return self

    def labels(self) -> dict:
        return {"swap_" + k: v for k, v in self.groups.labels().items()}

    def __call__(self, tokens: list[int], seed: int) -> list[int]:
        ids = torch.as_tensor(tokens, dtype=torch.long)
        speech = ids < self.groups.speech_tokens  # stop/text ids stay
        u = torch.rand(len(tokens), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        drawn = self.groups.groups.on(ids.device).pick(torch.where(speech, ids, 0), u)
        return torch.where(speech, drawn, ids).tolist()
