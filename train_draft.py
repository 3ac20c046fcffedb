#!/usr/bin/env python
"""Train a draft (or the toy target) with Lightning: `python train_draft.py [target=toy] [key=value ...]`.

See configs/train_draft.yaml for the keys and ssd/training/train.py for what a run writes.
"""

from __future__ import annotations

import os

import hydra
from omegaconf import DictConfig

from ssd.config import register

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models load from local dirs only
register()  # the configs' schemas and resolvers


@hydra.main(config_path="configs", config_name="train_draft", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from ssd.training.train import train

    train(cfg)


if __name__ == "__main__":
    main()
