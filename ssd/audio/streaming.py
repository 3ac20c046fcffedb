"""Chunked synthesis as CosyVoice 2 / 3 stream it (`ssd.contracts.StreamingVocoder`).

Upstream's streaming inference (`CosyVoice2Model.tts(stream=True)`, cosyvoice/cli/model.py; CosyVoice 3's model
class inherits it) runs token2wav whenever enough new tokens have arrived:

- a chunk is `token_hop_len` (25) new tokens, synthesised once `pre_lookahead_len` (3, the flow's) more tokens
  exist: the flow reads them as right context and drops their frames;
- the first chunk is longer by `ceil(P / hop) * hop - P` tokens (P: the prompt's speech tokens), so later chunk
  boundaries fall on multiples of the hop counted from the prompt's start, where the flow's chunk-causal attention
  has its boundaries (`prompt_token_pad`; in upstream's model.py since mid-2025: `align_prompt`);
- each call gets every token so far (the flow recomputes the prefix) and `token_offset`, the tokens already
  synthesised, whose frames it cuts; HiFT keeps a cache (the last 8 mel frames and their audio) and crossfades the
  first 8 frames' audio of the next chunk with the held-back tail under a Hamming window (`fade_in_out`);
- when the LM ends, one last call with `finalize` synthesises everything left, lookahead included.

`ChunkSchedule` is that schedule and `ChunkedStream` drives it; a vocoder supplies one call, `_synthesise(tokens so
far, token_offset, finalize)`. The CosyVoice vocoder's call is upstream's own token2wav with upstream's caches
(`ssd.audio.vocoder`); the toy vocoder's mirrors it (`ssd.toy_world.codec`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

TOKEN_HOP_LEN = 25  # CosyVoice2Model.token_hop_len ("must match training static_chunk_size")
PRE_LOOKAHEAD_LEN = 3  # the flow's pre_lookahead_len (cosyvoice2.yaml / cosyvoice3.yaml)


@dataclass(frozen=True)
class ChunkSchedule:
    """Which tokens each streaming token2wav call covers (upstream's `tts(stream=True)` loop)."""

    token_hop_len: int = TOKEN_HOP_LEN
    pre_lookahead_len: int = PRE_LOOKAHEAD_LEN
    align_prompt: bool = True  # the first hop grows by upstream's prompt_token_pad

    def __post_init__(self) -> None:
        if self.token_hop_len < 1 or self.pre_lookahead_len < 0:
            raise ValueError(
                f"chunk schedule: token_hop_len={self.token_hop_len} must be >= 1 and "
                f"pre_lookahead_len={self.pre_lookahead_len} >= 0"
            )

    def hop(self, token_offset: int, prompt_tokens: int) -> int:
        """New tokens the chunk starting at `token_offset` synthesises."""
        if token_offset or not self.align_prompt:
            return self.token_hop_len
        hop = self.token_hop_len
        return hop + math.ceil(prompt_tokens / hop) * hop - prompt_tokens

    def chunks(self, n_tokens: int, prompt_tokens: int) -> list[tuple[int, int, bool]]:
        """(tokens the call gets, token_offset, finalize) of every call for `n_tokens` generated tokens."""
        calls, offset = [], 0
        while n_tokens - offset >= (hop := self.hop(offset, prompt_tokens)) + self.pre_lookahead_len:
            calls.append((offset + hop + self.pre_lookahead_len, offset, False))
            offset += hop
        return [*calls, (n_tokens, offset, True)]


class ChunkedStream:
    """A `VocoderStream` that runs `schedule` over the tokens pushed so far. Subclasses implement `_synthesise`
    (and `_close`, to drop their caches)."""

    def __init__(self, schedule: ChunkSchedule, prompt_tokens: int) -> None:
        self.schedule, self.prompt_tokens = schedule, int(prompt_tokens)
        self.tokens: list[int] = []
        self.offset = 0
        self.finished = False

    def push(self, tokens: np.ndarray) -> list[np.ndarray]:
        if self.finished:
            raise RuntimeError("push after finish: a vocoder stream is one utterance")
        self.tokens.extend(int(t) for t in np.asarray(tokens).reshape(-1))
        out = []
        lookahead = self.schedule.pre_lookahead_len
        while (
            len(self.tokens) - self.offset
            >= (hop := self.schedule.hop(self.offset, self.prompt_tokens)) + lookahead
        ):
            end = self.offset + hop + lookahead
            out.append(self._synthesise(np.asarray(self.tokens[:end], np.int64), self.offset, False))
            self.offset += hop
        return out

    def finish(self) -> list[np.ndarray]:
        if self.finished:
            raise RuntimeError("finish called twice on one vocoder stream")
        self.finished = True
        try:
            if (
                not self.tokens
            ):  # nothing generated: nothing to say (upstream would call token2wav on no tokens)
                return []
            return [self._synthesise(np.asarray(self.tokens, np.int64), self.offset, True)]
        finally:
            self._close()

    def _synthesise(self, tokens: np.ndarray, token_offset: int, finalize: bool) -> np.ndarray:
        raise NotImplementedError

    def _close(self) -> None:
        """Drop the session's caches."""


def fade_in_out(fade_in: np.ndarray, fade_out: np.ndarray, window: np.ndarray) -> np.ndarray:
    """Upstream's crossfade (cosyvoice/utils/common.py): the first half-window of `fade_in` times the window's
    rising half, plus the last half-window of `fade_out` times its falling half."""
    overlap = window.shape[0] // 2
    out = np.array(fade_in, dtype=np.float32, copy=True)
    out[:overlap] = out[:overlap] * window[:overlap] + fade_out[-overlap:] * window[overlap:]
    return out


def stream_vocode(vocoder, tokens: np.ndarray, prompt) -> list[np.ndarray]:
    """The chunks a streaming session gives for `tokens` (all pushed at once: the same chunks as any split)."""
    session = vocoder.stream(prompt)
    return [*session.push(np.asarray(tokens, np.int64)), *session.finish()]
