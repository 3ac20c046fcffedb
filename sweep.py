"""Evaluate decoding settings: `python sweep.py -m beta=0,0.2,0.4 draft_len=2,3,4`.

A thin Hydra entry point; the work is in ssd.evaluation.runner (configs/sweep.yaml documents the keys).
A multirun job that is not its own baseline also runs (once) the matching AR baseline into
<sweep dir>/baselines/, so the table at the end has the speedup and ΔWER vs AR of every setting.
On a fresh clone the toy world that the default target reads is built first (once, announced).
"""

from __future__ import annotations

import os

# MKL's default (MKL_DYNAMIC) may use fewer threads when the machine is loaded, which changes the float
# summation order and so trained weights; a fixed thread count makes results independent of machine load.
os.environ.setdefault("MKL_DYNAMIC", "FALSE")

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from ssd.evaluation.baselines import run_job  # noqa: E402
from ssd.evaluation.settings import RunSettings  # noqa: E402
from ssd.toy_world import ensure_built  # noqa: E402


@hydra.main(config_path="configs", config_name="sweep", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        RunSettings.from_config(cfg)
    except ValueError:
        pass  # run_job reports it (in a multirun: this job's error.json); nothing is built for a bad config
    else:
        ensure_built(cfg, progress=bool(cfg.progress))
    run_job(cfg)


if __name__ == "__main__":
    main()
