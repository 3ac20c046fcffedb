"""The one interface the decoding engine depends on.

Targets and drafts alike are `SpeechLM`s. The engine never looks inside a prompt
or a cache: a model adapter owns its input layout (CosyVoice 2: sos, text,
task_id, prompt speech tokens) and its cache (static KV buffers with per-row
lengths). Everything is batch-first and every row keeps its own length, so rows
can accept different numbers of draft tokens in the same round.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class SpeechLM(Protocol):
    """A causal LM over speech tokens, driven token by token."""

    vocab_size: int  # size of the speech head (logits' last dimension)

    def prefill(self, prompt: Any, max_new_tokens: int) -> tuple[Any, torch.Tensor]:
        """Encode a batch of prompts into a fresh cache with room for `max_new_tokens` more.

        Returns (cache, logits [B, V] float32 at the last prompt position).
        """
        ...

    def extend(self, cache: Any, tokens: torch.Tensor) -> torch.Tensor:
        """Append speech tokens [B, k] (one block per row) to the cache.

        Returns float32 logits [B, k, V]: logits[:, j] predicts the token after tokens[:, j].
        """
        ...

    def rollback(self, cache: Any, n: torch.Tensor | int) -> None:
        """Forget the last n tokens of each row (n: int or LongTensor [B])."""
        ...
