"""The project's config files as data: the option names of a config group and one option's node, read from
the configs shipped in the package (`ssd.configs`). No Hydra composition here (that is `ssd.config`), so any
layer may read them."""

from __future__ import annotations

from importlib import resources
from typing import Any

from omegaconf import OmegaConf

CONFIG_MODULE = "ssd.configs"


def group_options(group: str) -> list[str]:
    """The option names of a config group (`experiment` -> ['draft_training', 'exactness', ...])."""
    folder = resources.files(CONFIG_MODULE).joinpath(group)
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir()
                  if p.name.endswith(".yaml") and not p.name.startswith("_"))  # fmt: skip


def option_node(group: str, option: str, **values: Any) -> dict:
    """configs/<group>/<option>.yaml as a plain dict, with `values` set (for tools outside Hydra, e.g. the
    shard preparation script: `option_node("speech_tokenizer", "toy", path=...)`)."""
    if option not in group_options(group):
        raise ValueError(f"unknown {group} {option!r}: choose one of {group_options(group)}")
    text = resources.files(CONFIG_MODULE).joinpath(group, f"{option}.yaml").read_text()
    node = OmegaConf.create(text)
    node.merge_with(values)
    return OmegaConf.to_container(node, resolve=True)
