"""Every contract between the swappable parts, in one place.

- `SpeechLM`: what the decoding engine drives (targets, and the models autoregressive drafters run).
- `TTSTargetLM`: what the evaluation runner and the trainer need from a target on top of that.
- `Drafter` / `DraftSession`: what proposes draft tokens to the speculative loop (any drafter family).
- `AcceptanceRule` (+ its optional hooks `ExplicitLawRule`, `AuditedRule`, `SettlingRule`): what decides
  which draft tokens stay.
- `Decoder`: a decoding strategy as the runner sees it (autoregressive, draft-only, speculative).
- `SpeechTokenizer`, `Vocoder`, `ASR`, `SpeakerModel`, `MOSJudge`: the audio side of a run; a vocoder may also
  stream (`StreamingVocoder`, `VocoderStream`: verified tokens in, audio chunks out, as CosyVoice's token2wav).

Each swappable part is a Hydra `_target_` node in `configs/` (a group per kind: target, draft, acceptance,
decoding, speech_tokenizer, vocoder, asr, sim, mos); a class of a user's own module plugs in with
`<group>._target_=my_module.MyClass` as long as it speaks the contract here. The classes shipped with
the project subclass nothing from this module: the contracts are structural (`typing.Protocol`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch


@runtime_checkable
class SpeechLM(Protocol):
    """A causal LM over speech tokens, driven token by token (batch-first; every row keeps its own length).

    The engine never looks inside a prompt or a cache: the adapter owns its input layout (CosyVoice 2:
    sos, text, task_id, prompt speech tokens) and its cache (static KV buffers with per-row lengths),
    so rows can accept different numbers of draft tokens in the same round.

    Hidden states for drafters: `prefill(..., taps=(i, j, ...))` makes a cache whose `features` attribute
    holds, after every prefill / extend, the residual stream after `i`, `j`, ... layers (0 = the input
    embeddings, the number of layers = the last layer's output, before the final norm) at the positions
    that call added (`Features`: a prefill's rows right-padded, valid up to each prompt's length). Without
    taps nothing extra is computed or kept and `features` is None.

    Optional (not part of the runtime check): `context_ids(prompt) -> list[LongTensor]`, each row's prompt
    ids in head space (ids outside the head dropped). The engine asks for it only when the sampling law
    depends on the whole context (`SamplingConfig.whole_context`: the repetition penalty); LlasaLM has it.

    Optional: `compile_decoding(mode="reduce-overhead", fullgraph=True) -> self` switches the model to a
    static, graph-capturable decode step and compiles it (`ssd.models.base.CachedSpeechLM`); the runner
    calls it on the target and the drafter when `decoding.compile` is true. Caches prefilled after the call
    use the static step (docs/gpu.md).
    """

    vocab_size: int  # size of the speech head (logits' last dimension)

    def prefill(self, prompt: Any, max_new_tokens: int, taps: Sequence[int] = ()) -> tuple[Any, torch.Tensor]:
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
    length rules, and can be trained and saved. Layer-subset drafts built from it (`ssd.drafters.layers`)
    speak the same contract, so the trainer needs nothing else for them."""

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


@dataclass
class Features:
    """Hidden states a target computed for a drafter at the positions one prefill / extend added
    (`SpeechLM`'s taps): hidden [B, T, len(taps), H], valid up to lengths [B] per row (T for an extend)."""

    hidden: torch.Tensor
    lengths: torch.Tensor


@dataclass
class TrainingOutputs:
    """A trained model's teacher-forced predictions of one batch at N scored positions (a drafter's
    `training_outputs`): its logits [N, V], the data's labels [N], the frozen target's logits for the same
    predictions [N, V] (None without a teacher), and where each prediction sits: its batch row [N] and its step
    [N], the index of the predicted token among the row's generated tokens (what the sampling law depends on)."""

    logits: torch.Tensor
    labels: torch.Tensor
    teacher: torch.Tensor | None
    rows: torch.Tensor
    steps: torch.Tensor


# draw(logits [B, V], earlier [B, i]) -> (token [B], law [B, V]): the sampling law of draft position i of this
# round (the target's sampling transform, its history extended by the earlier draft tokens), and a token drawn
# from it with the row's own random stream. The speculative loop hands it to every drafter.
Draw = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@runtime_checkable
class Drafter(Protocol):
    """Proposes draft tokens to the speculative loop (`ssd.drafters`: layer subset, heads, feature, block).

    `taps` names the target hidden states the drafter reads (see `SpeechLM`; () for none): the loop asks the
    target for exactly those, at the prompt's positions and at the positions each verification adds.
    Exactness needs one thing of a drafter: every token it proposes is drawn from the law it returns as p.
    `draw` gives that with the target's own sampling transform (RAS, EOS rule, repetition penalty), so a
    drafter that uses it sees the law the target applies and keeps β = 0 exact.

    Optional: `model`, a `SpeechLM` the drafter runs autoregressively (a layer subset); the draft-only
    decoder decodes it alone, and `compile_decoding` reaches it.
    """

    vocab_size: int
    taps: tuple[int, ...]

    def start(
        self, prompt: Any, first: torch.Tensor, features: torch.Tensor | None, room: int
    ) -> DraftSession:
        """A session for one decode: the prompt batch, the first generated token [B] (drawn from the target's
        prefill), the target's features of the prompt (None without taps) and the room its caches need."""
        ...


@runtime_checkable
class DraftSession(Protocol):
    """One decode's drafter state (a KV cache, a feature buffer, nothing); rolls itself back."""

    def propose(self, k: int, draw: Draw) -> tuple[torch.Tensor, torch.Tensor]:
        """k draft tokens after the last emitted token: (tokens [B, k], laws [B, k, V] they were drawn from)."""
        ...

    def accept(self, kept: list[int], token: torch.Tensor, features: torch.Tensor | None) -> None:
        """The rule kept the first kept[b] proposed tokens of row b and emitted `token` [B] after them;
        `features` are the target's hidden states of the verified block [B, k + 1, len(taps), H] (None
        without taps): position j is the target's input after the j-th kept token (0: the token before the
        block)."""
        ...


@runtime_checkable
class AcceptanceRule(Protocol):
    """Decides, given draft laws p [B, k, V], target laws q [B, k+1, V] and draft tokens x [B, k], how many
    draft tokens stay and what the next token is (`ssd.decoding.acceptance`, `ssd.decoding.pcg`). A rule never
    knows which drafter proposed."""

    name: str
    preserves_target_law: bool  # the emitted token law equals q (its TV to q is 0 without computing it)
    deterministic: bool  # the verdict draws no random numbers (greedy: equals greedy AR of q)

    def verify(
        self, p: torch.Tensor, q: torch.Tensor, x: torch.Tensor, generator: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(n_accepted [B] in 0..k, next_token [B]). Random numbers come from the row streams
        (`ssd.decoding.rng.RowRandom.of(generator, B, device)`), a count per row that does not depend on the
        data, so a row verifies the same in any batch."""
        ...

    def labels(self) -> dict[str, Any]:
        """The parameters that identify a run of this rule in tables ({"beta": 0.4}; {} for none)."""
        ...

    def bind(self, target: TTSTargetLM) -> AcceptanceRule:
        """Take what the rule needs from the target (PCG: its group vectors); returns the rule."""
        ...


@runtime_checkable
class ExplicitLawRule(Protocol):
    """Optional hook: the exact one-step law of the emitted token (certificates; the TV drift diagnostic,
    computed during decoding only when `cheap_output_law`: O(V) per position, no enumeration)."""

    cheap_output_law: bool

    def output_law(self, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class AuditedRule(Protocol):
    """Optional hook: a rule whose kept draft tokens can be audited (SSD's tolerance with `audit_groups`)."""

    audits_acceptance: bool  # audit() is available for this instance
    audit_fields: tuple[str, ...]  # the names of audit()'s last dimension

    def verify_draws(
        self, p: torch.Tensor, q: torch.Tensor, x: torch.Tensor, generator: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """verify() plus the uniforms [B, k] its verdicts used (the same draws: auditing changes nothing)."""
        ...

    def audit(
        self, p: torch.Tensor, q: torch.Tensor, x: torch.Tensor, uniforms: torch.Tensor
    ) -> torch.Tensor:
        """[B, k, len(audit_fields)] per draft token."""
        ...


@runtime_checkable
class SettlingRule(Protocol):
    """Optional hook: a rule whose verify may leave a row's next token UNSETTLED (-1) when finishing it needs
    work the rule avoids in the common case (PCG's enumerated residual after failed thinning trials). The loop
    reads whether any row is unsettled on the round's one host sync and then calls `settle`, which fills those
    rows exactly, from numbers verify already drew for every row (batch invariance holds)."""

    def settle(self, next_token: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class Decoder(Protocol):
    """A decoding strategy as the evaluation runner sees it (`ssd.decoding.decoders`; configs/decoding/).

    `needs` lists the config groups of the parts it decodes with besides the target (("draft", "acceptance")
    for speculative decoding), which the runner builds and hands to `bind`. `labels()` names a run of it in
    metrics and tables; `baseline()` is the config node of the decoder its speedups and paired differences are
    measured against (the autoregressive target), None for that baseline itself.
    """

    name: str
    needs: tuple[str, ...]
    max_batch_size: int | None  # None: any; 1 for a decoder whose rows would depend on each other

    def bind(self, **parts: Any) -> Decoder: ...

    def labels(self) -> dict[str, Any]: ...

    def baseline(self) -> dict[str, Any] | None: ...

    def decode(self, target: SpeechLM, request: Any, sampling: Any, observer: Any = None) -> Any:
        """Decode a `ssd.decoding.generate.Request`; returns a `DecodeResult` (instrumented by `observer`)."""
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


@runtime_checkable
class VocoderStream(Protocol):
    """One utterance's chunked synthesis: tokens arrive as the LM verifies them, audio leaves in chunks whose
    concatenation is the utterance's streamed waveform. The chunks depend on the token sequence only, not on how
    it was split into pushes."""

    def push(self, tokens: np.ndarray) -> list[np.ndarray]:
        """Append tokens (int64 [n], the vocoder's ids); returns the chunks (float32 [samples]) ready now."""
        ...

    def finish(self) -> list[np.ndarray]:
        """The LM has ended: the rest of the audio (the session is closed afterwards)."""
        ...


@runtime_checkable
class StreamingVocoder(Protocol):
    """Optional, beside `Vocoder`: synthesis in chunks while the LM generates (`eval.streaming=true`).
    `ssd.audio.streaming.ChunkSchedule` is CosyVoice's chunking (25-token hops, 3 tokens of lookahead), which
    the shipped vocoders share."""

    sample_rate: int

    def stream(self, prompt: VocoderPrompt) -> VocoderStream: ...


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
