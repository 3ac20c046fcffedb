#!/usr/bin/env python
"""Build the toy world (ssd.toy_world.STAGES: corpus, codec, tokens, target, draft, summary) idempotently.

  python scripts/build_toy_world.py                        # default size into ${paths.data_dir}/toy
  python scripts/build_toy_world.py toy_world=micro        # seconds; what the tests build
  python scripts/build_toy_world.py paths.data_dir=/work/toydata toy_world.codec.codebook_size=512

A stage whose inputs are unchanged is skipped; an interrupted one is redone from scratch.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# MKL's default (MKL_DYNAMIC) may use fewer threads when the machine is loaded, which changes the float
# summation order and so trained weights; a fixed thread count makes results independent of machine load.
os.environ.setdefault("MKL_DYNAMIC", "FALSE")

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from ssd.toy_world import build_toy_world  # noqa: E402


@hydra.main(config_path="../configs", config_name="build_toy_world", version_base="1.3")
def main(cfg: DictConfig) -> None:
    build_toy_world(cfg.toy_world, cfg.toy_world.dir, progress=bool(cfg.progress))


if __name__ == "__main__":
    main()
