"""The project's config files as data: the option names of a config group and one option's node, read from
the configs shipped in the package (`ssd.configs`); whether a composed config names options that exist; config
values as override strings. No Hydra composition here (that is `ssd.config`), so any layer may use them."""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from importlib import resources
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

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


def check_choices(cfg: DictConfig, choices: Mapping[str, str | None]) -> None:
    """Refuse a config group option that does not exist (`asr=whispr`): Hydra skips a missing option of an
    `optional` defaults entry without a word. A group's default named after the target (`asr: ${target}`) is
    left to the run's own check, which says which group to choose. Needs an initialized Hydra (inside an app
    or `compose`); a no-op elsewhere."""
    from hydra.core.global_hydra import GlobalHydra

    if not GlobalHydra.instance().is_initialized():
        return
    loader = GlobalHydra.instance().config_loader()
    target = OmegaConf.select(cfg, "target.name", default=None)
    problems = []
    for group, option in choices.items():
        if group.startswith("hydra") or option is None or option == target:
            continue
        valid = loader.get_group_options(group)
        if valid and option not in valid:
            close = difflib.get_close_matches(option, valid, n=1)
            guess = f" did you mean {group}={close[0]}?" if close else ""
            problems.append(f"{group}={option}: no such option (no configs/{group}/{option}.yaml);{guess} "
                            f"choose one of {valid}")  # fmt: skip
    if problems:
        raise ValueError("; ".join(problems))


# ---- override strings ------------------------------------------------------------------------------


def override_key(override: str) -> str:
    """'eval.n_utts=4' -> 'eval.n_utts'; '+x=1' -> 'x'; '~x' -> 'x'."""
    return override.split("=", 1)[0].lstrip("+~")


def override_value(value: Any) -> str:
    """A config value as Hydra override text (lists as [a,b], None as null)."""
    if isinstance(value, (ListConfig, DictConfig)):
        value = OmegaConf.to_container(value, resolve=True)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(override_value(v) for v in value) + "]"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def as_overrides(values: Any) -> list[str]:
    """{key: value} (a config node or dict) as `key=value` overrides."""
    plain = OmegaConf.to_container(values, resolve=True) if isinstance(values, DictConfig) else values
    return [f"{k}={override_value(v)}" for k, v in (plain or {}).items()]


def merge_overrides(*groups: Sequence[str]) -> list[str]:
    """Concatenate override lists; for a key given twice the later one wins (Hydra refuses duplicates)."""
    merged: dict[str, str] = {}
    for group in groups:
        for override in group:
            merged.pop(override_key(override), None)
            merged[override_key(override)] = override
    return list(merged.values())
