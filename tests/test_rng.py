"""Per-row random streams (ssd.decoding.rng): splitmix64 exactly, uniform, and independent of the batch."""

import numpy as np
import torch
from scipy import stats

from ssd.decoding.rng import RowRandom

MASK = (1 << 64) - 1


def _splitmix64(seed: int, n: int) -> list[int]:
    """The reference: Vigna's splitmix64 in Python integers, keyed by the mixed seed."""

    def mix(z: int) -> int:
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & MASK
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB & MASK
        return z ^ (z >> 31)

    key = mix(seed & MASK)
    return [mix((key + (i + 1) * 0x9E3779B97F4A7C15) & MASK) for i in range(n)]


def test_streams_equal_the_reference_splitmix64():
    seeds = [0, 1, 12345, 2**63 - 1]
    rng = RowRandom(seeds)
    got = (rng.bits(2).tolist(), rng.bits(3).tolist())
    for row, seed in enumerate(seeds):
        assert [v & MASK for v in got[0][row] + got[1][row]] == _splitmix64(seed, 5)


def test_a_row_draws_the_same_numbers_in_any_batch():
    alone = RowRandom([42]).uniform(7)
    batched = RowRandom([3, 42, 9]).uniform(7)
    assert torch.equal(alone[0], batched[1])
    assert not torch.equal(batched[0], batched[1])
    sub = RowRandom([3, 42, 9])
    sub.uniform(2)
    assert torch.equal(sub.rows([1]).uniform(5)[0], alone[0, 2:])


def test_uniforms_are_uniform_and_a_biased_control_is_rejected():
    u = RowRandom(range(50)).uniform(2000, torch.float64).flatten().numpy()
    assert 0 <= u.min() and u.max() < 1
    counts = np.histogram(u, bins=20, range=(0, 1))[0]
    assert stats.chisquare(counts).pvalue > 1e-3
    assert stats.chisquare(np.histogram(u**1.05, bins=20, range=(0, 1))[0]).pvalue < 1e-6
    # neighbouring counters and neighbouring seeds are uncorrelated
    pairs = RowRandom(range(200)).uniform(2, torch.float64).numpy()
    assert abs(np.corrcoef(pairs[:, 0], pairs[:, 1])[0, 1]) < 0.25
    assert abs(np.corrcoef(pairs[:-1, 0], pairs[1:, 0])[0, 1]) < 0.25


def test_of_keeps_row_streams_and_seeds_new_ones_from_a_generator():
    rng = RowRandom([1, 2])
    assert RowRandom.of(rng, 2) is rng
    a = RowRandom.of(torch.Generator().manual_seed(5), 3)
    b = RowRandom.of(torch.Generator().manual_seed(5), 3)
    assert a.seeds == b.seeds and len(set(a.seeds)) == 3
    try:
        RowRandom.of(rng, 3)
    except ValueError as err:
        assert "2 row streams but the batch has 3 rows" in str(err)
    else:
        raise AssertionError("a RowRandom of the wrong batch was accepted")


def test_sample_draws_each_row_from_its_own_stream_and_never_a_zero_mass_token():
    from ssd.decoding.sampling import sample

    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2], [0.0, 0.0, 0.0, 0.0, 1.0]])
    batched = RowRandom([7, 8, 9])
    tokens = torch.stack([sample(probs, batched) for _ in range(400)], 1)
    assert set(tokens[0].tolist()) == {1, 3} and set(tokens[2].tolist()) == {4}
    alone = RowRandom([8])
    assert torch.equal(torch.stack([sample(probs[1:2], alone) for _ in range(400)], 1)[0], tokens[1])
    # u just below 1: the largest uniform never steps past the last token with mass (trailing zeros here)
    edge = RowRandom([0])
    edge.uniform = lambda n=1, dtype=torch.float32: torch.full((1, n), 1 - 2**-24, dtype=dtype)
    assert sample(probs[:1], edge).item() == 3
    # u · total rounding up to the total (u = 1 here) still lands on a token with mass, not past the last one
    edge.uniform = lambda n=1, dtype=torch.float32: torch.ones((1, n), dtype=dtype)
    assert sample(probs[:1], edge).item() == 3
    # a row without mass still gives a token of the vocabulary
    assert sample(torch.zeros(1, 5), edge).item() == 0
    # the law: a chi-square fit, and a shifted law as the negative control
    counts = np.bincount(tokens[1].numpy(), minlength=5)
    assert stats.chisquare(counts).pvalue > 1e-3
    assert stats.chisquare(counts, [100, 100, 100, 40, 60]).pvalue < 1e-3
