"""A GRID-style toy language: six fixed slots, ~50 words, sentences drawn by a seeded generator.

A small closed vocabulary with a fixed structure is what lets a 3 M-parameter TTS LM learn to
follow its text within CPU-minutes (see docs/toy-world.md); the slot structure also lets evaluation
report per-slot word accuracy, which tells text-following apart from fluent babble.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

# Words chosen to be common English (so Whisper knows them) and acoustically distinct within a slot.
DEFAULT_SLOTS: dict[str, tuple[str, ...]] = {
    "command": ("place", "move", "put", "set"),
    "colour": ("blue", "green", "red", "white"),
    "preposition": ("above", "behind", "beside", "under"),
    "noun": (
        "apple",
        "basket",
        "bottle",
        "button",
        "candle",
        "carpet",
        "doctor",
        "engine",
        "finger",
        "garden",
        "hammer",
        "island",
        "jacket",
        "kitten",
        "lemon",
        "monkey",
        "pencil",
        "rabbit",
        "window",
        "wagon",
    ),
    "digit": ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"),
    "adverb": ("again", "now", "please", "soon"),
}

_DIGIT_WORDS = DEFAULT_SLOTS["digit"]


@dataclass(frozen=True)
class GridSentence:
    """One sentence: the chosen word of every slot, in slot order."""

    words: tuple[str, ...]

    @property
    def text(self) -> str:
        return " ".join(self.words)


class GridLanguage:
    """The sentence generator and the slot structure evaluation needs.

    `slots` maps slot name -> its words, in sentence order. Every sentence has exactly one word per slot.
    """

    def __init__(self, slots: Mapping[str, Sequence[str]] | None = None) -> None:
        slots = DEFAULT_SLOTS if slots is None else slots
        if not slots:
            raise ValueError("GridLanguage: `slots` is empty; give at least one slot with words")
        self.slots: dict[str, tuple[str, ...]] = {}
        for name, words in slots.items():
            words = tuple(str(w).lower() for w in words)
            if not words:
                raise ValueError(f"GridLanguage: slot {name!r} has no words")
            bad = [w for w in words if not re.fullmatch(r"[a-z']+", w)]
            if bad:
                raise ValueError(f"GridLanguage: slot {name!r} has words that are not plain lowercase: {bad}")
            if len(set(words)) != len(words):
                raise ValueError(f"GridLanguage: slot {name!r} repeats a word: {words}")
            self.slots[str(name)] = words

    @property
    def slot_names(self) -> tuple[str, ...]:
        return tuple(self.slots)

    @property
    def words(self) -> tuple[str, ...]:
        """The closed vocabulary, sorted (a word shared by two slots appears once)."""
        return tuple(sorted({w for ws in self.slots.values() for w in ws}))

    @property
    def num_sentences(self) -> int:
        return int(np.prod([len(ws) for ws in self.slots.values()]))

    def sample(self, n: int, seed: int) -> list[GridSentence]:
        """`n` sentences drawn uniformly per slot; the same (n, seed) always gives the same list."""
        if n < 0:
            raise ValueError(f"GridLanguage.sample: n must be >= 0, got {n}")
        rng = np.random.default_rng(seed)
        columns = [rng.integers(0, len(ws), size=n) for ws in self.slots.values()]
        return [
            GridSentence(tuple(ws[int(col[i])] for ws, col in zip(self.slots.values(), columns)))
            for i in range(n)
        ]

    def normalize(self, text: str) -> list[str]:
        """Lowercase words without punctuation, digits spelled out (ASR often writes '7' for 'seven'); letters
        of any script are kept ('café' stays 'café', not 'caf')."""
        text = re.sub(r"\d", lambda m: f" {_DIGIT_WORDS[int(m.group())]} ", text.lower())
        return re.findall(r"(?:[^\W\d_]|')+", text)

    def parse(self, text: str) -> GridSentence:
        """The sentence a well-formed text spells; raises ValueError naming the first slot that does not fit."""
        words = self.normalize(text)
        if len(words) != len(self.slots):
            raise ValueError(f"expected {len(self.slots)} words ({', '.join(self.slots)}), got {words}")
        for (name, allowed), word in zip(self.slots.items(), words):
            if word not in allowed:
                raise ValueError(f"word {word!r} is not a {name} (allowed: {', '.join(allowed)})")
        return GridSentence(tuple(words))

    def slot_correct(self, reference: str, hypothesis: str) -> dict[str, bool]:
        """Per slot: was the reference word recognised, i.e. aligned as a hit by a minimum-edit alignment."""
        import jiwer

        ref = self.parse(reference).words
        hyp = self.normalize(hypothesis)
        correct = dict.fromkeys(self.slots, False)
        if not hyp:
            return correct
        alignment = jiwer.process_words(" ".join(ref), " ".join(hyp)).alignments[0]
        names = list(self.slots)
        for chunk in alignment:
            if chunk.type == "equal":
                for i in range(chunk.ref_start_idx, chunk.ref_end_idx):
                    correct[names[i]] = True
        return correct
