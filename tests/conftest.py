"""Shared test setup: offline everything, GPU tests skipped without a GPU, and the shared fixtures.

Shared fixtures live in the fixture modules below, next to their builders; registering them here makes
them visible to every test by parameter name (never import a fixture into a test module):

- tests/fixtures_models.py: `tiny_cosyvoice2_dir`, `tiny_cosyvoice3_dir`, `tiny_llasa_dir` (session)
- tests/fixtures_eval.py: `micro_world` (session; the micro toy world for evaluation)
- tests/fixtures_training.py: `training_world` (session; tiny target + micro token shards)
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

pytest_plugins = ["tests.fixtures_models", "tests.fixtures_eval", "tests.fixtures_training"]

import pytest  # noqa: E402
import torch  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs a worker per core; torch threads of two workers competing for the cores slow both
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
