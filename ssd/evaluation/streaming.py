"""Streaming synthesis in a timed decode (`eval.streaming=true`): the engine hands each round's verified tokens
(`ssd.decoding.observe.Streaming`) to a vocoder session (`ssd.contracts.StreamingVocoder`), and every audio chunk's
ready time is taken from the request's start. In this process the vocoder runs between LM rounds, sequentially;
a server would overlap the two, so these latencies are an upper bound for the same hardware (docs/algorithms.md
§4.2).

Per utterance (`stream_fields`):
  first_packet   request start -> the first chunk ready (s)
  chunk_ready    each chunk's ready time (s from the request's start); chunk_sec its audio (s)
  chunk_deadline when the listener needs it: the previous chunk's playback end (the first chunk: its ready time)
  chunk_stall    how late it is (0 when on time); a stall delays the rest of playback by as much
  stall_total, stall_count   their sum and the number of late chunks
  stream_rtf     the last chunk's ready time / the audio's duration
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ssd.audio.streaming import stream_vocode

STREAM_KEYS = ("first_packet", "chunk_ready", "chunk_sec", "chunk_deadline", "chunk_stall", "stall_total",
               "stall_count", "stream_rtf", "baseline_first_packet", "baseline_stall_total",
               "baseline_stall_count", "baseline_stream_rtf")  # fmt: skip


def check_streaming(vocoder: Any, perturb: Any) -> None:
    """eval.streaming=true needs a vocoder that streams, and tokens that reach it as the LM emits them."""
    if not callable(getattr(vocoder, "stream", None)):
        raise ValueError(
            f"eval.streaming=true but the vocoder {type(vocoder).__name__} has no stream(prompt) "
            "(ssd.contracts.StreamingVocoder): use vocoder=toy, cosyvoice2 or cosyvoice3, or eval.streaming=false"
        )
    if perturb is not None:
        raise ValueError("eval.streaming=true with perturb=: the stress test rewrites whole token sequences; stream "
                         "without perturb")  # fmt: skip


class StreamRecorder:
    """One streaming decode's audio side. `push` is the engine's sink (each round's verified tokens, batch 1):
    the target's codec ids of everything so far (`codec_tokens` must be prefix-stable, which the adapters' rules
    are: CosyVoice 3's silent-run filter looks back only) minus those already sent go to the session; `finish`
    after the decode. `elapsed()` is the request's clock (the engine's diagnostics left out)."""

    def __init__(self, session: Any, codec_tokens: Callable[[list[int]], list[int]], sample_rate: int,
                 elapsed: Callable[[], float]) -> None:  # fmt: skip
        self.session, self.codec_tokens, self.elapsed = session, codec_tokens, elapsed
        self.sample_rate = sample_rate
        self.tokens: list[int] = []
        self.sent: list[int] = []
        self.chunks: list[np.ndarray] = []
        self.ready: list[float] = []
        self.synthesis_time = 0.0  # seconds inside the session's calls

    def push(self, rows: list[list[int]]) -> None:
        if len(rows) != 1:
            raise ValueError(f"a streaming decode is timed at batch 1, got {len(rows)} rows")
        self.tokens.extend(rows[0])
        codes = list(self.codec_tokens(self.tokens))
        if codes[: len(self.sent)] != self.sent:
            raise RuntimeError(
                "the target's codec_tokens changed ids it had already given for an earlier prefix: a streaming "
                "vocoder cannot take them back (make codec_tokens depend on earlier tokens only)"
            )
        new, self.sent = codes[len(self.sent) :], codes
        if new:
            self._collect(lambda: self.session.push(np.asarray(new, dtype=np.int64)))

    def finish(self) -> None:
        self._collect(self.session.finish)

    def _collect(self, call: Callable[[], list[np.ndarray]]) -> None:
        start = time.perf_counter()
        chunks = call()
        self.synthesis_time += time.perf_counter() - start
        now = self.elapsed()  # the call returned numpy: its audio is on the host
        for chunk in chunks:
            if chunk.size:
                self.chunks.append(np.asarray(chunk, dtype=np.float32))
                self.ready.append(now)

    def wav(self) -> np.ndarray:
        return np.concatenate(self.chunks) if self.chunks else np.zeros(0, np.float32)

    def fields(self) -> dict:
        return stream_fields(self.ready, [c.size / self.sample_rate for c in self.chunks])


def playback(ready: Sequence[float], seconds: Sequence[float]) -> tuple[list[float], list[float]]:
    """(deadline, stall) per chunk for a listener who starts playing the first chunk when it is ready, plays
    chunks back to back, and waits for a chunk that is not ready when the previous one ends."""
    deadlines, stalls, end = [], [], None
    for r, d in zip(ready, seconds):
        deadline = r if end is None else end
        stall = max(0.0, r - deadline)
        deadlines.append(deadline)
        stalls.append(stall)
        end = deadline + stall + d
    return deadlines, stalls


def stream_fields(ready: Sequence[float], seconds: Sequence[float]) -> dict:
    """A record's streaming fields (module docstring) from its chunks' ready times and durations."""
    if not ready:
        return dict.fromkeys(STREAM_KEYS[:8])
    deadlines, stalls = playback(ready, seconds)
    audio = float(sum(seconds))
    return {
        "first_packet": float(ready[0]), "chunk_ready": [float(r) for r in ready],
        "chunk_sec": [float(s) for s in seconds], "chunk_deadline": deadlines, "chunk_stall": stalls,
        "stall_total": float(sum(stalls)), "stall_count": sum(s > 0 for s in stalls),
        "stream_rtf": float(ready[-1]) / audio if audio else None,
    }  # fmt: skip


def baseline_fields(fields: dict | None) -> dict:
    """The paired baseline's streaming fields, as `baseline_<key>`."""
    keys = ("first_packet", "stall_total", "stall_count", "stream_rtf")
    return {f"baseline_{k}": (fields or {}).get(k) for k in keys}


def streamed_wav(vocoder: Any, codes: Sequence[int], prompt: Any) -> tuple[np.ndarray, float]:
    """The streamed waveform of `codes` (the chunks any split of them gives), and the seconds it took."""
    start = time.perf_counter()
    chunks = stream_vocode(vocoder, np.asarray(codes, dtype=np.int64), prompt) if len(codes) else []
    wav = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
    return wav.astype(np.float32, copy=False), time.perf_counter() - start
