"""Hydra callback of a sweep: when the multirun starts, mark its dir and make every job's dir its own; when it
ends, aggregate the jobs into tables and figures."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

log = logging.getLogger(__name__)

EXCLUDE_KEYS = "hydra.job.config.override_dirname.exclude_keys"


def swept_keys(config: DictConfig) -> list[str]:
    """The keys a multirun varies (a sweep on the command line, or `hydra.sweeper.params`), in order."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = [f"{k}={v}" for k, v in (config.hydra.sweeper.get("params") or {}).items()]
    overrides = OverridesParser.create().parse_overrides([*params, *config.hydra.overrides.task])
    return list(dict.fromkeys(o.key_or_group for o in overrides if o.is_sweep_override()))


class AggregateOnMultirunEnd(Callback):
    """At the start: the sweep dir is marked as a sweep (`ssd.files.mark_kind`: no single run or training
    writes into it), and a key the sweep varies is taken out of `exclude_keys`, so that it names its jobs'
    dirs (`draft.checkpoint=a.pt,b.pt` gives two dirs, not one that both jobs write). At the end: runs
    `ssd.evaluation.report.aggregate` on the sweep dir and prints the markdown table."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from ssd.config_files import override_value
        from ssd.files import mark_kind, run_dir_path

        try:
            sweep_dir = run_dir_path(config.hydra.sweep.dir)
            sweep_dir.mkdir(parents=True, exist_ok=True)
            mark_kind(sweep_dir, "sweep")
        except (FileExistsError, ValueError) as err:
            raise SystemExit(str(err)) from None  # Hydra turns a callback's Exception into a warning
        exclude = list(config.hydra.job.config.override_dirname.exclude_keys)
        hidden = [k for k in swept_keys(config) if k in exclude]
        if hidden:
            kept = [k for k in exclude if k not in hidden]
            log.info(
                "the sweep varies %s: these name its jobs' dirs too (else its jobs would share one)", hidden
            )
            # Every job is composed from the master's hydra overrides plus its own (a later override wins).
            config.hydra.overrides.hydra.append(f"{EXCLUDE_KEYS}={override_value(kept)}")
            config.hydra.job.config.override_dirname.exclude_keys = kept

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
            first = table["note"].dropna().iloc[0] if "note" in table else "unknown"
            # Nothing succeeded: exit non-zero. SystemExit, because Hydra turns a callback's Exception
            # into a warning.
            raise SystemExit(f"every job of the sweep in {sweep_dir} failed; the first error: {first}")
