"""`python train_draft.py` as a user runs it: subprocess, overrides, run dir, CSV + W&B offline files, typos."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from ssd.drafters.layers import load_draft
from ssd.models.cosyvoice2 import CosyVoice2LM

REPO = Path(__file__).resolve().parents[1]


def _run(args: list[str], tmp_path: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path / "wandb_dir"),
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    env.pop("WANDB_API_KEY", None)
    (tmp_path / "wandb_dir").mkdir(exist_ok=True)
    return subprocess.run([sys.executable, "train_draft.py", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


def _world_overrides(world, run_dir: Path) -> list[str]:
    return [
        f"target.model.model_dir={world['target']}",
        f"data.shard_dirs={world['shards']}",
        "data.max_tokens=200",
        f"hydra.run.dir={run_dir}",
    ]


def wandb_history_keys(run_file: Path) -> set[str]:
    """Keys of the history records in an offline run's .wandb file.

    Hand-written because wandb 0.31 ships no Python reader: the file is a 7-byte W&B header, then
    LevelDB log records (32 KiB blocks; each chunk = crc32, length, type 1 full / 2 first / 3 middle /
    4 last) holding protobuf `Record`s."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, pending, keys = run_file.read_bytes(), 32768, 7, b"", set()
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (length == 0 and kind == 0):  # block trailer / padding
            pos += left
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                keys |= {item.key or "/".join(item.nested_key) for item in record.history.item}
    return keys


def test_train_draft_cli_writes_draft_csv_and_wandb_offline_run(training_world, tmp_path):
    run_dir = tmp_path / "run"
    result = _run(
        [
            *_world_overrides(training_world, run_dir),
            "max_steps=6",
            "val_every_steps=3",
            "trainer.log_every_n_steps=2",
        ],
        tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout + result.stderr
    assert "draft dev alpha (sum min(p,q), softmax):" in out and "(before training:" in out
    assert "layers.0" in out and "trainable" in out  # describe(draft) printed at start

    draft = load_draft(run_dir / "draft.pt", CosyVoice2LM.from_dir(training_world["target"]))
    assert any(p.requires_grad for p in draft.parameters())
    metrics = pd.read_csv(run_dir / "csv" / "version_0" / "metrics.csv")
    for key in ("train/loss_step", "train/ce_step", "train/kl_step", "train/acc_step", "dev/alpha_softmax",
                "dev/alpha_target_sampling", "dev/top1_agreement", "dev/acc"):  # fmt: skip
        assert metrics[key].notna().any(), key
    assert metrics["step"].max() >= 5

    runs = list((tmp_path / "wandb_dir" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    keys = wandb_history_keys(next(runs[0].glob("*.wandb")))
    assert {
        "train/loss_step",
        "dev/alpha_softmax",
        "dev/alpha_target_sampling",
        "final/dev/alpha_softmax",
    } <= keys
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 6


@pytest.mark.parametrize(
    "override, message",
    [
        ("max_step=5", "Key 'max_step' not in 'TrainConfig'"),
        ("optim.lrr=1", "Key 'lrr' not in 'OptimConfig'"),
        ("trainer.max_epoch=3", "Key 'max_epoch' is not in struct"),
        ("+optim.lrr=1", "Key 'lrr' not in 'OptimConfig'"),
        ("max_steps=abc", "Value 'abc' of type 'str' could not be converted to Integer"),
    ],
)
def test_typo_override_fails_with_a_message_naming_the_key(override, message, tmp_path):
    result = _run([override, f"hydra.run.dir={tmp_path / 'run'}", "logger=none"], tmp_path, timeout=120)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_ddp_sim_trains_with_two_cpu_processes(training_world, tmp_path):
    run_dir = tmp_path / "ddp"
    args = [
        *_world_overrides(training_world, run_dir),
        "trainer=ddp_sim",
        "max_steps=4",
        "val_every_steps=2",
        "logger=csv",
    ]
    result = _run(args, tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "draft dev alpha" in result.stdout + result.stderr
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 4
    load_draft(run_dir / "draft.pt", CosyVoice2LM.from_dir(training_world["target"]))


def test_fsdp_config_builds_lightnings_strategy_with_per_layer_shards(training_world, tmp_path):
    """trainer=fsdp composes and every key reaches Lightning's FSDPStrategy (one shard unit per decoder
    layer, full-file checkpoints). Lightning runs FSDP on CUDA only, so it cannot be trained here: the
    same settings on CPU are refused by Lightning itself, which this also checks."""
    from hydra.utils import instantiate
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from ssd.models.transformer import DecoderLayer
    from tests.test_training import compose_train_config

    cfg = compose_train_config(training_world, tmp_path, "trainer=fsdp")
    strategy = instantiate(cfg.trainer.strategy)
    assert type(strategy).__name__ == "FSDPStrategy" and strategy._state_dict_type == "full"
    policy = strategy.kwargs["auto_wrap_policy"]
    assert isinstance(policy, ModuleWrapPolicy) and policy._module_classes == {DecoderLayer}
    assert strategy.kwargs["use_orig_params"] is True
    with pytest.raises(Exception, match="requires a GPU accelerator"):  # Hydra wraps the ValueError
        instantiate(cfg.trainer, accelerator="cpu", devices=1, precision="32-true")
