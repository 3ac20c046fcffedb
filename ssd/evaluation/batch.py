"""Decoding and judging one batch of test items (`evaluate_batch`), with LM-RTF timed at batch 1 and each
timed item paired with the baseline's decode of it (docs/algorithms.md §4.1); the runner
(`ssd.evaluation.runner`) calls it batch by batch."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import numpy as np
import torch

from ssd.decoding.generate import Request
from ssd.decoding.observe import Instruments, Streaming
from ssd.decoding.rng import RowRandom
from ssd.evaluation.items import Item
from ssd.evaluation.judging import judge
from ssd.evaluation.models import EvalModels
from ssd.evaluation.settings import RunSettings
from ssd.evaluation.streaming import STREAM_KEYS, StreamRecorder, baseline_fields, streamed_wav

WARMUP_TOKENS = 16
WARMUP_STREAM_TOKENS = 80  # a few chunks (25-token hops) for the warm-up of streamed synthesis

# A record's batch-1 timing (None for an item of a batch that was not timed alone).
LATENCY_KEYS = ("lm_time", "rtf", "time_prefill", "time_draft", "time_verify", "time_accept", "time_diagnostics",
                "e2e_rtf", "baseline_lm_time", "speedup")  # fmt: skip
# Record fields that depend on how the item was timed; every other field is the same at any batch size.
TIMING_KEYS = (*LATENCY_KEYS, "vocoder_time", "decode_time_share", *STREAM_KEYS)


# --------------------------------------------------------------------------------------------------
# Decoding a batch of items
# --------------------------------------------------------------------------------------------------


def lm_prompt(m: EvalModels, items: list[Item]) -> Any:
    """The target's prompt batch for `items`, from the prompt tokens as the vocoder prepared them (so the LM
    and the vocoder condition on the same prompt tokens)."""
    return m.target.make_prompt([it.pair.text for it in items], [it.pair.prompt_text for it in items],
                                [it.vprompt.tokens.tolist() for it in items])  # fmt: skip


def decode_items(settings: RunSettings, m: EvalModels, items: list[Item], max_tokens: int | None = None,
                 decoder: Any = None, observer: Instruments | None = None):  # fmt: skip
    """Decode `items` as one batch (ragged prompts, per-row seeds and length limits) with the run's decoder (or
    `decoder`), instrumented (by `observer`, default `Instruments()`); returns (result, min_len [B], max_len
    [B]). `max_tokens` caps the length (the warm-up's short decode)."""
    prompt = lm_prompt(m, items)
    min_len, max_len = (torch.as_tensor(t, dtype=torch.long).cpu() for t in m.target.length_limits(prompt))
    cap = settings.eval.max_len if max_tokens is None else max_tokens
    if cap is not None:
        max_len = max_len.clamp(max=int(cap))
        min_len = torch.minimum(min_len, max_len)
    request = Request(prompt, max_len, min_len, RowRandom([it.seed for it in items], m.target.device))
    result = (decoder or m.decoder).decode(m.target, request, m.sampling, observer or Instruments())
    return result, min_len.tolist(), max_len.tolist()


def batch_invariant_numerics(settings: RunSettings, m: EvalModels) -> bool:
    """eval.batch_invariant, where null means: on for an eager CPU target (where the per-sequence products
    cost little and make batch B equal batch 1 bit for bit), off on CUDA (where they would cost the batching)
    and on the compiled static path (whose attention is masked over the whole cache)."""
    wanted = settings.eval.batch_invariant
    if wanted is None:
        return m.target.device.type == "cpu" and not getattr(settings.decoder, "compile", False)
    return bool(wanted)


class Timed(NamedTuple):
    """A timed decode: its result, (min_len, max_len) per row, LM seconds, and its streaming record (None when
    not streamed)."""

    result: Any
    limits: tuple[list[int], list[int]]
    seconds: float
    stream: StreamRecorder | None = None


def _timed_decode(settings: RunSettings, m: EvalModels, items: list[Item], decoder: Any = None) -> Timed:
    """`decode_items` under inference mode, wall-clock timed (CUDA-synchronised). With eval.streaming a decode of
    one item streams: the vocoder session (opened before the clock, as the prompt is built before it) gets each
    round's verified tokens, and the chunks' ready times run on the same clock; the LM seconds leave the
    synthesis out."""
    session = m.vocoder.stream(items[0].vprompt) if settings.eval.streaming and len(items) == 1 else None
    recorder, observer = None, None
    with torch.inference_mode():
        _sync(m.target.device)
        start = time.perf_counter()
        if (
            session is not None
        ):  # the request's clock leaves out the engine's diagnostics, as the LM time does
            recorder = StreamRecorder(session, m.target.codec_tokens, m.vocoder.sample_rate,
                                      lambda: time.perf_counter() - start - observer.seconds("diagnostics"))  # fmt: skip
            observer = Streaming(recorder.push)
        try:
            result, min_len, max_len = decode_items(settings, m, items, decoder=decoder, observer=observer)
        except FloatingPointError as err:
            raise FloatingPointError(f"utterance(s) {[it.pair.utt for it in items]}: {err}") from err
        _sync(m.target.device)
        # The engine's diagnostics (β_t overlaps, TV) are bookkeeping a deployment does not run; the chunks
        # synthesised between rounds are the vocoder's time.
        stats = result.stats
        seconds = time.perf_counter() - start - stats.time_diagnostics - stats.time_stream
        if recorder is not None:
            recorder.finish()  # the LM has ended: the rest of the audio, on the same clock
        return Timed(result, (min_len, max_len), seconds, recorder)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Timing:
    """Which items are timed at batch 1 (the first `timed_utts` of the test list), and the baseline's tokens
    (utt -> tokens, from baseline_dir) that the paired baseline decodes must reproduce."""

    timed_utts: float
    baseline_tokens: dict[str, list[int]]

    def timed(self, item: Item) -> bool:
        return item.index < self.timed_utts


def _baseline_decode(settings: RunSettings, m: EvalModels, item: Item, timing: Timing) -> Timed:
    """One timed batch-1 decode of `item` by the baseline decoder; its tokens must be the baseline run's."""
    timed = _timed_decode(settings, m, [item], m.baseline)
    result = timed.result
    expected = timing.baseline_tokens.get(item.pair.utt)
    if expected is not None and result.tokens[0] != expected:
        raise RuntimeError(
            f"utterance {item.pair.utt}: the baseline decoded beside this run gives other tokens than the "
            f"baseline run ({len(result.tokens[0])} vs {len(expected)} tokens): the two runs differ in more "
            "than their decoding setting (models, seeds, numerics); rerun the baseline (delete its run dir)"
        )
    return timed


def _paired(settings: RunSettings, m: EvalModels, item: Item, timing: Timing, decode: Callable[[], Timed]
            ) -> tuple[Timed, Timed | None]:  # fmt: skip
    """decode() and the baseline's timed decode of `item` (None without a baseline), decoded right before or
    after it: the order alternates with the item's index, so that neither side always runs first (after the
    previous item's judges)."""
    first = m.baseline is not None and item.index % 2 == 0
    before = _baseline_decode(settings, m, item, timing) if first else None
    own = decode()
    after = _baseline_decode(settings, m, item, timing) if m.baseline is not None and not first else None
    return own, before if first else after


def _stream_record(own: Timed, baseline: Timed | None) -> dict:
    """A timed item's streaming fields, and its paired baseline's."""
    return {**own.stream.fields(), **baseline_fields(baseline.stream.fields() if baseline else None)}


def _latency(record: dict, result, seconds: float, baseline_seconds: float | None) -> dict:
    """The batch-1 timing of one item: LM time, RTF, the engine's phase times, LM + vocoder (end to end), and
    the paired baseline's LM time."""
    stats, audio = result.stats, record["audio_sec"]
    return {
        "lm_time": seconds, "rtf": seconds / audio if audio else None,
        "time_prefill": stats.time_prefill, "time_draft": stats.time_draft,
        "time_verify": stats.time_verify, "time_accept": stats.time_accept,
        "time_diagnostics": stats.time_diagnostics,
        "e2e_rtf": (seconds + record["vocoder_time"]) / audio if audio else None,
        "baseline_lm_time": baseline_seconds,
        "speedup": baseline_seconds / seconds if baseline_seconds is not None and seconds else None,
    }  # fmt: skip


def evaluate_batch(settings: RunSettings, m: EvalModels, items: list[Item], timing: Timing):
    """Decode `items` at once, then vocode and judge each; returns [(record, waveform)] in item order.

    LM-RTF is batch-1 latency, measured on the timed items (`Timing`): a batch of one is its own timing; in
    a bigger batch they are decoded again alone, and their tokens must equal the batched ones. A run with a
    baseline decodes each timed item by the baseline too, right beside it (the speedup). Every record holds
    `decode_time_share` (the batched decode's time / its rows: the throughput numbers)."""
    streaming = settings.eval.streaming
    alone = len(items) == 1 and timing.timed(items[0])
    if alone:
        decoded, paired = _paired(settings, m, items[0], timing, lambda: _timed_decode(settings, m, items))
    else:
        decoded, paired = _timed_decode(settings, m, items), None
    result, (min_lens, max_lens), seconds = decoded.result, decoded.limits, decoded.seconds
    out = []
    for b, item in enumerate(items):
        tokens = result.tokens[b]
        # A streamed item is judged on the audio it streamed (its chunks, whatever split they were pushed in).
        audio = (decoded.stream.wav(), decoded.stream.synthesis_time) if decoded.stream else None
        record, wav = judge(m, item, tokens, result.finish_reason[b], result.rows[b], (min_lens[b], max_lens[b]),
                            streaming=streaming, audio=audio)  # fmt: skip
        record.update(dict.fromkeys(LATENCY_KEYS), decode_time_share=seconds / len(items))
        if streaming:
            record.update(dict.fromkeys(STREAM_KEYS))
        if alone:
            record.update(_latency(record, result, seconds, paired.seconds if paired else None))
            if streaming:
                record.update(_stream_record(decoded, paired))
        elif timing.timed(item):
            alone_decode, paired = _paired(
                settings, m, item, timing, lambda item=item: _timed_decode(settings, m, [item])
            )
            own, own_seconds = alone_decode.result, alone_decode.seconds
            if own.tokens[0] != tokens:
                fix = (
                    ""
                    if batch_invariant_numerics(settings, m)
                    else "eval.batch_invariant=true (per-sequence numerics) or "
                )
                raise RuntimeError(
                    f"utterance {item.pair.utt}: decoded alone it gives other tokens than in a batch of "
                    f"{len(items)} ({len(own.tokens[0])} vs {len(tokens)} tokens): the engine is not "
                    f"batch-invariant here; run with {fix}eval.batch_size=1"
                )
            record.update(_latency(record, own, own_seconds, paired.seconds if paired else None))
            if streaming:
                record.update(_stream_record(alone_decode, paired))
        out.append((record, wav))
    return out


def warm_up(settings: RunSettings, m: EvalModels, item: Item) -> None:
    """One short untimed decode by the run's decoder and by its baseline, so lazy initialisation and caches do
    not land in the first timing of either."""
    with torch.inference_mode():
        for decoder in (m.decoder, m.baseline):
            if decoder is not None:
                decode_items(settings, m, [replace(item, seed=0)], max_tokens=WARMUP_TOKENS, decoder=decoder)
    if settings.eval.streaming:  # the chunked synthesis path too: a few chunks of the prompt's own tokens
        prompt_codes = np.asarray(item.vprompt.tokens, dtype=np.int64)
        if prompt_codes.size:
            streamed_wav(m.vocoder, np.resize(prompt_codes, WARMUP_STREAM_TOKENS), item.vprompt)


def effective_batch_size(settings: RunSettings) -> tuple[int, str | None]:
    """(batch size the run decodes with, why it differs from eval.batch_size or None): a decoder whose rows
    would depend on each other (adaptive draft length shares one k across a batch) decodes one at a time."""
    wanted, limit = settings.eval.batch_size, settings.decoder.max_batch_size
    if limit is not None and wanted > limit:
        return limit, f"the decoder {settings.decoder!r} decodes at most {limit} row(s) at once"
    return wanted, None
