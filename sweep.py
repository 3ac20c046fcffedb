"""Evaluate decoding settings: `python sweep.py -m beta=0,0.2,0.4 draft_len=2,3,4`.

A thin Hydra entry point; the work is in ssd.evaluation.runner (configs/sweep.yaml documents the keys).
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from ssd.evaluation.runner import run_job


@hydra.main(config_path="configs", config_name="sweep", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_job(cfg)


if __name__ == "__main__":
    main()
