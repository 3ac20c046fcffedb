"""What CosyVoice 2 and LLaSA adapters share: the SpeechLM methods over a static-cache backbone.

A subclass says how a prompt becomes input embeddings, how speech tokens are embedded, how hidden
states become speech logits and what precedes the speech in a training row; prefill/extend/rollback
and teacher-forced `training_logits` live here once (`ssd.contracts.TTSTargetLM`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ssd.contracts import IGNORE_INDEX
from ssd.models.kv_cache import KVCache
from ssd.models.transformer import Backbone

RECOMPILE_LIMIT = 128  # step graphs per code object: batch sizes x block lengths x capacities, all models


class CachedSpeechLM(nn.Module):
    """Base of the speech LM adapters; speaks `ssd.contracts.TTSTargetLM`."""

    backbone: Backbone
    vocab_size: int
    speech_token_size: int
    eos_token: int
    stop_tokens: tuple[int, ...]
    _compiled_step: Callable[..., torch.Tensor] | None = None  # set by compile_decoding

    # --- what a subclass provides -------------------------------------------------------------
    def embed_prompt(self, prompt: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs_embeds [B, T, H] right-padded, lengths [B])."""
        raise NotImplementedError

    def embed_speech(self, tokens: torch.Tensor) -> torch.Tensor:
        """Speech-head ids [B, k] -> input embeddings [B, k, H]."""
        raise NotImplementedError

    def speech_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden states [..., H] -> logits over the speech head [..., V] (model dtype)."""
        raise NotImplementedError

    def prefix_embeds(self, text_ids: torch.Tensor) -> torch.Tensor:
        """Input embeddings [P, H] of what precedes the speech in a training row whose text is `text_ids`
        [T]; the output at its last position predicts the first speech token."""
        raise NotImplementedError

    def module_groups(self) -> dict[str, nn.Module]:
        """Named parts a draft recipe may mark trainable ("layers.0", "head", ...)."""
        raise NotImplementedError

    def draft_skeleton(self, num_layers: int) -> CachedSpeechLM:
        """The same class and sizes with num_layers layers, built on the meta device."""
        raise NotImplementedError

    # --- SpeechLM ------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(
        self, prompt: Any, max_new_tokens: int, taps: Sequence[int] = ()
    ) -> tuple[KVCache, torch.Tensor]:
        embeds, lengths = self.embed_prompt(prompt)
        cache = self.backbone.new_cache(embeds.shape[0], embeds.shape[1] + max_new_tokens, taps=taps)
        hidden = self.backbone.forward_cached(embeds, cache, num_new=lengths)
        cache.mark_prompt()
        last = hidden[torch.arange(hidden.shape[0], device=hidden.device), lengths - 1]
        return cache, self.speech_logits(last).float()

    @torch.no_grad()
    def extend(self, cache: KVCache, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.dim() != 2 or tokens.shape[0] != cache.lengths.shape[0]:
            raise ValueError(
                f"extend: tokens must be [B={cache.lengths.shape[0]}, k], got {tuple(tokens.shape)}"
            )
        tokens = tokens.to(self.device)
        if not cache.static:
            return self.speech_logits(self.backbone.forward_cached(self.embed_speech(tokens), cache)).float()
        self.backbone.check_static_cache(cache, tokens.shape[1])
        step = self._compiled_step or self._static_step_logits
        logits, features = step(tokens, cache.k, cache.v, cache.lengths, cache.taps)
        cache.advance(tokens.shape[1])
        if self._compiled_step is not None:  # CUDA graphs reuse their output memory at the next replay
            logits, features = logits.clone(), None if features is None else features.clone()
        cache.keep_features(features, tokens.shape[1])
        return logits

    def _static_step_logits(
        self,
        tokens: torch.Tensor,
        k_cache: list[torch.Tensor],
        v_cache: list[torch.Tensor],
        lengths: torch.Tensor,
        taps: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The static step from speech ids to (float32 logits, features at `taps`): what compile_decoding compiles."""
        hidden, features = self.backbone.static_forward(
            self.embed_speech(tokens), k_cache, v_cache, lengths, taps
        )
        return self.speech_logits(hidden).float(), features

    def compile_decoding(
        self,
        mode: str | None = "reduce-overhead",
        fullgraph: bool = True,
        backend: str | Callable[..., Any] = "inductor",
    ) -> CachedSpeechLM:
        """Switch to the static decode path and compile its step (embedding, layers, head) with
        torch.compile(dynamic=False): one graph per (batch size, block length, cache capacity); with
        mode="reduce-overhead" on CUDA each is replayed as a CUDA graph (docs/gpu.md). Prefill stays
        eager. Caches made before this call keep the eager path. Returns self."""
        options = {"mode": mode, "fullgraph": fullgraph, "backend": backend}
        if (
            getattr(self, "_compile_options", None) == options
        ):  # the runner calls it once per job on cached models
            return self
        self._compile_options = options
        self.backbone.static_step = True
        # Every compiled model shares the one code object of _static_step_logits, and dynamo's default
        # of 8 graphs per code object would be spent by a target's and a draft's block lengths alone.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        mode_option = {"mode": mode} if backend == "inductor" else {}
        self._compiled_step = torch.compile(
            self._static_step_logits, fullgraph=fullgraph, dynamic=False, backend=backend, **mode_option
        )
        return self

    def rollback(self, cache: KVCache, n: torch.Tensor | int | list[int]) -> None:
        cache.rollback(n)

    def codec_tokens(self, tokens: list[int]) -> list[int]:
        """Head ids -> codec ids: the same ids for a head whose first speech_token_size entries are the codec's."""
        return list(tokens)

    # --- training ------------------------------------------------------------------------------
    def training_logits(
        self,
        text_ids: torch.Tensor,
        text_lens: torch.Tensor,
        speech_tokens: torch.Tensor,
        speech_lens: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher forcing. Inputs right-padded: text_ids [B, Tt], speech_tokens [B, Ts].

        Returns (logits [B, T, V], targets [B, T]); row b's input is prefix_embeds(text) ++ speech and its
        target IGNORE_INDEX for every prefix position but the last, then speech ++ [EOS]; padding is ignored.
        """
        return self.teacher_forced(text_ids, text_lens, speech_tokens, speech_lens)[:2]

    def teacher_forced(
        self,
        text_ids: torch.Tensor,
        text_lens: torch.Tensor,
        speech_tokens: torch.Tensor,
        speech_lens: torch.Tensor,
        taps: Sequence[int] = (),
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`training_logits` plus the hidden states after `taps` layers [B, T, len(taps), H] (None without taps):
        what a drafter that reads the target's features trains on."""
        b = text_ids.shape[0]
        if not (text_lens.numel() == speech_tokens.shape[0] == speech_lens.numel() == b):
            raise ValueError(
                f"training_logits: batch sizes differ: text_ids {tuple(text_ids.shape)}, text_lens "
                f"{tuple(text_lens.shape)}, speech_tokens {tuple(speech_tokens.shape)}, speech_lens {tuple(speech_lens.shape)}"
            )
        device = self.device
        rows, targets = [], []
        for i in range(b):
            tl, sl = int(text_lens[i]), int(speech_lens[i])
            if tl > text_ids.shape[1] or sl > speech_tokens.shape[1]:
                raise ValueError(f"training_logits row {i}: length ({tl}, {sl}) exceeds the padded tensor")
            speech = speech_tokens[i, :sl].to(device)
            if speech.numel() and (int(speech.min()) < 0 or int(speech.max()) >= self.speech_token_size):
                raise ValueError(
                    f"training_logits row {i}: speech tokens must lie in [0, {self.speech_token_size})"
                )
            prefix = self.prefix_embeds(text_ids[i, :tl].to(device))
            rows.append(torch.cat([prefix, self.embed_speech(speech)]))
            ignore = torch.full((prefix.shape[0] - 1,), IGNORE_INDEX, dtype=torch.long, device=device)
            eos = torch.tensor([self.eos_token], device=device)
            targets.append(torch.cat([ignore, speech, eos]))
        embeds, lengths = pad_right(rows)
        target = nn.utils.rnn.pad_sequence(targets, batch_first=True, padding_value=IGNORE_INDEX)
        hidden, features = self.backbone.forward_features(embeds, lengths, tuple(taps))
        return self.speech_logits(hidden), target, features

    # --- helpers -------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.backbone.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.backbone.norm.weight.dtype

    def _check_speech_ids(self, tokens: torch.Tensor, what: str) -> None:
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab_size):
            raise ValueError(
                f"{what}: speech token ids must lie in [0, {self.vocab_size}), "
                f"got range [{int(tokens.min())}, {int(tokens.max())}]"
            )


def prompt_rows(
    texts: Sequence[str],
    prompt_texts: Sequence[str] | None,
    prompt_speech_tokens: Sequence[Sequence[int]] | None,
) -> tuple[list[str], list[Sequence[int]]]:
    """make_prompt's per-row prompt texts and prompt speech tokens ("" and [] when not given), checked
    to have one entry per text."""
    n = len(texts)
    prompt_texts = [""] * n if prompt_texts is None else list(prompt_texts)
    prompt_speech_tokens = [[]] * n if prompt_speech_tokens is None else list(prompt_speech_tokens)
    if len(prompt_texts) != n or len(prompt_speech_tokens) != n:
        raise ValueError(
            f"make_prompt: {n} texts but {len(prompt_texts)} prompt_texts and "
            f"{len(prompt_speech_tokens)} prompt_speech_tokens"
        )
    return prompt_texts, prompt_speech_tokens


def check_state_dict(
    state: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]], source: Path
) -> None:
    """One error naming the file and every missing / unexpected / mis-shaped key of a checkpoint."""
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    mismatched = [
        f"{k}: file {tuple(state[k].shape)} vs config {expected[k]}"
        for k in expected
        if k in state and tuple(state[k].shape) != expected[k]
    ]
    problems = []
    for label, items in (
        ("missing keys", missing),
        ("unexpected keys", unexpected),
        ("shape mismatches", mismatched),
    ):
        if items:
            shown = ", ".join(items[:8]) + (f", ... ({len(items)} in all)" if len(items) > 8 else "")
            problems.append(f"{label}: {shown}")
    if problems:
        raise ValueError(f"{source} does not match its config: " + "; ".join(problems))


def pad_right(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack [T_i, H] tensors into [B, max T, H] (zeros after each row) and their lengths [B]."""
    lengths = torch.tensor([r.shape[0] for r in rows], dtype=torch.long, device=rows[0].device)
    return nn.utils.rnn.pad_sequence(rows, batch_first=True), lengths


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if dtype not in names:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(names)}")
    return names[dtype]


def require_model_dir(
    model_dir: str | Path | None, model: str, example: str, env_var: str, files: Sequence[str], layout: str
) -> Path:
    """`model_dir` as a Path once it is set and holds `files`; the errors name the key or file to fix."""
    if model_dir is None or str(model_dir) in ("", "None", "???"):
        raise ValueError(
            f"{model} model_dir is not set: set target.model.model_dir={example} "
            f"(or set the {env_var} environment variable for target={model.lower().replace(' ', '')})"
        )
    model_dir = Path(model_dir)
    for path in (model_dir, *(model_dir / name for name in files)):
        if not path.exists():
            raise FileNotFoundError(f"{path} does not exist: {layout}")
    return model_dir
