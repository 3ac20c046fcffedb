"""The layer-subset drafter (SSD, PCG): the target's architecture with a chosen list of the target's layers.

`build_draft(target, layers=[0, 1, 18, ..., 23], trainable=["layers.0", "layers.1", "head"])`
returns a `Draft`: a model of the target's class whose layer j is a bit-exact copy of target layer
layers[j], with the recipe and the target's fingerprint beside it. It drafts by running that model token by
token (`ssd.drafters.autoregressive`), and it trains through the model's own `training_logits`, so the
trainer takes it where it takes a target. Frozen embeddings / head / final norm are the target's own tensors when
share_embeddings is true (copies otherwise); trainable parts are always copies, so training a
draft never changes its target. A draft checkpoint holds only the trainable tensors, the recipe
and a fingerprint of the target; loading rebuilds everything else from the target.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ssd.contracts import TrainingOutputs
from ssd.drafters.autoregressive import AutoregressiveSession
from ssd.drafters.base import load_trained, model_outputs, save_trained, target_fingerprint
from ssd.files import read_checkpoint
from ssd.models.base import CachedSpeechLM

KIND = "draft"  # checkpoint format ssd-draft-v1 (ssd.drafters.base.save_trained)


@dataclass(frozen=True)
class DraftRecipe:
    layers: tuple[int, ...]  # target layer index of each draft layer, in order
    trainable: tuple[str, ...]  # draft-local group names ("layers.0", "head", ...)
    share_embeddings: bool


class Draft(nn.Module):
    """A layer-subset drafter (`ssd.contracts.Drafter`) and what it was built from. `model` is of the target's
    class; the rest is metadata."""

    taps: tuple[int, ...] = ()

    def __init__(
        self,
        model: CachedSpeechLM,
        recipe: DraftRecipe,
        target_fingerprint: dict[str, Any],
        name: str | None = None,
    ) -> None:
        super().__init__()
        self.model = model
        self.recipe = recipe
        self.target_fingerprint = target_fingerprint
        self.name = name
        self.vocab_size = model.vocab_size
        self.speech_token_size = model.speech_token_size
        self.stop_tokens = model.stop_tokens

    def start(self, prompt: Any, first: torch.Tensor, features: Any, room: int) -> AutoregressiveSession:
        return AutoregressiveSession(self.model, prompt, first, room)

    def training_outputs(self, batch: dict, teacher: Any) -> TrainingOutputs:
        """The draft model's next-token predictions at every scored position (and the target's, for KD)."""
        return model_outputs(self.model, batch, teacher)

    def save(self, path: str | Path) -> Path:
        return save_draft(path, self)

    # What the trainer and the compiler use are the model's own.
    def compile_decoding(self, **options: Any) -> Draft:
        """The model's static, compiled decode step (CachedSpeechLM.compile_decoding). Returns self."""
        self.model.compile_decoding(**options)
        return self

    def embed_speech(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.embed_speech(tokens)

    def training_logits(self, *args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.training_logits(*args)

    def min_speech_tokens(self, text_lens: torch.Tensor) -> torch.Tensor:
        return self.model.min_speech_tokens(text_lens)

    def module_groups(self) -> dict[str, nn.Module]:
        return self.model.module_groups()

    @property
    def device(self) -> torch.device:
        return self.model.device

    def __repr__(self) -> str:
        return describe(self)


def _group_of(model: CachedSpeechLM) -> dict[str, str]:
    """state-dict key -> group name (as module_groups() names it)."""
    prefix_of = {id(m): name for name, m in model.named_modules()}
    prefixes = {prefix_of[id(m)] + ".": group for group, m in model.module_groups().items()}
    out = {}
    for key in model.state_dict():
        owners = [g for p, g in prefixes.items() if key.startswith(p)]
        if len(owners) != 1:
            raise RuntimeError(f"{type(model).__name__}.module_groups() must cover {key!r} exactly once")
        out[key] = owners[0]
    return out


def build_draft(
    target: CachedSpeechLM,
    layers: Sequence[int],
    trainable: Sequence[str] = (),
    share_embeddings: bool = True,
    checkpoint: str | Path | None = None,
    name: str | None = None,
) -> Draft:
    """A draft of the target's class from target layers `layers` (see the module docstring).

    layers: target layer indices; negative ones count from the top (-1 = last), as in Python.
    trainable: draft-local group names ("layers" = all draft layers); everything else gets requires_grad=False.
    checkpoint: a file from save_draft with the same recipe, whose trained tensors are loaded.
    name: a label (the draft config's name), kept as draft.name.
    """
    n_target = len(target.backbone.layers)
    requested = [int(i) for i in layers]
    if not requested or any(not -n_target <= i < n_target for i in requested):
        raise ValueError(f"draft layers {requested} must be a non-empty list of target layers in [0, {n_target})"
                         f" (or negative, from the top)")  # fmt: skip
    layers = tuple(i % n_target for i in requested)
    draft = target.draft_skeleton(len(layers))
    group_of = _group_of(draft)
    valid = list(draft.module_groups())
    # "layers" names every draft layer, so one config fits drafts of any depth (configs/draft/toy.yaml).
    every_layer = [g for g in valid if g.startswith("layers.")]
    trainable = list(dict.fromkeys(n for t in trainable for n in (every_layer if t == "layers" else [t])))
    unknown = [name for name in trainable if name not in valid]
    if unknown:
        raise ValueError(f"draft trainable names {unknown} are unknown; valid names: {valid}")
    trainable = tuple(trainable)

    target_state = target.state_dict()
    state = {}
    for key, group in group_of.items():
        source_key = key
        if group.startswith("layers."):
            j = int(group.split(".")[1])
            source_key = key.replace(f"backbone.layers.{j}.", f"backbone.layers.{layers[j]}.", 1)
        source = target_state[source_key]
        shared = share_embeddings and not group.startswith("layers.") and group not in trainable
        state[key] = source if shared else source.clone()
    draft.load_state_dict(state, strict=True, assign=True)
    draft.backbone.init_rope(device=target.device)
    for key, param in draft.named_parameters():
        param.requires_grad_(group_of[key] in trainable)
    wrapped = Draft(
        draft.eval(), DraftRecipe(layers, trainable, bool(share_embeddings)), target_fingerprint(target), name
    )
    if checkpoint is not None:
        load_trained(checkpoint, wrapped.model, KIND, _recipe(wrapped.recipe), target)
    return wrapped


def save_draft(path: str | Path, draft: Draft) -> Path:
    """Store the draft's trainable tensors (under the model's own keys, so the format is independent of the
    wrapper), its recipe and its target's fingerprint (taken at build)."""
    if not isinstance(draft, Draft):
        raise ValueError(f"save_draft needs a Draft made by build_draft, got {type(draft).__name__}")
    return save_trained(path, draft.model, KIND, _recipe(draft.recipe), draft.target_fingerprint)


def _recipe(recipe: DraftRecipe) -> dict[str, Any]:
    return {**asdict(recipe), "layers": list(recipe.layers), "trainable": list(recipe.trainable)}


def load_draft(path: str | Path, target: CachedSpeechLM) -> Draft:
    """Rebuild a saved draft from its target (a different target is a clear error)."""
    payload = read_checkpoint(path, f"{KIND} checkpoint")
    if not isinstance(payload, dict) or payload.get("format") != f"ssd-{KIND}-v1":
        raise ValueError(f"{path} is not an ssd {KIND} checkpoint (format ssd-{KIND}-v1)")
    recipe = payload["recipe"]
    return build_draft(
        target, recipe["layers"], recipe["trainable"], recipe["share_embeddings"], checkpoint=path
    )


def parameter_table(model: CachedSpeechLM | Draft) -> list[dict[str, Any]]:
    """One row per module group: trainable / frozen parameter counts and where it came from."""
    recipe = model.recipe if isinstance(model, Draft) else None
    rows = []
    for group, module in model.module_groups().items():
        params = list(module.parameters())
        n_train = sum(p.numel() for p in params if p.requires_grad)
        n_total = sum(p.numel() for p in params)
        source = ""
        if recipe is not None:
            if group.startswith("layers."):
                source = f"target layers.{recipe.layers[int(group.split('.')[1])]} (copy)"
            else:
                shared = recipe.share_embeddings and group not in recipe.trainable
                source = "target (shared)" if shared else "target (copy)"
        rows.append({"module": group, "trainable": n_train, "frozen": n_total - n_train, "source": source})
    return rows


def describe(model: CachedSpeechLM | Draft) -> str:
    """A table of per-module trainable / frozen parameter counts (what printing a draft shows)."""
    from rich.console import Console
    from rich.table import Table

    rows = parameter_table(model)
    title = f"{type(model.model).__name__} draft" if isinstance(model, Draft) else type(model).__name__
    table = Table(title=title)
    for column in ("module", "trainable", "frozen", "source"):
        table.add_column(column, justify="right" if column in ("trainable", "frozen") else "left")
    for row in rows:
        table.add_row(row["module"], f"{row['trainable']:,}", f"{row['frozen']:,}", row["source"])
    table.add_row(
        "total", f"{sum(r['trainable'] for r in rows):,}", f"{sum(r['frozen'] for r in rows):,}", ""
    )
    buffer = io.StringIO()
    Console(file=buffer, width=100, force_terminal=False, color_system=None).print(table)
    return buffer.getvalue()
