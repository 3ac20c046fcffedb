"""An acceptance rule outside the `ssd` package, as a researcher would write one in their own module:
it subclasses nothing and speaks `ssd.contracts.AcceptanceRule` (tests/test_sweep_cli.py plugs it in with
`acceptance._target_=tests.plugin_rule.ThresholdRule`)."""

from __future__ import annotations

import torch

from ssd.decoding.sampling import sample


class ThresholdRule:
    """Keep draft token x while q(x) >= gamma; the next token is drawn from q at the first rejected
    position (or the bonus position). Not exact: a toy rule for the plugin test."""

    name = "threshold"
    preserves_target_law = False
    deterministic = False

    def __init__(self, gamma: float = 0.1) -> None:
        self.gamma = float(gamma)

    def labels(self) -> dict[str, float]:
        return {"gamma": self.gamma}

    def bind(self, target) -> ThresholdRule:
        self.vocab_size = target.vocab_size
        return self

    def verify(self, p, q, x, generator=None):
        batch, k = x.shape
        keep = q[:, :k].gather(-1, x.unsqueeze(-1)).squeeze(-1) >= self.gamma
        n_acc = keep.long().cumprod(-1).sum(-1)
        law = q[torch.arange(batch, device=x.device), n_acc]
        return n_acc, sample(law, generator)  # one number of each row's own stream
