"""LLaSA (LLaMA + X-codec2 tokens) behind the engine's SpeechLM interface.

A LLaSA dir is an HF LLaMA causal LM: config.json, model.safetensors (or shards with
model.safetensors.index.json; keys `model.embed_tokens.weight`, `model.layers.{i}...`,
`model.norm.weight`, `lm_head.weight` unless tied) and a tokenizer whose vocabulary is the LLaMA
text vocabulary, then 8 special tokens (<|TEXT_GENERATION_START|> ... <|SPEECH_UNDERSTANDING_END|>),
then the speech tokens <|s_0|> ... <|s_65535|>. The speech-token offset and the end token are read
from the tokenizer, never assumed.

Prompt (as LLaSA's inference code): the chat template applied to
  user: "Convert the text to speech:<|TEXT_UNDERSTANDING_START|>{prompt_text}{joiner}{text}<|TEXT_UNDERSTANDING_END|>"
  assistant: "<|SPEECH_GENERATION_START|>" + prompt speech tokens
with continue_final_message, so generation continues the assistant turn (joiner: `prompt_joiner`, " " as
the authors' Spaces demo, "" as the model card's example).

SpeechLM head (`head`): ids 0..n-1 are the X-codec2 codes <|s_0|>..<|s_{n-1}|>, id n is EOS
(<|SPEECH_GENERATION_END|>), so codes, EOS and training targets read the same under both options.
  "full" (upstream's law): ids n+1.. are every other LLaMA vocabulary id (text and special tokens) in
         ascending order; the law can emit a text token, which stays in the context and is dropped
         before the codec (codec_tokens), as upstream's generate + extract_speech_ids do.
  "speech": the head is those n + 1 entries only: the model's law conditioned on speech or the end.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ssd.files import read_safetensors
from ssd.models.backbone_config import BackboneConfig
from ssd.models.base import (
    CachedSpeechLM,
    check_state_dict,
    pad_right,
    prompt_rows,
    require_model_dir,
    resolve_dtype,
)
from ssd.models.text_tokenizer import load_text_tokenizer
from ssd.models.transformer import Backbone, Linear, linear

SPECIAL_TOKENS = (
    "<|TEXT_GENERATION_START|>", "<|TEXT_GENERATION_END|>", "<|TEXT_UNDERSTANDING_START|>",
    "<|TEXT_UNDERSTANDING_END|>", "<|SPEECH_GENERATION_START|>", "<|SPEECH_GENERATION_END|>",
    "<|SPEECH_UNDERSTANDING_START|>", "<|SPEECH_UNDERSTANDING_END|>",
)  # fmt: skip
SPEECH_END = "<|SPEECH_GENERATION_END|>"
HEADS = ("full", "speech")
TRAINED_MAX_LENGTH = 2048  # LLaSA was trained with sequences of at most 2048 tokens


def speech_token(code: int) -> str:
    return f"<|s_{code}|>"


@dataclass
class LlasaPrompt:
    """A batch of prompts: per-row token ids (chat-formatted text ++ prompt speech tokens, global ids)."""

    input_ids: list[torch.Tensor]

    def __post_init__(self) -> None:
        self.input_ids = [torch.as_tensor(t, dtype=torch.long).reshape(-1) for t in self.input_ids]
        if not self.input_ids or any(t.numel() == 0 for t in self.input_ids):
            raise ValueError("LlasaPrompt needs at least one row, each with at least one token")

    @property
    def batch_size(self) -> int:
        return len(self.input_ids)


class LlasaLM(CachedSpeechLM):
    def __init__(
        self,
        backbone_config: BackboneConfig,
        speech_offset: int,
        num_speech_tokens: int,
        speech_end_id: int,
        tokenizer: Any = None,
        max_length: int = TRAINED_MAX_LENGTH,
        head: str = "full",
        prompt_joiner: str = " ",
    ) -> None:
        super().__init__()
        if speech_offset + num_speech_tokens > backbone_config.vocab_size:
            raise ValueError(
                f"speech tokens [{speech_offset}, {speech_offset + num_speech_tokens}) exceed the vocabulary "
                f"({backbone_config.vocab_size})"
            )
        if head not in HEADS:
            raise ValueError(f"target.model.head must be one of {HEADS} (docs/target-llasa.md), got {head!r}")
        self.backbone = Backbone(backbone_config)
        # Always a module; when the checkpoint ties it, it holds the embedding's own tensor.
        self.lm_head = Linear(backbone_config.hidden_size, backbone_config.vocab_size, bias=False)
        self.speech_offset = speech_offset
        self.num_speech_tokens = num_speech_tokens
        self.speech_end_id = speech_end_id
        self.head = head
        self.prompt_joiner = prompt_joiner
        # Contiguous LLaMA-id ranges in head order: codes, end, then (full head) the rest ascending.
        self._head_ranges = _head_ranges(backbone_config.vocab_size, speech_offset, num_speech_tokens, speech_end_id,
                                         head)  # fmt: skip
        # Id maps as buffers (they follow .to(device); a per-device dict filled lazily would make a compiled
        # step recompile once it is filled). Built on the CPU explicitly: from_dir constructs on "meta".
        to_global = torch.cat([torch.arange(a, b, device="cpu") for a, b in self._head_ranges])
        to_head = torch.full((backbone_config.vocab_size,), -1, dtype=torch.long, device="cpu")
        to_head[to_global] = torch.arange(len(to_global), device="cpu")
        self.register_buffer("head_to_global", to_global, persistent=False)
        self.register_buffer("global_to_head", to_head, persistent=False)
        self.vocab_size = sum(end - start for start, end in self._head_ranges)
        self.speech_token_size = num_speech_tokens
        self.eos_token = num_speech_tokens
        self.stop_tokens = (num_speech_tokens,)
        self.tokenizer = tokenizer
        self.max_length = max_length
        self._template_split: tuple[torch.Tensor, torch.Tensor] | None = (
            None  # prefix_embeds' template pieces
        )

    # --- checkpoint format ---------------------------------------------------------------------
    @classmethod
    def from_dir(
        cls,
        model_dir: str | Path | None,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "cpu",
        num_speech_tokens: int | None = None,
        head: str = "full",
        prompt_joiner: str = " ",
    ) -> LlasaLM:
        """Load an HF LLaSA dir. num_speech_tokens defaults to vocab_size - offset of <|s_0|>; head and
        prompt_joiner as the class docstring says."""
        from transformers import AutoConfig

        model_dir = require_model_dir(
            model_dir, "LLaSA", "/path/to/Llasa-1B", "LLASA_DIR", ("config.json",),
            "a LLaSA dir is a Hugging Face LLaMA dir (config.json, safetensors, tokenizer files)",
        )  # fmt: skip
        hf_config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
        if hf_config.model_type != "llama":
            raise ValueError(
                f"{model_dir / 'config.json'}: model_type {hf_config.model_type!r}, LLaSA needs 'llama'"
            )
        config = BackboneConfig.from_hf(hf_config)
        tokenizer = load_text_tokenizer(model_dir)
        offset, end_id = (
            _token_id(tokenizer, speech_token(0), model_dir),
            _token_id(tokenizer, SPEECH_END, model_dir),
        )
        n = num_speech_tokens if num_speech_tokens is not None else config.vocab_size - offset
        if _token_id(tokenizer, speech_token(n - 1), model_dir) != offset + n - 1:
            raise ValueError(
                f"{model_dir}: speech tokens <|s_0|>..<|s_{n - 1}|> are not consecutive ids from {offset}"
            )
        state, source = _read_safetensors(model_dir)
        _check_keys(state, config, source)
        mapped = {
            ("backbone." + k.removeprefix("model.")) if k.startswith("model.") else k: v
            for k, v in state.items()
        }
        mapped.setdefault("lm_head.weight", mapped["backbone.embed_tokens.weight"])  # tied
        with torch.device("meta"):
            model = cls(
                config, offset, n, end_id, tokenizer=tokenizer, head=head, prompt_joiner=prompt_joiner
            )
        model.load_state_dict(mapped, strict=True, assign=True)
        model.backbone.init_rope()
        return model.to(device=device, dtype=resolve_dtype(dtype)).eval()

    # --- prompts -------------------------------------------------------------------------------
    def make_prompt(
        self,
        texts: Sequence[str],
        prompt_texts: Sequence[str] | None = None,
        prompt_speech_tokens: Sequence[Sequence[int]] | None = None,
    ) -> LlasaPrompt:
        prompt_texts, prompt_speech_tokens = prompt_rows(texts, prompt_texts, prompt_speech_tokens)
        rows = []
        for text, prompt_text, speech in zip(texts, prompt_texts, prompt_speech_tokens):
            ids = self._chat_ids(f"{prompt_text}{self.prompt_joiner}{text}" if prompt_text else text)
            speech = torch.as_tensor(list(speech), dtype=torch.long)
            self._check_speech_ids(speech, "prompt speech tokens")
            if speech.numel() and int(speech.max()) >= self.num_speech_tokens:
                raise ValueError("prompt speech tokens must be codes, not EOS")
            rows.append(torch.cat([torch.as_tensor(ids, dtype=torch.long), speech + self.speech_offset]))
        return LlasaPrompt(rows)

    def _chat_ids(self, text: str) -> list[int]:
        """The chat-formatted prompt of `text`, up to and including <|SPEECH_GENERATION_START|>."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                "LLaSA prompts need the tokenizer's chat template (tokenizer_config.json chat_template)"
            )
        chat = [
            {
                "role": "user",
                "content": f"Convert the text to speech:{SPECIAL_TOKENS[2]}{text}{SPECIAL_TOKENS[3]}",
            },
            {"role": "assistant", "content": SPECIAL_TOKENS[4]},
        ]
        ids = self.tokenizer.apply_chat_template(chat, tokenize=True, continue_final_message=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids)

    def length_limits(self, prompt: LlasaPrompt) -> tuple[torch.Tensor, torch.Tensor]:
        """(min_len [B] = 0, max_len [B] = 2048 - prompt length): LLaSA's trained context."""
        lengths = torch.tensor([t.numel() for t in prompt.input_ids])
        return self.min_speech_tokens(lengths), (self.max_length - lengths).clamp(min=0)

    def min_speech_tokens(self, text_lens: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(text_lens)  # LLaSA has no minimum length

    # --- training ------------------------------------------------------------------------------
    def prefix_embeds(self, text_ids: torch.Tensor) -> torch.Tensor:
        """The chat-formatted prompt around `text_ids` (the text tokens of a shard row). The template is
        split at <|TEXT_UNDERSTANDING_START|> once: special tokens bound the text, so its ids are the
        text's own tokenization, as in the authors' training rows."""
        if self._template_split is None:
            empty = self._chat_ids("")
            start = empty.index(self.tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS[2])) + 1
            self._template_split = (torch.tensor(empty[:start]), torch.tensor(empty[start:]))
        before, after = (t.to(text_ids.device) for t in self._template_split)
        return self.backbone.embed_tokens(torch.cat([before, text_ids, after]))

    # --- SpeechLM pieces -----------------------------------------------------------------------
    def embed_prompt(self, prompt: LlasaPrompt) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(prompt, LlasaPrompt):
            raise TypeError(f"LlasaLM needs a LlasaPrompt, got {type(prompt).__name__}")
        return pad_right([self.backbone.embed_tokens(ids.to(self.device)) for ids in prompt.input_ids])

    def _maps(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(head id -> LLaMA id [V], LLaMA id -> head id or -1 [vocabulary]) on `device`."""
        return self.head_to_global.to(device), self.global_to_head.to(device)

    def to_global_ids(self, tokens: torch.Tensor) -> torch.Tensor:
        """Head ids -> LLaMA vocabulary ids (EOS -> <|SPEECH_GENERATION_END|>)."""
        return self._maps(tokens.device)[0][tokens]

    def context_ids(self, prompt: LlasaPrompt) -> list[torch.Tensor]:
        """Each row's prompt ids in head space (ids outside the head dropped): the context a whole-context
        law (sampling.repetition_penalty) penalises besides the generated tokens."""
        rows = []
        for ids in prompt.input_ids:
            head_ids = self._maps(ids.device)[1][ids]
            rows.append(head_ids[head_ids >= 0])
        return rows

    def codec_tokens(self, tokens: list[int]) -> list[int]:
        """Generated head ids -> X-codec2 codes: text tokens the full head emitted are dropped (as upstream's
        extract_speech_ids skips every token that is not <|s_N|>); <|s_N|> is head id N already."""
        return [t for t in tokens if 0 <= t < self.num_speech_tokens]

    def embed_speech(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.backbone.embed_tokens(self.to_global_ids(tokens))

    def speech_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # One matmul per contiguous range of head rows (views: no copy of the 65k+-row head).
        weight = self.lm_head.weight
        per_row = self.lm_head.batch_invariant
        return torch.cat([linear(hidden, weight[a:b], per_row=per_row) for a, b in self._head_ranges], dim=-1)

    # --- drafts --------------------------------------------------------------------------------
    def module_groups(self) -> dict[str, nn.Module]:
        groups: dict[str, nn.Module] = {"text_embedding": self.backbone.embed_tokens}
        groups.update({f"layers.{i}": layer for i, layer in enumerate(self.backbone.layers)})
        groups["norm"] = self.backbone.norm
        groups["head"] = self.lm_head
        return groups

    def draft_skeleton(self, num_layers: int) -> LlasaLM:
        with torch.device("meta"):
            return type(self)(
                self.backbone.config.with_layers(num_layers), self.speech_offset, self.num_speech_tokens,
                self.speech_end_id, self.tokenizer, self.max_length, self.head, self.prompt_joiner,
            )  # fmt: skip


def _head_ranges(vocab: int, offset: int, n: int, end_id: int, head: str) -> list[tuple[int, int]]:
    """The head's LLaMA ids as contiguous [start, end) ranges, in head order."""
    if offset <= end_id < offset + n:
        raise ValueError(
            f"<|SPEECH_GENERATION_END|> (id {end_id}) lies among the speech tokens [{offset}, {offset + n})"
        )
    ranges = [(offset, offset + n), (end_id, end_id + 1)]
    if head == "full":
        cuts = sorted({0, vocab, offset, offset + n, end_id, end_id + 1})
        ranges += [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a and (a, b) not in ranges]
    return ranges


def _token_id(tokenizer: Any, token: str, model_dir: Path) -> int:
    token_id = tokenizer.convert_tokens_to_ids(token)
    if token_id is None or token_id == tokenizer.unk_token_id:
        raise ValueError(f"{model_dir}: the tokenizer has no {token} token (not a LLaSA tokenizer?)")
    return int(token_id)


def _read_safetensors(model_dir: Path) -> tuple[dict[str, torch.Tensor], Path]:
    single, index = model_dir / "model.safetensors", model_dir / "model.safetensors.index.json"
    if single.is_file():
        return read_safetensors(single, "LLaSA weights file"), single
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        state: dict[str, torch.Tensor] = {}
        for shard in shards:
            state.update(read_safetensors(model_dir / shard, "LLaSA weights shard"))
        return state, index
    raise FileNotFoundError(f"{model_dir} has neither model.safetensors nor model.safetensors.index.json")


def _check_keys(state: dict[str, torch.Tensor], config: BackboneConfig, source: Path) -> None:
    with torch.device("meta"):
        expected = {"model." + k: tuple(v.shape) for k, v in Backbone(config).state_dict().items()}
    head = (config.vocab_size, config.hidden_size)
    if not config.tie_word_embeddings or "lm_head.weight" in state:
        expected["lm_head.weight"] = head
    check_state_dict(state, expected, source)
