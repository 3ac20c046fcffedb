"""Streaming: the engine hands a vocoder verified tokens only, round by round, without another host sync; the
chunk schedule is CosyVoice's (25 + 3 lookahead, the first chunk aligned to the prompt); the toy vocoder's
streamed audio matches its one-shot audio within a stated tolerance; the playback arithmetic (deadlines, stalls).

The CosyVoice vocoder's streaming against the checkout's own tts(stream=True) is in tests/test_cosyvoice_pipeline.py;
the runner's streaming fields and table in tests/test_runner.py."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from engine_models import TrigramLM, autoregressive, speculative, trigram_pair

from ssd.audio.streaming import ChunkedStream, ChunkSchedule, stream_vocode
from ssd.contracts import StreamingVocoder, VocoderPrompt, VocoderStream
from ssd.decoding.acceptance import ExactRule, ToleranceRule
from ssd.decoding.observe import Instruments, Observer, Streaming
from ssd.decoding.pcg import PCGRule
from ssd.decoding.rng import RowRandom
from ssd.decoding.sampling import SamplingConfig
from ssd.evaluation.streaming import playback, stream_fields

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


# --- the chunk schedule ------------------------------------------------------------------------------------


def test_chunks_are_25_new_tokens_once_3_more_exist_the_first_aligned_to_the_prompt():
    """Upstream's tts(stream=True): a chunk is 25 tokens, synthesised when 3 more exist; the first grows by
    ceil(P / 25) * 25 - P; the last call gets every token with finalize."""
    schedule = ChunkSchedule()
    assert (schedule.token_hop_len, schedule.pre_lookahead_len) == (25, 3)
    # prompt of 59 tokens: pad 16, so the first chunk is 41 tokens and needs 44
    assert schedule.chunks(100, 59) == [(44, 0, False), (69, 41, False), (94, 66, False), (100, 91, True)]
    assert schedule.chunks(43, 59) == [(43, 0, True)]  # one token short of the first chunk: one final call
    assert schedule.chunks(100, 50) == [(28, 0, False), (53, 25, False), (78, 50, False), (100, 75, True)]
    unaligned = ChunkSchedule(align_prompt=False)
    assert unaligned.chunks(60, 59) == [(28, 0, False), (53, 25, False), (60, 50, True)]
    with pytest.raises(ValueError, match="token_hop_len"):
        ChunkSchedule(token_hop_len=0)


class CallLog(ChunkedStream):
    def __init__(self, schedule, prompt_tokens):
        super().__init__(schedule, prompt_tokens)
        self.calls = []

    def _synthesise(self, tokens, token_offset, finalize):
        self.calls.append((tokens.tolist(), token_offset, finalize))
        return np.full(len(tokens) - token_offset, float(token_offset), np.float32)


@pytest.mark.parametrize("split", [[100], [1] * 100, [4, 1, 3, 2] * 10 + [60], [44, 25, 25, 6]])
def test_a_stream_makes_the_same_calls_whatever_the_tokens_arrive_in(split):
    tokens = list(range(100))
    stream, at = CallLog(ChunkSchedule(), 59), 0
    for n in split:
        stream.push(np.array(tokens[at : at + n]))
        at += n
    stream.finish()
    expected = [(tokens[:end], offset, final) for end, offset, final in ChunkSchedule().chunks(100, 59)]
    assert stream.calls == expected
    with pytest.raises(RuntimeError, match="push after finish"):
        stream.push(np.array([1]))


def test_a_stream_of_nothing_says_nothing():
    stream = CallLog(ChunkSchedule(), 10)
    assert stream.push(np.zeros(0, np.int64)) == [] and stream.finish() == [] and stream.calls == []


# --- the toy vocoder streams -----------------------------------------------------------------------------


# Streamed vs one-shot audio of the same tokens: mean |log-mel difference| in dB (80 bands, 25 ms / 10 ms frames).
# Measured on the default toy world's codec: 0.3-0.55 dB on 6 test utterances (2-3 chunks each); another
# utterance's tokens in the same voice: 7-13 dB. Here on the micro world's codec (tests/fixtures_eval.py).
TOY_TOLERANCE_DB = 1.0


def _log_mel_db(wav: np.ndarray) -> torch.Tensor:
    from ssd.audio.features import mel_filterbank

    spec = torch.stft(torch.from_numpy(wav), 1024, 160, 640, window=torch.hann_window(640), center=True,
                      return_complex=True).abs()  # fmt: skip
    return 20 * torch.log10(torch.clamp(mel_filterbank(80, 16000, 1024, htk=True) @ spec, min=1e-5))


def log_mel_distance_db(a: np.ndarray, b: np.ndarray) -> float:
    x, y = _log_mel_db(a), _log_mel_db(b)
    n = min(x.shape[1], y.shape[1])
    return float((x[:, :n] - y[:, :n]).abs().mean())


@pytest.fixture(scope="module")
def toy_vocoder_and_utterances(micro_world):
    from ssd.audio.features import load_audio
    from ssd.toy_world.codec import ToyVocoder

    vocoder = ToyVocoder(micro_world.toy / "codec")
    wavs = sorted((micro_world.toy / "corpus").rglob("*.wav"))
    utterances = []
    for prompt_path, target_path in zip(wavs[0::2], wavs[1::2]):
        prompt_wav, sr = load_audio(prompt_path, None)
        target_wav, _ = load_audio(target_path, None)
        prompt = VocoderPrompt(prompt_wav, sr, "", vocoder.codec.encode(prompt_wav, sr))
        utterances.append((prompt, vocoder.codec.encode(target_wav, sr)))
    return vocoder, utterances


def test_the_toy_vocoder_speaks_the_streaming_contract(toy_vocoder_and_utterances):
    vocoder, ((prompt, _), *_) = toy_vocoder_and_utterances
    assert isinstance(vocoder, StreamingVocoder) and isinstance(vocoder.stream(prompt), VocoderStream)


def test_toy_streamed_audio_matches_the_one_shot_audio_within_tolerance(toy_vocoder_and_utterances):
    """Concatenated chunks: exactly the one-shot length, and within TOY_TOLERANCE_DB of its log-mel spectrum;
    the one-shot audio of other tokens (negative control) is far outside it."""
    vocoder, utterances = toy_vocoder_and_utterances
    checked = 0
    for i, (prompt, tokens) in enumerate(utterances):
        one_shot = vocoder.vocode(tokens, prompt)
        chunks = stream_vocode(vocoder, tokens, prompt)
        streamed = np.concatenate(chunks)
        assert streamed.shape == one_shot.shape == (len(tokens) * 640,)
        if len(chunks) < 2:
            continue
        checked += 1
        assert log_mel_distance_db(streamed, one_shot) < TOY_TOLERANCE_DB
        other = utterances[(i + 1) % len(utterances)][1]
        n = min(len(other), len(tokens))
        if not np.array_equal(other[:n], tokens[:n]):
            assert (
                log_mel_distance_db(vocoder.vocode(other[:n], prompt), one_shot[: n * 640])
                > 3 * TOY_TOLERANCE_DB
            )
    assert checked >= 2


def test_toy_chunks_follow_the_schedule_and_a_single_chunk_is_the_one_shot_audio(toy_vocoder_and_utterances):
    """Chunk k (k > 0) carries its 25 tokens' audio (the held-back 4 tokens of the cache move along): lengths are
    (first hop - 4) x 640, 25 x 640, ..., the rest; an utterance shorter than the first chunk comes in one final
    call, which is the one-shot vocode sample for sample."""
    vocoder, utterances = toy_vocoder_and_utterances
    prompt, tokens = max(utterances, key=lambda u: len(u[1]))
    tokens = np.resize(tokens, 110)
    chunks = stream_vocode(vocoder, tokens, prompt)
    first = ChunkSchedule().hop(0, len(prompt.tokens))
    held = vocoder.cache_frames * vocoder.codec.cfg.hop_length
    sizes = [c.size for c in chunks]
    assert sizes[0] == first * 640 - held and all(s == 25 * 640 for s in sizes[1:-1])
    assert sum(sizes) == 110 * 640
    short = tokens[: first + 2]
    (single,) = stream_vocode(vocoder, short, prompt)
    np.testing.assert_array_equal(single, vocoder.vocode(short, prompt))


# --- playback ------------------------------------------------------------------------------------------------


def test_playback_deadlines_and_stalls():
    """A listener starts at the first chunk and plays chunks back to back; a late chunk stalls playback by its
    lateness, which moves every later deadline."""
    ready, seconds = [0.5, 1.0, 3.0, 3.2], [1.0, 1.0, 0.5, 1.0]
    deadlines, stalls = playback(ready, seconds)
    assert deadlines == [0.5, 1.5, 2.5, 3.5] and stalls == [0.0, 0.0, 0.5, 0.0]
    fields = stream_fields(ready, seconds)
    assert fields["first_packet"] == 0.5 and fields["stall_total"] == 0.5 and fields["stall_count"] == 1
    assert fields["stream_rtf"] == pytest.approx(3.2 / 3.5)
    assert stream_fields([], [])["first_packet"] is None
