"""Reproduce a paper table or figure with one command: `python scripts/reproduce.py <name>|all`.

An experiment is a Hydra config `configs/experiment/<name>.yaml` (`# @package _global_`): its
`hydra.sweeper.params` is the grid that `python sweep.py -m experiment=<name>` runs, and its `reproduce`
node tells the driver (`ssd.experiments.driver`) what else to do:

    reproduce:
      title: str                      # the summary's heading
      baseline: bool                  # also run decoding=ar into the same sweep dir (speedups)
      extra_grids: [{key: value}]     # further grids into the same sweep dir (e.g. exact rule, SSD betas)
      dev: [override, ...]            # the same grid(s) on a held-out split: choose the setting there
      match: {reference: {...}, candidates: {...}, by: speedup|acceptance_rate}   # pair rows (PCG vs SSD)
      study: <name in STUDIES>        # experiment-specific work (below), with its own keys
      paper: [{setting, lm_rtf, speedup, wer_pct, ...}]   # the paper's numbers (docs/algorithms.md §1), shown as is
      notes: str                      # where and why this run differs from the paper (a summary section)

A study is a function `study(experiment) -> StudyResult`, run after the experiment's test sweeps and
before its tables (`experiment` is a `driver.Experiment`: the config, the results dir, and how to run a
command or a sweep). It may add runs to the test sweep, write its own files into the results dir, and
return summary sections, figure names and per-run columns for the test table. Register one in STUDIES.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pandas as pd

if TYPE_CHECKING:
    from ssd.experiments.driver import Experiment


@dataclass
class StudyResult:
    """What a study adds to its experiment's results dir."""

    sections: list[str] = field(default_factory=list)  # summary.md sections (markdown), after the tables
    figures: list[str] = field(default_factory=list)  # files it wrote into the results dir, for the list
    columns: pd.DataFrame | None = None  # per-run columns (key "run") merged into the test table's csv


Study = Callable[["Experiment"], StudyResult]

# The modules below import StudyResult from here, so they come after it.
from ssd.experiments.acceptance_seeds import run_acceptance_seeds_study  # noqa: E402
from ssd.experiments.beta_audit import run_beta_audit_study  # noqa: E402
from ssd.experiments.draft_training import train_and_evaluate_drafts  # noqa: E402
from ssd.experiments.drafters import run_drafters_study  # noqa: E402
from ssd.experiments.exactness import run_exactness_study  # noqa: E402

# reproduce.study -> the study it names.
STUDIES: dict[str, Study] = {
    "exactness": run_exactness_study,
    "draft_training": train_and_evaluate_drafts,
    "beta_audit": run_beta_audit_study,
    "acceptance_seeds": run_acceptance_seeds_study,
    "drafters": run_drafters_study,
}
