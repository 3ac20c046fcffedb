"""A sweep dir's report: its table (`ssd.evaluation.tables`) and figures (`ssd.evaluation.figures`), written
beside its runs (`python scripts/make_tables.py <sweep dir>`, and at the end of every multirun)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from ssd.evaluation.figures import write_figures
from ssd.evaluation.tables import build_table, write_table


def aggregate(
    sweep_dir: str | Path, baseline_dir: str | Path | None = None, figures: bool = True
) -> pd.DataFrame:
    """Write table.{md,tex,csv} (+ figures) into `sweep_dir`; returns the full numeric table."""
    table = build_table(sweep_dir, baseline_dir)
    write_table(table, sweep_dir, "table")
    if figures:
        write_figures(table, Path(sweep_dir))
    return table
