"""The one rule for W&B's mode, shared by training (Lightning's WandbLogger) and evaluation (the run mirror):
online only with a key (WANDB_API_KEY) or an explicit choice, so nothing ever waits on a login prompt."""

from __future__ import annotations

import os


def wandb_mode(offline: bool | None = None, mode: str | None = None) -> str:
    """ "online" | "offline" | "disabled": an explicit `mode` or `offline` setting wins, then WANDB_MODE,
    then online exactly when a WANDB_API_KEY is set."""
    if mode:
        return mode
    if offline is not None:
        return "offline" if offline else "online"
    env = os.environ.get("WANDB_MODE", "").lower()
    if env:
        return "offline" if env == "dryrun" else env
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"
