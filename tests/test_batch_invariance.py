"""Batch-invariant numerics (`ssd.models.transformer.use_batch_invariant`): at the toy target's real shape, a
row decoded inside a ragged batch gets bit-for-bit the logits, hence the tokens, it gets decoded alone.

The plain kernels are not so on a CPU BLAS (a 1-row product and the rows of a 5-row one round
differently; masked attention over padded keys takes another path); the negative controls show it
where this machine's kernels do differ, and skip, saying so, where they happen not to."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from engine_models import speculative
from fixtures_models import WORDS

from ssd.decoding.acceptance import ToleranceRule
from ssd.decoding.rng import RowRandom
from ssd.decoding.sampling import SamplingConfig
from ssd.models.transformer import Linear, linear, use_batch_invariant

REPO = Path(__file__).resolve().parents[1]
TOY_TARGET = yaml.safe_load((REPO / "configs/target/toy.yaml").read_text())
TEXTS = [
    "bin blue at one now",
    "place red by seven again please",
    "set white in zero soon",
    "lay green with two",
]
PROMPT_TEXTS = ["set red", "bin white at nine soon", "lay", "place blue by four again now please"]
PROMPT_TOKENS = [[5, 17, 300, 2], list(range(40, 71)), [9], list(range(900, 912))]  # ragged


@pytest.fixture(scope="module")
def toy_shape_target(tmp_path_factory):
    """A random-weight CosyVoice 2 target of the toy target's shape (configs/target/toy.yaml)."""
    from ssd.models.checkpoints import write_cosyvoice2_dir
    from ssd.models.cosyvoice2 import CosyVoice2LM
    from ssd.models.text_tokenizer import write_word_tokenizer

    root = tmp_path_factory.mktemp("toy_shape")
    tokenizer = write_word_tokenizer(WORDS, root / "words")
    arch = {**TOY_TARGET["architecture"], "initializer_range": 0.1}  # peaked laws: tokens are not all ties
    path = write_cosyvoice2_dir(root / "target", arch, TOY_TARGET["speech_token_size"], tokenizer, seed=3)
    return CosyVoice2LM.from_dir(path, dtype="float32", device="cpu").eval()


def _linear_shapes(model):
    return sorted({tuple(m.weight.shape) for m in model.modules() if isinstance(m, Linear)})


def test_sequences_of_a_product_equal_their_products_alone(toy_shape_target):
    """Every Linear of the toy-shape target: sequence b of a B-sequence product is the product of that
    sequence alone, for any B: single rows ([B, K], the head on each row's last position) and blocks of
    T positions ([B, T, K], a verify block)."""
    torch.manual_seed(0)
    plain_differs = False
    for n_out, n_in in _linear_shapes(toy_shape_target):
        weight, bias = torch.randn(n_out, n_in) / n_in**0.5, torch.randn(n_out)
        for x in (torch.randn(40, n_in), torch.randn(40, 4, n_in)):
            alone = torch.cat([F.linear(x[i : i + 1], weight, bias) for i in range(len(x))])
            alone_no_bias = torch.cat([F.linear(x[i : i + 1], weight) for i in range(len(x))])
            for rows in (1, 2, 3, 5, 8, 13, 32, 40):
                assert torch.equal(linear(x[:rows], weight, bias, per_row=True), alone[:rows]), (
                    n_out,
                    x.shape,
                    rows,
                )
                assert torch.equal(linear(x[:rows], weight, per_row=True), alone_no_bias[:rows]), (
                    n_out,
                    x.shape,
                    rows,
                )
                plain_differs |= not torch.equal(F.linear(x[:rows], weight, bias), alone[:rows])
    if not plain_differs:
        pytest.skip("negative control: this BLAS happens to give batch-1 results for every batch size")


def _prompt(target, rows):
    return target.make_prompt([TEXTS[r] for r in rows], [PROMPT_TEXTS[r] for r in rows],
                              [PROMPT_TOKENS[r] for r in rows])  # fmt: skip


def _logits_trace(target, rows):
    """Prefill, a draft-style 1-token step, a verify-style 4-token block, a ragged rollback, another block:
    the logits of each call, per row."""
    gen = torch.Generator().manual_seed(7)
    blocks = torch.randint(0, TOY_TARGET["speech_token_size"], (len(TEXTS), 3, 4), generator=gen)
    back = torch.tensor([1, 3, 0, 2])
    with torch.no_grad():
        cache, first = target.prefill(_prompt(target, rows), 64)
        trace = [first]
        trace.append(target.extend(cache, blocks[rows, 0, :1]))
        trace.append(target.extend(cache, blocks[rows, 1]))
        target.rollback(cache, back[rows])
        trace.append(target.extend(cache, blocks[rows, 2]))
    return trace


def test_ragged_batch_logits_equal_each_row_alone(toy_shape_target):
    rows = list(range(len(TEXTS)))
    use_batch_invariant(toy_shape_target)
    try:
        batch = _logits_trace(toy_shape_target, rows)
        alone = [_logits_trace(toy_shape_target, [r]) for r in rows]
    finally:
        use_batch_invariant(toy_shape_target, False)
    for call, logits in enumerate(batch):
        for r in rows:
            assert torch.equal(logits[r], alone[r][call][0]), f"call {call}, row {r}"
    plain = _logits_trace(toy_shape_target, rows)
    plain_alone = [_logits_trace(toy_shape_target, [r]) for r in rows]
    # The mode changes how a batch is computed, not what batch 1 computes: every call, bit for bit.
    for r in rows:
        for call, logits in enumerate(alone[r]):
            assert torch.equal(logits, plain_alone[r][call]), f"batch 1, call {call}, row {r}"
    same = all(torch.equal(p[r], plain_alone[r][c][0]) for c, p in enumerate(plain) for r in rows)
    if same:
        pytest.skip("negative control: this machine's plain kernels happen to be batch-invariant here")


def test_speculative_decode_at_the_toy_shape_batch_equals_alone(toy_shape_target):
    from ssd.drafters.layers import build_draft

    draft = build_draft(toy_shape_target, layers=[0, 1, -1])
    law = SamplingConfig(temperature=1.0, top_k=25, top_p=0.8, stop_tokens=toy_shape_target.stop_tokens)
    rule, seeds, max_len = ToleranceRule(beta=0.4), [3, 1, 4, 1_000_003], [40, 25, 33, 40]

    def decode(rows):
        return speculative(toy_shape_target, None, _prompt(toy_shape_target, rows), law, rule, 3,
                           torch.tensor([max_len[r] for r in rows]), 0, RowRandom([seeds[r] for r in rows]),
                           drafter=draft)  # fmt: skip

    rows = list(range(len(TEXTS)))
    use_batch_invariant(toy_shape_target)
    use_batch_invariant(draft)
    batch = decode(rows)
    assert len({len(t) for t in batch.tokens}) > 1  # ragged outputs
    for r in rows:
        single = decode([r])
        assert batch.tokens[r] == single.tokens[0], f"row {r}"
        assert batch.rows[r] == single.rows[0], f"row {r}"
