"""Hydra callback: aggregate a sweep into tables and figures when the multirun ends."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

log = logging.getLogger(__name__)


class AggregateOnMultirunEnd(Callback):
    """Runs `ssd.evaluation.report.aggregate` on the sweep dir and prints the markdown table."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from ssd.evaluation.report import aggregate

        sweep_dir = Path(config.hydra.sweep.dir)
        try:
            table = aggregate(sweep_dir)
        except Exception as err:  # the jobs' results are on disk; a table problem must not hide them
            log.error("aggregating %s failed (%s: %s); rerun scripts/make_tables.py %s",
                      sweep_dir, type(err).__name__, err, sweep_dir)  # fmt: skip
            return
        print(f"\nSweep results ({sweep_dir / 'table.md'}):\n")
        print((sweep_dir / "table.md").read_text())
        if not (table["status"] == "ok").any():
            first = table["error"].dropna().iloc[0] if "error" in table else "unknown"
            # Nothing succeeded: exit non-zero. SystemExit, because Hydra turns a callback's Exception
            # into a warning.
            raise SystemExit(f"every job of the sweep in {sweep_dir} failed; the first error: {first}")
