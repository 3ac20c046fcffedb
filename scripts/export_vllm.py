#!/usr/bin/env python
"""Export a CosyVoice-layout target LM (configs/target/) as the HF causal-LM dir a serving engine loads
(ssd/models/export.py: upstream CosyVoice's vLLM layout).

  python scripts/export_vllm.py --out /models/cv2_vllm target=cosyvoice2 target.model.model_dir=/models/CosyVoice2-0.5B
  python scripts/export_vllm.py --out data/toy/target_vllm                      # the toy target
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main(argv=None) -> Path:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="a new directory for the export")
    parser.add_argument("overrides", nargs="*", help="sweep.py overrides naming the target (target=..., ...)")
    args = parser.parse_args(argv)

    from hydra.utils import instantiate

    from ssd.config import compose
    from ssd.models.export import export_vllm

    cfg = compose("sweep", args.overrides)
    model = instantiate(cfg.target.model).eval()
    if not hasattr(model, "speech_embedding"):
        raise SystemExit(
            f"target={cfg.target.name}: only CosyVoice-layout LMs export this way (LLaSA is already a "
            "plain HF causal LM: serve its model dir as it is)"
        )
    out = export_vllm(model, args.out)
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
