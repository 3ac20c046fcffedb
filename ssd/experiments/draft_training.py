"""The draft-training study (`reproduce.study: draft_training`): train draft variants, evaluate each.

`reproduce.train.variants` maps a variant name to train_draft.yaml overrides (`reproduce.train.common`
apply to every variant). Each variant is trained with `train_draft.py` into runs/train/<variant>
(skipped when its metrics.json and draft.pt exist), then evaluated with the experiment's sweep
(decoding=speculative, the variant's draft.* keys and its checkpoint) into runs/test/<variant>.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from ssd.config_files import as_overrides, merge_overrides, override_key
from ssd.evaluation.tables import build_table, to_markdown
from ssd.experiments import StudyResult

if TYPE_CHECKING:
    from ssd.experiments.driver import Experiment

log = logging.getLogger(__name__)

SHOWN = ("run", "draft.trainable", "kd_weight", "train steps", "dev alpha before", "dev alpha after",
         "dev alpha (target sampling) after", "acceptance_rate", "speedup", "wer")  # fmt: skip


def train_and_evaluate_drafts(experiment: Experiment) -> StudyResult:
    """Train and evaluate every variant; the test table gets one row of training metrics per variant.
    train_draft.py gets the experiment's `train.common`, then the driver's train overrides, then the
    variant's settings (later ones win)."""
    spec = experiment.cfg.reproduce.train
    runs = experiment.runs
    common = as_overrides(spec.common)
    rows = []
    for variant, settings in spec.variants.items():
        variant_overrides = as_overrides(settings)
        train_dir = runs / "train" / variant
        if not ((train_dir / "metrics.json").is_file() and (train_dir / "draft.pt").is_file()):
            argv = [sys.executable, experiment.script("train_draft.py"),
                    *merge_overrides(common, experiment.train_world, variant_overrides),
                    f"hydra.run.dir={train_dir}"]  # fmt: skip
            experiment.run(argv, f"train_{variant}")
        else:
            log.info("%s: training %s already finished", experiment.name, variant)
        metrics = json.loads((train_dir / "metrics.json").read_text())
        draft_keys = [o for o in variant_overrides if override_key(o).startswith("draft.")]
        experiment.sweep(runs / "test", ["hydra.sweeper.params=null", "decoding=speculative", *draft_keys,
                                         f"draft.checkpoint={train_dir / 'draft.pt'}",
                                         f"hydra.sweep.subdir={variant}"])  # fmt: skip
        rows.append({
            "run": variant, **{override_key(o): o.split("=", 1)[1] for o in variant_overrides},
            "train steps": metrics.get("global_step"),
            "dev alpha before": metrics.get("before/dev/alpha_softmax"),
            "dev alpha after": metrics.get("dev/alpha_softmax"),
            "dev alpha (target sampling) after": metrics.get("dev/alpha_target_sampling"),
            "dev top-1 agreement after": metrics.get("dev/top1_agreement"),
        })  # fmt: skip
    variants = pd.DataFrame(rows)

    test = build_table(runs / "test").merge(variants, on="run", how="left")
    shown = (
        test[test["status"] == "ok"][[c for c in SHOWN if c in test]]
        .assign(wer=lambda t: t["wer"] * 100)
        .rename(columns={"wer": "WER %"})
    )
    shown = shown.map(lambda v: "-" if v is None or (isinstance(v, float) and np.isnan(v)) else
                      f"{v:.3f}" if isinstance(v, float) else v)  # fmt: skip
    section = (
        "## Draft variants (trained with train_draft.py, evaluated on the split above)\n\n"
        + to_markdown(shown)
    )
    return StudyResult(sections=[section], columns=variants)
