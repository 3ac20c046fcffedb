"""What the drafter families share: the parts they borrow from their target, the target's features where they
are tapped, teacher-forced training outputs, and the checkpoint format of their own tensors.

A drafter that reads the target's hidden states borrows the target's speech embedding, final norm and speech
head (frozen). It holds them through `Borrowed`, not as submodules, so its state dict, its optimizer and its
checkpoints hold only its own tensors.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ssd.contracts import IGNORE_INDEX, Features, TrainingOutputs
from ssd.files import read_checkpoint, write_checkpoint

PROBE_VALUES_PER_TENSOR = 4


class Borrowed:
    """The target's parts a drafter uses as they are (frozen, shared, not registered as the drafter's own)."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.target.embed_speech(tokens)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's speech head over pre-norm hidden states (its final norm first), float32."""
        return self.target.speech_logits(self.target.backbone.norm(hidden)).float()

    @property
    def num_layers(self) -> int:
        return len(self.target.backbone.layers)

    @property
    def hidden_size(self) -> int:
        return self.target.backbone.config.hidden_size


def target_fingerprint(model: nn.Module) -> dict[str, Any]:
    """Identity of a target: a hash of its class, parameter names and shapes, plus a few leading values of every
    tensor (compared with a tolerance, so fp32/bf16 loads of one target agree)."""
    state = model.state_dict()
    structure = hashlib.sha256(type(model).__name__.encode())
    probes = []
    for key in sorted(state):
        structure.update(f"{key}:{tuple(state[key].shape)};".encode())
        probes.append(state[key].detach().flatten()[:PROBE_VALUES_PER_TENSOR].float().cpu())
    return {"structure_sha256": structure.hexdigest(), "probe": torch.cat(probes)}


def check_target(expected: dict[str, Any], target: nn.Module, path: Path) -> None:
    actual = target_fingerprint(target)
    same = expected["structure_sha256"] == actual["structure_sha256"] and torch.allclose(
        expected["probe"], actual["probe"], rtol=1e-2, atol=1e-3
    )
    if not same:
        raise ValueError(
            f"drafter checkpoint {path} was made from another target than the {type(target).__name__} given: "
            + (
                f"its structure {expected['structure_sha256'][:12]} is not this target's {actual['structure_sha256'][:12]}"
                if expected["structure_sha256"] != actual["structure_sha256"]
                else f"same structure ({actual['structure_sha256'][:12]}) but other weights"
            )  # fmt: skip
        )


def save_trained(path: str | Path, drafter: nn.Module, kind: str, recipe: dict, target_id: dict) -> Path:
    """Write a drafter's trainable tensors with its recipe and its target's fingerprint (atomically)."""
    trained = {k: p.detach().cpu().clone() for k, p in drafter.named_parameters() if p.requires_grad}
    payload = {"format": f"ssd-{kind}-v1", "recipe": recipe, "target": target_id, "trained": trained}
    return write_checkpoint(path, payload)


def load_trained(path: str | Path, drafter: nn.Module, kind: str, recipe: dict, target: nn.Module) -> None:
    """Load what `save_trained` wrote into `drafter` (built with `recipe` from `target`): every mismatch named."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"{kind} checkpoint {path} does not exist: train the drafter first (python train_draft.py "
            f"draft=<its config> hydra.run.dir={path.parent} writes {path.parent}/draft.pt), or set "
            "draft.checkpoint=null for an untrained one"
        )
    payload = read_checkpoint(path, f"{kind} checkpoint")
    if not isinstance(payload, dict) or payload.get("format") != f"ssd-{kind}-v1":
        raise ValueError(f"{path} is not an ssd {kind} checkpoint (format ssd-{kind}-v1)")
    check_target(payload["target"], target, path)
    if payload["recipe"] != recipe:
        raise ValueError(
            f"{kind} checkpoint {path} has recipe {payload['recipe']}, the config asks for {recipe}"
        )
    params = dict(drafter.named_parameters())
    expected = {k for k, p in params.items() if p.requires_grad}
    if set(payload["trained"]) != expected:
        raise ValueError(
            f"{kind} checkpoint {path}: tensors {sorted(payload['trained'])} != trainable {sorted(expected)}"
        )
    with torch.no_grad():
        for key, value in payload["trained"].items():
            if value.shape != params[key].shape:
                raise ValueError(f"{kind} checkpoint {path}: {key} has shape {tuple(value.shape)}, the drafter "
                                 f"{tuple(params[key].shape)}")  # fmt: skip
            params[key].copy_(value)


def last_positions(features: Features) -> torch.Tensor:
    """[B, n_taps, H]: the features at each row's last valid position (a prefill's last prompt position)."""
    rows = torch.arange(features.hidden.shape[0], device=features.hidden.device)
    return features.hidden[rows, features.lengths.to(rows.device) - 1]


def at_positions(features: Features, index: list[int] | torch.Tensor) -> torch.Tensor:
    """[B, n_taps, H]: the features of row b at position index[b]."""
    hidden = features.hidden
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    return hidden[rows, torch.as_tensor(index, device=hidden.device)]


def scored(targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mask [B, T], rows, steps) of the scored positions of teacher-forced targets (row-major): steps = the
    index of each predicted token among its row's generated tokens (0 = the first speech token)."""
    mask = targets != IGNORE_INDEX
    steps = mask.long().cumsum(1) - 1
    rows = torch.arange(targets.shape[0], device=targets.device).unsqueeze(1).expand_as(targets)
    return mask, rows[mask], steps[mask]


def teacher_forced(model: Any, batch: dict, taps: tuple[int, ...] = ()):
    """A target's (or a layer draft's) teacher-forced (logits [B, T, V], targets [B, T], features or None)."""
    return model.teacher_forced(batch["text_ids"], batch["text_lens"], batch["speech_tokens"], batch["speech_lens"],
                                taps)  # fmt: skip


def model_outputs(model: Any, batch: dict, teacher: Any = None) -> TrainingOutputs:
    """TrainingOutputs of a model trained at its own positions (a target, a layer-subset draft): its logits at
    every scored position, and the teacher's at the same positions (no gradient)."""
    logits, targets, _ = teacher_forced(model, batch)
    mask, rows, steps = scored(targets)
    teacher_logits = None
    if teacher is not None:
        with torch.no_grad():
            teacher_logits = teacher_forced(teacher, batch)[0][mask].float()
    return TrainingOutputs(logits[mask].float(), targets[mask], teacher_logits, rows, steps)
