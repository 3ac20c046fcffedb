"""Streaming: the engine hands a vocoder verified tokens only, round by round, without another host sync; the
chunk schedule is CosyVoice's (25 + 3 lookahead, the first chunk aligned to the prompt); the toy vocoder's
streamed audio matches its one-shot audio within a stated tolerance; the playback arithmetic (deadlines, stalls).

The CosyVoice vocoder's streaming against the checkout's own tts(stream=True) is in tests/test_cosyvoice_pipeline.py;
the runner's streaming fields and table in tests/test_runner.py."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from engine_models import TrigramLM, autoregressive, speculative, trigram_pair

from ssd.decoding.acceptance import ExactRule, ToleranceRule
from ssd.decoding.observe import Instruments, Observer, Streaming
from ssd.decoding.pcg import PCGRule
from ssd.decoding.rng import RowRandom
from ssd.decoding.sampling import SamplingConfig

VOCAB, EOS = 8, 7
LAW = SamplingConfig(top_k=5, ras_window=4, ras_tau=0.5, stop_tokens=(EOS,))
PROMPT = torch.tensor([[1, 3, 2, 5, 0], [4, 4, 1, 0, 2]])
SEEDS = [11, 12345]
RULES = {
    "exact": ExactRule,
    "tolerance": lambda: ToleranceRule(beta=0.4),
    "pcg": lambda: PCGRule(
        theta=0.2, vectors=torch.randn(VOCAB, 3, generator=torch.Generator().manual_seed(1))
    ),
}


class Collect(Streaming):
    """Streaming instruments whose sink keeps what it was handed, round by round."""

    def __init__(self):
        super().__init__(self.keep)
        self.handed: list[list[list[int]]] = []

    def keep(self, tokens):
        self.handed.append([list(row) for row in tokens])


def _streamed(rounds, batch):
    return [[t for r in rounds for t in r[b]] for b in range(batch)]


@pytest.mark.parametrize("name", list(RULES))
def test_the_streamed_tokens_are_the_decodes_tokens_round_by_round(name):
    """Every row's handed-over tokens, concatenated, are its result's tokens (stop tokens excluded, max_len cut),
    at most L_d + 1 a round, and the decode is the one an unstreamed decode gives (same tokens, same stats)."""
    target, draft = trigram_pair(VOCAB, seed=5)
    observer = Collect()
    streamed = speculative(target, draft, PROMPT, LAW, RULES[name](), 3, 25, 3, RowRandom(SEEDS), observer)
    plain = speculative(target, draft, PROMPT, LAW, RULES[name](), 3, 25, 3, RowRandom(SEEDS))
    assert streamed.tokens == plain.tokens and streamed.rows == plain.rows
    assert _streamed(observer.handed, 2) == streamed.tokens
    assert all(len(row) <= 4 for r in observer.handed for row in r)
    assert streamed.stats.time_stream > 0 and plain.stats.time_stream == 0

    ar = Collect()
    result = autoregressive(target, PROMPT, LAW, 25, 3, RowRandom(SEEDS), ar)
    assert _streamed(ar.handed, 2) == result.tokens
    assert all(len(row) <= 1 for r in ar.handed for row in r)


def test_a_settled_round_hands_over_the_settled_token(monkeypatch):
    """PCG leaves a next token unsettled (-1) in some rounds and settles it after the sync: the streamed tokens
    are the settled ones (the sink never sees -1)."""
    settled = []
    original = PCGRule.settle

    def counting(self, next_token):
        settled.append(1)
        return original(self, next_token)

    monkeypatch.setattr(PCGRule, "settle", counting)
    target, draft = trigram_pair(VOCAB, seed=5, draft_noise=3.0)
    for seed in range(40):
        observer = Collect()
        vectors = torch.randn(VOCAB, 3, generator=torch.Generator().manual_seed(seed))
        rule = PCGRule(
            theta=0.5, vectors=vectors, thinning_trials=1
        )  # one trial: unsettled rounds are common
        result = speculative(
            target, draft, PROMPT, LAW, rule, 4, 25, 3, RowRandom([seed, seed + 1]), observer
        )
        assert _streamed(observer.handed, 2) == result.tokens
        assert all(t >= 0 for r in observer.handed for row in r for t in row)
        if settled:
            break
    assert settled, "no round left a token unsettled: the settle path was not exercised"


def test_streaming_adds_no_host_sync_per_round():
    """The round's tokens travel on the round's one sync: a streamed decode makes as many host reads as an
    unstreamed one (scripts/bench_decoding.py's counter)."""
    spec = importlib.util.spec_from_file_location(
        "bench_decoding", Path(__file__).parents[1] / "scripts" / "bench_decoding.py"
    )
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_decoding"] = bench
    spec.loader.exec_module(bench)
    target, draft = trigram_pair(VOCAB, seed=5)

    def count(observer):
        with bench.HostSyncCounter() as counter:
            speculative(target, draft, PROMPT, LAW, ExactRule(), 3, 25, 3, RowRandom(SEEDS), observer)
        return counter.total

    class Quiet(Streaming):  # the sink itself reads nothing from the device
        def __init__(self):
            super().__init__(lambda tokens: None, diagnostics=False)

    assert count(Quiet()) == count(Instruments(diagnostics=False))


# --- the vocoder never sees a token the rule did not keep ---------------------------------------------------


IMPOSSIBLE = VOCAB - 2  # the target gives this id probability 0 everywhere; the drafter proposes nothing else


def _target_without(token: int) -> TrigramLM:
    target, _ = trigram_pair(VOCAB, seed=7)
    table = target.table.clone()
    table[..., token] = -torch.inf
    return TrigramLM(table)


class ImpossibleDrafter:
    """Proposes IMPOSSIBLE at every position, with p = one-hot: the exact rule rejects every one of them."""

    vocab_size, taps = VOCAB, ()

    def start(self, prompt, first, features, room):
        return self

    def propose(self, k, draw):
        batch = self.batch
        tokens = torch.full((batch, k), IMPOSSIBLE)
        return tokens, torch.nn.functional.one_hot(tokens, VOCAB).float()

    def accept(self, kept, token, features):
        assert all(n == 0 for n in kept)


class RecordingVocoder:
    """A streaming vocoder that keeps every token pushed to it, with its position in the utterance."""

    def __init__(self):
        self.heard: list[int] = []

    def push(self, tokens):
        self.heard.extend(int(t) for t in tokens)
        return []

    def check_against(self, final: list[int]) -> None:
        """Every token heard is the final output's token at its position (and all of it was heard)."""
        for position, token in enumerate(self.heard):
            assert position < len(final) and final[position] == token, (
                f"the vocoder heard {token} at position {position}, the output has "
                f"{final[position] if position < len(final) else 'nothing'} there"
            )
        assert len(self.heard) == len(final)


def _rejecting_decode(observer):
    target, drafter = _target_without(IMPOSSIBLE), ImpossibleDrafter()
    drafter.batch = 1
    return speculative(
        target, None, PROMPT[:1], LAW, ExactRule(), 4, 40, 30, RowRandom([3]), observer, drafter
    )


def test_the_vocoder_never_hears_a_token_the_target_rejected():
    vocoder = RecordingVocoder()
    result = _rejecting_decode(Streaming(lambda rows: vocoder.push(rows[0])))
    (tokens,) = result.tokens
    assert len(tokens) > 10 and IMPOSSIBLE not in tokens  # every proposal was rejected
    assert sum(result.rows[0]["proposed"]) > 10 and sum(result.rows[0]["accepted"]) == 0
    vocoder.check_against(tokens)


def test_negative_control_a_hook_fed_the_proposals_fails_the_check():
    """The same check catches a hook that taps the round's proposals instead of its verified tokens."""

    class Leaky(Instruments):  # hands the vocoder the drafted block, as a hook before verification would
        def __init__(self, vocoder):
            super().__init__()
            self.vocoder = vocoder

        def round(self, k, xs, ps, qs, n_acc, active):
            super().round(k, xs, ps, qs, n_acc, active)
            self.vocoder.push(xs[0].tolist())

    vocoder = RecordingVocoder()
    result = _rejecting_decode(Leaky(vocoder))
    assert IMPOSSIBLE in vocoder.heard
    with pytest.raises(AssertionError, match="the vocoder heard"):
        vocoder.check_against(result.tokens[0])


def test_the_base_observer_streams_nothing():
    assert Observer.streams is False and Instruments.streams is False and Streaming.streams is True
