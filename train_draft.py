#!/usr/bin/env python
"""Train a draft (or the toy target) with Lightning: `python train_draft.py [target=toy] [key=value ...]`.

See configs/train_draft.yaml for the keys and ssd/training/train.py for what a run writes. On a fresh
clone the toy world that the default target and data read is built first (once, announced).
"""

from __future__ import annotations

import os

# MKL's default (MKL_DYNAMIC) may use fewer threads when the machine is loaded, which changes the float
# summation order and so trained weights; a fixed thread count makes results independent of machine load.
os.environ.setdefault("MKL_DYNAMIC", "FALSE")

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from ssd.config import register  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models load from local dirs only
register()  # the configs' schemas and resolvers


@hydra.main(config_path="configs", config_name="train_draft", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from ssd.toy_world import ensure_built
    from ssd.training.schema import validate_train_config
    from ssd.training.train import train

    validate_train_config(cfg)  # a typo must fail now, not after building a missing toy world
    ensure_built(cfg)
    train(cfg)


if __name__ == "__main__":
    main()
