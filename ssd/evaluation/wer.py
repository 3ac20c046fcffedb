"""WER the way TTS papers compute it: Whisper's English normaliser on both sides, then jiwer.

Two aggregates, because papers differ: corpus WER = total errors / total reference words (most papers),
and mean per-utterance WER (Seed-TTS-eval). Each utterance keeps its substitution, deletion, insertion
and reference-word counts, so a runner can aggregate either way and bootstrap confidence intervals.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from functools import lru_cache

import jiwer


@lru_cache(maxsize=1)
def _english_normalizer() -> Callable[[str], str]:
    try:
        from whisper.normalizers import EnglishTextNormalizer

        return EnglishTextNormalizer()
    except ImportError:
        # transformers ships the same normaliser; without openai-whisper's english.json the
        # British -> American spelling map is empty, which is the only difference.
        from transformers.models.whisper.english_normalizer import EnglishTextNormalizer

        return EnglishTextNormalizer({})


def normalize_text(text: str) -> str:
    """Whisper's English normaliser: lowercase, no punctuation, numbers as digits ('four' -> '4')."""
    return " ".join(_english_normalizer()(text).split())


@dataclass(frozen=True)
class UtteranceWER:
    """Edit counts of one utterance after normalisation."""

    reference: str
    hypothesis: str
    substitutions: int
    deletions: int
    insertions: int
    ref_words: int

    @property
    def errors(self) -> int:
        return self.substitutions + self.deletions + self.insertions

    @property
    def wer(self) -> float:
        return self.errors / self.ref_words

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "errors": self.errors, "wer": self.wer}


@dataclass(frozen=True)
class WERSummary:
    corpus_wer: float  # total errors / total reference words
    mean_utterance_wer: float  # mean of per-utterance WERs (Seed-TTS-eval style)
    errors: int
    ref_words: int
    num_utterances: int


def utterance_wer(reference: str, hypothesis: str, normalize: bool = True) -> UtteranceWER:
    """Substitutions, deletions, insertions of `hypothesis` against `reference` (both normalised first)."""
    ref = normalize_text(reference) if normalize else " ".join(reference.split())
    hyp = normalize_text(hypothesis) if normalize else " ".join(hypothesis.split())
    if not any(ch.isalnum() for ch in ref):  # "... !? —" normalises to "." (one 'word'), not to ""
        raise ValueError(f"reference {reference!r} has no word after normalisation; WER is undefined for it")
    out = jiwer.process_words(ref, hyp)
    return UtteranceWER(ref, hyp, out.substitutions, out.deletions, out.insertions, len(ref.split()))


def summarize_wer(utterances: Iterable[UtteranceWER]) -> WERSummary:
    """Corpus WER and mean per-utterance WER over scored utterances."""
    items: Sequence[UtteranceWER] = list(utterances)
    if not items:
        raise ValueError("summarize_wer: no utterances to summarise")
    # One aggregation for the project: the run-level metrics' functions, over the same record fields.
    from ssd.evaluation.metrics import corpus_wer, mean_utterance_wer

    records = [u.as_dict() for u in items]
    return WERSummary(
        corpus_wer=corpus_wer(records),
        mean_utterance_wer=mean_utterance_wer(records),
        errors=sum(u.errors for u in items),
        ref_words=sum(u.ref_words for u in items),
        num_utterances=len(items),
    )


def score_wer(references: Sequence[str], hypotheses: Sequence[str], normalize: bool = True) -> WERSummary:
    """Score aligned lists of references and hypotheses and summarise them."""
    if len(references) != len(hypotheses):
        raise ValueError(f"score_wer: {len(references)} references but {len(hypotheses)} hypotheses")
    return summarize_wer(utterance_wer(r, h, normalize) for r, h in zip(references, hypotheses))
