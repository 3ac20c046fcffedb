"""Decoding strategies as the evaluation runner sees them (`ssd.contracts.Decoder`; configs/decoding/).

A decoder says which parts it decodes with besides the target (`needs`: config groups the runner builds and
hands to `bind`), labels its runs, and names the baseline it is compared with (as the config node of a decoder):
every decoder but the target alone is measured against `Autoregressive`. A new strategy is a class here or in your own module, and a
configs/decoding/<name>.yaml naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from ssd.decoding.generate import AdaptiveDraftLength, decode_ar, decode_speculative


def _compile(*models: Any) -> None:
    """decoding.compile=true: the static, compiled decode step of each model (`compile_decoding`)."""
    for model in models:
        method = getattr(model, "compile_decoding", None)
        if method is None:
            raise ValueError(
                f"decoding.compile=true but {type(model).__name__} has no compile_decoding() (ssd.contracts."
                "SpeechLM): set decoding.compile=false, or give the class that method"
            )
        method()


def _standalone(drafter: Any) -> Any:
    """The SpeechLM an autoregressive drafter runs (ssd.contracts.Drafter's optional `model`)."""
    model = getattr(drafter, "model", None)
    if model is None:
        raise ValueError(
            f"the drafter {type(drafter).__name__} has no model of its own to decode alone (it reads the target's "
            "hidden states): decoding=draft_only needs an autoregressive drafter such as draft=toy"
        )
    return model


@dataclass
class Autoregressive:
    """The target alone, one call per token: the baseline every other decoder is compared with."""

    compile: bool = False
    name: ClassVar[str] = "ar"
    needs: ClassVar[tuple[str, ...]] = ()
    max_batch_size: ClassVar[int | None] = None

    def bind(self, target: Any, **parts: Any) -> Autoregressive:
        if self.compile:
            _compile(target)
        return self

    def labels(self) -> dict[str, Any]:
        return {"decoding": self.name}

    def baseline(self) -> None:
        return None

    @classmethod
    def config(cls, compile: bool = False) -> dict[str, Any]:
        """This decoder as a config node (what other decoders name as their baseline)."""
        return {"_target_": f"{cls.__module__}.{cls.__qualname__}", "compile": compile}

    def decode(self, target, request, sampling, observer=None):
        return decode_ar(target, request, sampling, observer)


@dataclass
class DraftOnly:
    """The drafter's own model alone, sampled with the target's law (the papers' "draft alone" row)."""

    compile: bool = False
    drafter: Any = field(default=None, repr=False)
    name: ClassVar[str] = "draft_only"
    needs: ClassVar[tuple[str, ...]] = ("draft",)
    max_batch_size: ClassVar[int | None] = None

    def bind(self, target: Any, draft: Any, **parts: Any) -> DraftOnly:
        model = _standalone(draft)
        if self.compile:
            _compile(model)
        return replace(self, drafter=draft)

    def labels(self) -> dict[str, Any]:
        return {"decoding": self.name, "draft": getattr(self.drafter, "name", None)}

    def baseline(self) -> dict[str, Any]:
        return Autoregressive.config(self.compile)

    def decode(self, target, request, sampling, observer=None):
        return decode_ar(_standalone(self.drafter), request, sampling, observer)


@dataclass
class Speculative:
    """The drafter proposes `draft_len` tokens a round; the target verifies them in one call; the acceptance
    rule decides what stays. `adaptive.enabled`: HF's draft-length heuristic, starting at draft_len."""

    draft_len: int = 3
    adaptive: Any = (
        None  # {enabled, min_len, max_len, increase, decrease} (configs/decoding/speculative.yaml)
    )
    compile: bool = False
    drafter: Any = field(default=None, repr=False)
    rule: Any = field(default=None, repr=False)
    name: ClassVar[str] = "speculative"
    needs: ClassVar[tuple[str, ...]] = ("draft", "acceptance")

    def __post_init__(self) -> None:
        if int(self.draft_len) < 1:
            raise ValueError(f"draft_len={self.draft_len} must be >= 1")
        self.lengths = int(self.draft_len)
        settings = dict(self.adaptive) if isinstance(self.adaptive, Mapping) else {}
        if settings.pop("enabled", False):
            self.lengths = AdaptiveDraftLength(start=int(self.draft_len), **settings)

    @property
    def adaptive_length(self) -> bool:
        return isinstance(self.lengths, AdaptiveDraftLength)

    @property
    def max_batch_size(self) -> int | None:
        """Adaptive draft length shares one k across a batch, so its rows would depend on each other: batch 1."""
        return 1 if self.adaptive_length else None

    def bind(self, target: Any, draft: Any, acceptance: Any, **parts: Any) -> Speculative:
        if draft.vocab_size != target.vocab_size:
            raise ValueError(
                f"the drafter ({getattr(draft, 'name', type(draft).__name__)}) has {draft.vocab_size} head entries "
                f"but the target has {target.vocab_size}: build the drafter from this target"
            )
        if self.compile:
            _compile(target, *([draft.model] if getattr(draft, "model", None) is not None else []))
        return replace(self, drafter=draft, rule=acceptance.bind(target))

    def labels(self) -> dict[str, Any]:
        rule = {k: float(v) if isinstance(v, int | float) else v for k, v in self.rule.labels().items()}
        return {"decoding": self.name, "draft": getattr(self.drafter, "name", None),
                "acceptance": getattr(self.rule, "name", type(self.rule).__name__), **rule,
                "draft_len": int(self.draft_len), "adaptive": self.adaptive_length}  # fmt: skip

    def baseline(self) -> dict[str, Any]:
        return Autoregressive.config(self.compile)

    def decode(self, target, request, sampling, observer=None):
        return decode_speculative(target, self.drafter, request, sampling, self.rule, self.lengths, observer)
