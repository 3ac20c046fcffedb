"""What a run reads below `evaluate`, built once from the composed config: the typed eval settings, the
decoder, and the `_target_` nodes of the parts a run loads. Nothing below `evaluate` sees the whole config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from ssd.evaluation.schema import EvalConfig, validate_sweep_config

# The config nodes a run builds its parts from (None where unset).
PART_KEYS = ("target.model", "target.sampling", "draft", "acceptance", "speech_tokenizer", "vocoder", "asr", "sim",
             "mos", "perturb")  # fmt: skip


def instantiate_part(node: Any, key: str, **kwargs: Any) -> Any:
    """hydra's instantiate; a missing or unusable file (FileNotFoundError, ValueError from the loader) is
    re-raised as its own type, prefixed with the config key, so callers and users see what to fix."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        return instantiate(node, **kwargs)
    except InstantiationException as err:
        cause = err.__cause__
        if type(cause) in (FileNotFoundError, ValueError, FloatingPointError):
            raise type(cause)(f"{key}: {cause}") from err
        raise


@dataclass(frozen=True)
class RunSettings:
    """One run's settings. `decoder` is built (its own checks ran) but not bound to any model yet."""

    eval: EvalConfig
    decoder: Any  # ssd.contracts.Decoder
    parts: dict[str, Any]  # PART_KEYS -> config node (or None)
    labels: dict[str, Any]  # target, eval, split: what names the run besides its decoding setting
    seed: int
    progress: bool
    resolved: dict[
        str, Any
    ]  # the whole config, resolved, as plain data: the run's provenance and fingerprint

    @classmethod
    def from_config(cls, cfg: DictConfig) -> RunSettings:
        """Validate the whole config (ranges, part keys against their classes, the decoder's own checks), then
        build the settings; fails before any model loads."""
        from hydra.core.hydra_config import HydraConfig
        from hydra.utils import get_class

        if HydraConfig.initialized():
            from ssd.config_files import check_choices

            check_choices(cfg, HydraConfig.get().runtime.choices)  # an option that names no config file
        elif OmegaConf.is_interpolation(cfg, "output_dir") or "hydra" in cfg:
            cfg = cfg.copy()  # composed outside a Hydra run (the API, the experiment driver): no run dir yet
            with open_dict(cfg):
                cfg.pop("hydra", None)  # Hydra's own node resolves only inside a run
                if OmegaConf.is_interpolation(cfg, "output_dir"):
                    cfg.output_dir = None
        validate_sweep_config(cfg, tuple(get_class(cfg.decoding._target_).needs))
        decoder = instantiate_part(cfg.decoding, "decoding")
        return cls(
            eval=OmegaConf.to_object(cfg.eval),
            decoder=decoder,
            parts={key: OmegaConf.select(cfg, key) for key in PART_KEYS},
            labels={"target": cfg.target.name, "eval": cfg.eval.name, "split": cfg.eval.get("split")},
            seed=int(cfg.seed),
            progress=bool(cfg.get("progress", True)),
            resolved=OmegaConf.to_container(cfg, resolve=True),
        )
