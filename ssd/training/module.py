"""One LightningModule that trains any drafter (or the target itself) from teacher-forced outputs.

`outputs(batch, teacher) -> ssd.contracts.TrainingOutputs` gives the trained model's logits at its scored
predictions, the data's labels and the frozen target's logits for the same predictions: a drafter's own
`training_outputs` (heads predict several positions ahead, a layer draft the next one), or
`ssd.drafters.base.model_outputs` for a model trained at its own positions (the target, in CosyVoice 2's
layout: docs/targets.md §2.2). Loss: cross-entropy over the scored predictions (speech tokens + EOS), summed
and divided by their number. With a frozen teacher (the target) and kd_weight w > 0:

    loss = (1 - w)·CE + w·T²·KL(q_T || p_T)        q = target, p = the trained model, at temperature T

(T² keeps the gradient scale independent of T, as in Hinton et al.). KL(target || draft) because
the draft's job is to put mass where the target does: that is what acceptance Σ min(p, q) rewards.

Only parameters with requires_grad enter the optimizer; frozen modules are kept in eval mode and
their tensors are never written. Checkpoints (Lightning's last.ckpt) hold only the trainable tensors,
so a draft of a 0.5 B target resumes from a few MB, not from a second copy of the target.

Logged (train/ per step and epoch, dev/ per validation): loss, ce, kl, acc (token accuracy vs the
data); on dev with a teacher also top1_agreement (argmax match with the target), alpha_softmax
(mean Σ_x min(p, q) with p, q = softmax of the logits) and, when a SamplingConfig is given,
alpha_target_sampling (the same with both laws passed through the target's sampling transform
`ssd.decoding.sampling.distribution`: the α the engine would see with the draft sampling like the
target, windows and min_len taken from the teacher-forced tokens).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from ssd.contracts import TrainingOutputs
from ssd.decoding.sampling import SamplingConfig, distribution
from ssd.training.schema import OptimConfig

log = logging.getLogger(__name__)

DEV_AGREEMENT_KEYS = ("top1_agreement", "alpha_softmax", "alpha_target_sampling")


class SpeechLMTrainingModule(L.LightningModule):
    """Trains `model`'s trainable parameters; `teacher` (frozen) enables KD and dev agreement."""

    def __init__(
        self,
        model: nn.Module,
        teacher: nn.Module | None = None,
        *,
        outputs: Callable[[dict, nn.Module | None], TrainingOutputs] | None = None,
        optim: OptimConfig | None = None,
        max_steps: int = 1000,
        kd_weight: float = 0.0,
        kd_temperature: float = 1.0,
        agreement_sampling: SamplingConfig | None = None,
    ) -> None:
        """outputs: the model's teacher-forced outputs (default: its own `training_outputs`)."""
        super().__init__()
        self.outputs = outputs or getattr(model, "training_outputs", None)
        if self.outputs is None:
            raise TypeError(
                f"{type(model).__name__} has no training_outputs(batch, teacher): give the module `outputs=` "
                "(ssd.drafters.base.model_outputs for a model trained at its own positions)"
            )
        if kd_weight > 0 and teacher is None:
            raise ValueError("kd_weight > 0 needs a teacher (the frozen target)")
        if not 0.0 <= kd_weight <= 1.0 or kd_temperature <= 0:
            raise ValueError(
                f"kd_weight must be in [0, 1] and kd_temperature > 0, got {kd_weight}, {kd_temperature}"
            )
        self.model = model
        self.teacher = teacher
        if teacher is not None:
            teacher.requires_grad_(False)
        if not any(p.requires_grad for p in model.parameters()):
            raise ValueError(
                f"{type(model).__name__} has no trainable parameters (check the draft's `trainable` list)"
            )
        self.optim = optim or OptimConfig()
        self.max_steps = max_steps
        self.kd_weight, self.kd_temperature = kd_weight, kd_temperature
        vocab = getattr(model, "vocab_size", None)
        if (
            agreement_sampling is not None
            and vocab is not None
            and any(t >= vocab for t in agreement_sampling.stop_tokens)
        ):
            raise ValueError(
                f"sampling stop_tokens {list(agreement_sampling.stop_tokens)} do not fit the model's head of {vocab} "
                "entries: build the SamplingConfig with the target's own stop_tokens"
            )
        if agreement_sampling is not None and agreement_sampling.whole_context:
            # Teacher-forced dev rows carry no prompt ids, so a whole-context law (repetition penalty) cannot be
            # evaluated as the engine applies it: dev alpha_target_sampling is measured without the penalty.
            log.warning(
                "dev/alpha_target_sampling is measured without sampling.repetition_penalty=%s (the dev batches "
                "hold no prompt ids); the decoding runs apply it",
                agreement_sampling.repetition_penalty,
            )
            agreement_sampling = replace(agreement_sampling, repetition_penalty=None)
        self.agreement_sampling = agreement_sampling
        # Lightning loads last.ckpt, which holds only the trainable tensors (on_save_checkpoint).
        self.strict_loading = False
        self._dev_sums: dict[str, torch.Tensor] = {}  # key -> [sum of value x tokens, tokens]

    # --- modes and checkpoints -------------------------------------------------------------------
    def train(self, mode: bool = True) -> SpeechLMTrainingModule:
        """Train mode for modules with something to train; frozen ones (and the teacher) stay in eval."""
        super().train(mode)
        if mode:
            for module in self.model.modules():
                params = list(module.parameters())
                if params and not any(p.requires_grad for p in params):
                    module.training = False
            if self.teacher is not None:
                self.teacher.eval()
        return self

    def on_train_start(self) -> None:
        # Lightning 2.x keeps the modes modules come in with (build_draft returns eval): set ours.
        self.train()

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The tensors that training changes, under their LightningModule state-dict keys."""
        return {f"model.{k}": p for k, p in self.model.named_parameters() if p.requires_grad}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["state_dict"] = {k: v.detach() for k, v in self.trainable_state_dict().items()}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        expected, found = set(self.trainable_state_dict()), set(checkpoint.get("state_dict", {}))
        if expected != found:
            missing, extra = sorted(expected - found), sorted(found - expected)
            raise ValueError(
                "checkpoint does not hold this model's trainable tensors (different draft recipe or "
                f"train_target setting?): missing {missing[:5]}, unexpected {extra[:5]}"
            )

    # --- optimisation ----------------------------------------------------------------------------
    def configure_optimizers(self) -> dict[str, Any]:
        from transformers import get_scheduler

        params = [p for p in self.model.parameters() if p.requires_grad]
        opt = self.optim
        optimizer = torch.optim.AdamW(
            params, lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps, weight_decay=opt.weight_decay
        )
        name, extra = {"cosine": ("cosine_with_min_lr", {"min_lr_rate": opt.min_lr_ratio}),
                       "linear": ("linear", None), "constant": ("constant_with_warmup", None)}[opt.schedule]  # fmt: skip
        scheduler = get_scheduler(
            name, optimizer, num_warmup_steps=opt.warmup_steps, num_training_steps=self.max_steps,
            scheduler_specific_kwargs=extra,
        )  # fmt: skip
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # --- the loss --------------------------------------------------------------------------------
    def kd_kl(self, teacher_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """T²·mean over positions of KL(softmax(t/T) || softmax(s/T))."""
        t = self.kd_temperature
        log_p = F.log_softmax(logits / t, dim=-1)
        log_q = F.log_softmax(teacher_logits / t, dim=-1)
        return F.kl_div(log_p, log_q, log_target=True, reduction="batchmean") * t * t

    def compute(self, batch: dict, with_teacher: bool) -> dict[str, torch.Tensor]:
        """Loss terms and data accuracy (+ teacher logits when asked), averaged over scored predictions."""
        scored = self.outputs(batch, self.teacher if with_teacher else None)
        logits, labels = scored.logits.float(), scored.labels
        if labels.numel() == 0:
            raise ValueError(f"batch {batch['utt'][:3]}... has no scored positions")
        ce = F.cross_entropy(logits, labels, reduction="sum") / labels.numel()
        out = {
            "ce": ce,
            "acc": (logits.argmax(-1) == labels).float().mean(),
            "logits": logits,
            "labels": labels,
            "scored": scored,
        }
        kl = None
        if scored.teacher is not None:
            out["teacher_logits"] = scored.teacher
            kl = self.kd_kl(scored.teacher, logits)
            out["kl"] = kl
        out["loss"] = (
            ce if self.kd_weight == 0 or kl is None else (1 - self.kd_weight) * ce + self.kd_weight * kl
        )
        return out

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        out = self.compute(batch, with_teacher=self.kd_weight > 0)
        n = out["labels"].numel()
        for key in ("loss", "ce", "kl", "acc"):
            if key in out:
                self.log(
                    f"train/{key}",
                    out[key],
                    on_step=True,
                    on_epoch=True,
                    prog_bar=key == "loss",
                    batch_size=n,
                )
        if not torch.isfinite(out["loss"]):  # a diverged run must stop, not export NaN weights
            raise FloatingPointError(
                f"training diverged: loss {out['loss'].item()} at step {self.global_step} (batch {batch['utt'][:3]}): "
                f"lower optim.lr (now {self.optim.lr}) or check the data; nothing was exported"
            )
        return out["loss"]

    # --- dev ----------------------------------------------------------------------------------------
    def validation_step(self, batch: dict, batch_idx: int) -> None:
        out = self.compute(batch, with_teacher=True)
        n = out["labels"].numel()
        values = {k: out[k] for k in ("loss", "ce", "kl", "acc") if k in out}
        if "teacher_logits" in out:
            values.update(self.agreement(out["logits"], out["teacher_logits"], out["scored"], batch))
        for key, value in values.items():
            total = self._dev_sums.setdefault(key, torch.zeros(2, dtype=torch.float64, device=value.device))
            total += torch.stack([value.detach().double() * n, total.new_tensor(n)])

    def on_validation_epoch_start(self) -> None:
        self._dev_sums = {}

    def on_validation_epoch_end(self) -> None:
        """Token-weighted means over the whole dev set, summed over ranks (not a mean of batch means)."""
        for key, total in sorted(self._dev_sums.items()):
            total = self.trainer.strategy.reduce(total, reduce_op="sum")
            self.log(f"dev/{key}", (total[0] / total[1]).float(), prog_bar=key in ("ce", "alpha_softmax"))
        self._dev_sums = {}

    def agreement(
        self, logits: torch.Tensor, teacher_logits: torch.Tensor, scored: TrainingOutputs, batch: dict
    ) -> dict[str, torch.Tensor]:
        """Per-batch means over positions of the draft-target agreement measures (see module doc)."""
        p, q = logits.softmax(-1), teacher_logits.softmax(-1)
        out = {
            "top1_agreement": (logits.argmax(-1) == teacher_logits.argmax(-1)).float().mean(),
            "alpha_softmax": torch.minimum(p, q).sum(-1).mean(),
        }
        cfg = self.agreement_sampling
        if cfg is not None:
            row_min_len = self.teacher.min_speech_tokens(batch["text_lens"].to(teacher_logits.device))
            window, step, min_len = self.sampling_context(
                batch, cfg.window, row_min_len, scored.rows, scored.steps
            )
            ps = distribution(cfg, logits, window, step, min_len)
            qs = distribution(cfg, teacher_logits, window, step, min_len)
            # Undefined where the law is: eos_mode="resample" before min_len with a nucleus of stop
            # tokens only (upstream raises after max_trials there). Such positions are left out.
            defined = torch.isfinite(ps).all(-1) & torch.isfinite(qs).all(-1)
            if defined.any():
                out["alpha_target_sampling"] = torch.minimum(ps, qs)[defined].sum(-1).mean()
        return out

    @staticmethod
    def sampling_context(
        batch: dict, window_size: int, row_min_len: torch.Tensor, rows: torch.Tensor, steps: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For every scored prediction (batch row `rows`, generated-token index `steps`): the last `window_size`
        teacher-forced speech tokens before it (-1 where fewer), its step and its row's min_len (`row_min_len`
        [B], the target's `min_speech_tokens` of the text)."""
        speech = batch["speech_tokens"]
        batch_rows, width = speech.shape
        padded = F.pad(speech, (window_size, 0), value=-1)  # step j's window = padded[j : j + W]
        windows = (
            padded.unfold(1, window_size, 1) if window_size else speech.new_empty(batch_rows, width + 1, 0)
        )
        return windows[rows, steps], steps, row_min_len.to(speech.device)[rows]
