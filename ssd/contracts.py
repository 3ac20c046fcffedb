"""Every contract between the swappable parts, in one place.

- `SpeechLM`: what the decoding engine drives (targets and drafts alike).
- `TTSTargetLM`: what the evaluation runner and the trainer need from a target on top of that.
- `AcceptanceRule`: what the speculative loop asks of a rule, and what the runner asks to label a run.
- `SpeechTokenizer`, `Vocoder`, `ASR`, `SpeakerModel`, `MOSJudge`: the audio side of a run.

Each swappable part is a Hydra `_target_` node in `configs/` (a group per kind: target, draft,
acceptance, speech_tokenizer, vocoder, asr, sim, mos); a class of a user's own module plugs in with
`<group>._target_=my_module.MyClass` as long as it speaks the contract here. The classes shipped with
the project subclass nothing from this module: the contracts are structural (`typing.Protocol`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import torch

if TYPE_CHECKING:  # an annotation only: the contracts sit below the engine and import none of it
    from ssd.decoding.rng import RowRandom


@runtime_checkable
class SpeechLM(Protocol):
    """A causal LM over speech tokens, driven token by token (batch-first; every row keeps its own length).

    The engine never looks inside a prompt or a cache: the adapter owns its input layout (CosyVoice 2:
    sos, text, task_id, prompt speech tokens) and its cache (static KV buffers with per-row lengths),
    so rows can accept different numbers of draft tokens in the same round.

    Optional (not part of the runtime check): `context_ids(prompt) -> list[LongTensor]`, each row's prompt
    ids in head space (ids outside the head dropped). The engine asks for it only when the sampling law
    depends on the whole context (`SamplingConfig.whole_context`: the repetition penalty); LlasaLM has it.

    Optional: `compile_decoding(mode="reduce-overhead", fullgraph=True) -> self` switches the model to a
    static, graph-capturable decode step and compiles it (`ssd.models.base.CachedSpeechLM`, delegated by
    `ssd.models.draft.Draft`); the runner calls it on target and draft when `decoding.compile` is true.
    Caches prefilled after the call use the static step (docs/gpu.md).
    """

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

    def rollback(self, cache: Any, n: torch.Tensor | int | list[int]) -> None:
        """Forget the last n tokens of each row (n: int, ints [B] or LongTensor [B]; the decoding loops
        pass ints, read on their round's one host sync, so a cache sliced by host ints needs no other)."""
        ...


@runtime_checkable
class TTSTargetLM(SpeechLM, Protocol):
    """A text-to-speech target: a SpeechLM that also builds its prompts, knows its stop tokens and
    length rules, and can be trained and saved. Drafts built from it (`ssd.models.draft`) speak the
    same contract, so the trainer needs nothing else."""

    speech_token_size: int  # number of codec tokens (ids 0..speech_token_size-1); the head may add stop ids
    stop_tokens: tuple[int, ...]  # head ids that end a sequence; the sampling law's stop tokens are these
    device: torch.device

    def make_prompt(
        self,
        texts: list[str],
        prompt_texts: list[str] | None = None,
        prompt_speech_tokens: list[list[int]] | None = None,
    ) -> Any:
        """A batch of zero-shot prompts (normalised text, prompt text, the prompt audio's speech tokens)."""
        ...

    def length_limits(self, prompt: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(min_len [B], max_len [B]) of generated tokens for a prompt batch."""
        ...

    def min_speech_tokens(self, text_lens: torch.Tensor) -> torch.Tensor:
        """min_len [B] for target texts of `text_lens` tokens (the rule `length_limits` applies; the
        trainer uses it for the teacher-forced dev laws)."""
        ...

    def embed_speech(self, tokens: torch.Tensor) -> torch.Tensor:
        """Speech-head ids [...] -> input embeddings [..., H] (PCG's groups come from these)."""
        ...

    def training_logits(
        self,
        text_ids: torch.Tensor,
        text_lens: torch.Tensor,
        speech_tokens: torch.Tensor,
        speech_lens: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher forcing on right-padded batches: (logits [B, T, V], targets [B, T], IGNORE_INDEX where unscored)."""
        ...

    def save_dir(self, out_dir: str | Path) -> Path:
        """Write the model in its distributed format (a trained toy target; an exported full model)."""
        ...

    def codec_tokens(self, tokens: list[int]) -> list[int]:
        """Generated head ids (stop token excluded) -> the speech tokenizer's / vocoder's token ids.
        CosyVoice 2: the same ids; LLaSA: text tokens its law emitted are dropped and <|s_N|> becomes N."""
        ...


IGNORE_INDEX = -100  # targets of training_logits that carry no loss (torch's cross_entropy default)


@runtime_checkable
class AcceptanceRule(Protocol):
    """Decides, given draft laws p [B, k, V], target laws q [B, k+1, V] and draft tokens x [B, k], how many
    draft tokens stay and what the next token is (`ssd.decoding.acceptance` has the shipped rules)."""

    name: str
    preserves_target_law: bool  # the emitted token law equals q (its TV to q is 0 without computing it)
    deterministic: (
        bool  # the verdict draws no random numbers (greedy: equals greedy AR of q, not a sample of q)
    )

    def verify(
        self,
        p: torch.Tensor,
        q: torch.Tensor,
        x: torch.Tensor,
        generator: RowRandom | torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(n_accepted [B] in 0..k, next_token [B]). Random numbers come from the row streams
        (`RowRandom.of(generator, B, device)`), a count per row that does not depend on the data, so a row
        verifies the same in any batch."""
        ...

    def labels(self) -> dict[str, Any]:
        """The parameters that identify a run of this rule in tables ({"beta": 0.4}; {} for none)."""
        ...

    def bind(self, target: TTSTargetLM) -> AcceptanceRule:
        """Take what the rule needs from the target (PCG: its speech embeddings); returns the rule."""
        ...


@dataclass
class VocoderPrompt:
    """What a zero-shot vocoder may condition on: the prompt's audio, text and speech tokens."""

    wav: np.ndarray  # float32 mono
    sample_rate: int
    text: str
    tokens: np.ndarray  # int64 [T] in the target's speech-token ids


class SpeechTokenizer(Protocol):
    """Audio -> the target's speech tokens (the toy codec; CosyVoice 2's ONNX tokenizer)."""

    token_rate: int  # tokens per second of audio
    codebook_size: int | None  # number of distinct tokens (None: not known to the tokenizer)

    def encode(self, wav: np.ndarray, sr: int) -> np.ndarray: ...


class Vocoder(Protocol):
    """Speech tokens -> waveform at `sample_rate`, in the prompt's voice."""

    sample_rate: int

    def vocode(self, tokens: np.ndarray, prompt: VocoderPrompt) -> np.ndarray: ...

    def prepare_prompt(self, prompt: VocoderPrompt) -> VocoderPrompt:
        """The prompt as this vocoder conditions on it, computed once per prompt utterance (CosyVoice 2
        truncates the prompt tokens to its mel's length as upstream's frontend does). The runner builds the
        LM prompt from the returned tokens, so LM and vocoder see the same prompt. Optional: a vocoder
        without it conditions on the prompt as given."""
        ...


class ASR(Protocol):
    """The WER judge: a float waveform at any rate -> its transcript."""

    def transcribe(self, wav: np.ndarray, sr: int) -> str: ...


class SpeakerModel(Protocol):
    """The SIM judge: a waveform -> a speaker embedding (compared by cosine similarity)."""

    def embed(self, wav: np.ndarray, sr: int) -> np.ndarray: ...


class MOSJudge(Protocol):
    """The naturalness judge: a waveform at any rate -> named MOS estimates, e.g. DNSMOS's
    {"ovrl", "sig", "bak", "p808"}; `primary` names the one reported as NMOS. `keys` lists every name
    `score` returns (a record whose audio cannot be scored holds None under each). `score` raises
    ValueError for audio it cannot judge (silent, too short): that utterance's MOS is recorded as missing."""

    primary: str
    keys: tuple[str, ...]

    def score(self, wav: np.ndarray, sr: int) -> dict[str, float]: ...
