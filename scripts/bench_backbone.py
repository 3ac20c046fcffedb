"""Backbone speed: our static-cache decoder vs HF Qwen2Model + DynamicCache, same run, side by side.

Random Qwen2 target (12 layers, hidden 512) and draft (4 layers), fp32, context 200 tokens, plus
a 6564-row speech head. For k = 1..8 it times decode(1) / verify(k) (k tokens in one forward,
then rolled back). The two implementations share weights and their steps alternate, so both see
the same machine load; the table shows best and median ms and the measured ratios.

    python scripts/bench_backbone.py [--threads 2] [--repeats 20] [--context 200]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1])
)  # the checkout this script is in, not an installed ssd
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from ssd.models.backbone_config import BackboneConfig  # noqa: E402
from ssd.models.transformer import Backbone  # noqa: E402

HEAD_ROWS = 6564


def make_config(num_layers: int) -> BackboneConfig:
    return BackboneConfig(
        model_type="qwen2", vocab_size=1000, hidden_size=512, intermediate_size=1536, num_layers=num_layers,
        num_heads=8, num_kv_heads=2, head_dim=64, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )  # fmt: skip


def timed_ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return 1000 * (time.perf_counter() - start)


@torch.no_grad()
def bench_pair(config: BackboneConfig, context: int, ks, repeats: int) -> dict[str, dict[int, list[float]]]:
    from transformers import DynamicCache, Qwen2Model

    ours = Backbone(config).eval()
    hf_config = config.to_hf()
    hf_config._attn_implementation = "sdpa"
    hf = Qwen2Model(hf_config).eval()
    hf.load_state_dict(ours.state_dict(), strict=True)
    head = torch.nn.Linear(config.hidden_size, HEAD_ROWS)
    prompt = torch.randn(1, context, config.hidden_size)
    our_cache = ours.new_cache(1, context + max(ks) + 1)
    ours.forward_cached(prompt, our_cache)
    hf_cache = DynamicCache(config=hf_config)
    hf(inputs_embeds=prompt, cache=hf_cache, use_cache=True)
    times: dict[str, dict[int, list[float]]] = {"ours": {}, "hf": {}}
    for k in ks:
        x = torch.randn(1, k, config.hidden_size)

        def our_step(x=x, k=k):
            head(ours.forward_cached(x, our_cache))
            our_cache.rollback(k)

        def hf_step(x=x, k=k):
            head(hf(inputs_embeds=x, cache=hf_cache, use_cache=True).last_hidden_state)
            hf_cache.crop(-k)

        our_step(), hf_step()  # warm-up
        times["ours"][k], times["hf"][k] = [], []
        for _ in range(repeats):
            times["ours"][k].append(timed_ms(our_step))
            times["hf"][k].append(timed_ms(hf_step))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--context", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    ks = list(range(1, 9))
    table = Table(
        title=f"ms per forward: best / median of {args.repeats} interleaved runs, context {args.context}, "
        f"{args.threads} threads"
    )
    columns = ("model", "k", "ours best", "HF best", "ours median", "HF median", "HF/ours best",
               "ours verify(k)/decode(1)")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="right")
    for name, layers in (("target 12L", 12), ("draft 4L", 4)):
        times = bench_pair(make_config(layers), args.context, ks, args.repeats)
        best = {impl: {k: min(v) for k, v in per_k.items()} for impl, per_k in times.items()}
        median = {impl: {k: statistics.median(v) for k, v in per_k.items()} for impl, per_k in times.items()}
        for k in ks:
            table.add_row(
                name, str(k), f"{best['ours'][k]:.1f}", f"{best['hf'][k]:.1f}", f"{median['ours'][k]:.1f}",
                f"{median['hf'][k]:.1f}", f"{best['hf'][k] / best['ours'][k]:.2f}",
                f"{best['ours'][k] / best['ours'][1]:.2f}",
            )  # fmt: skip
        table.add_section()
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
