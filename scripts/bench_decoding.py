"""Decoding benchmark: AR vs speculative decoding per rule and draft length, in one run.

Prints (never asserts) measured figures side by side:
  * per-call costs: target decode(1), target verify(k+1 rows), draft decode(1);
    c = draft/target step cost, v_k = verify(k+1)/decode(1);
  * AR tokens/s of this engine vs HF `generate` on the same weights;
  * per rule and L_d: tokens/s, LM time, alpha per position, tokens per target call,
    measured speedup vs AR and the speedup predicted from the measured alpha, c and v
    (docs/algorithms.md §1.4 with the verify cost measured instead of assumed = 1).

Random weights are fine for timing; their acceptance is meaningless, so the `synthetic`
rule (fixed alpha, labelled as such) sets the acceptance. Defaults: the docs/cpu-physics.md
probe size (12 layers, hidden 512) with a draft of target layers [0, 1, 11].

    python scripts/bench_decoding.py                       # CPU, default sizes
    python scripts/bench_decoding.py --preset cosyvoice2 --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from hydra.utils import instantiate  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from ssd.config import option_node  # noqa: E402
from ssd.decoding.generate import decode_ar, decode_speculative  # noqa: E402
from ssd.decoding.sampling import SamplingConfig  # noqa: E402
from ssd.models.cosyvoice2 import CosyVoice2LM, CosyVoice2Prompt  # noqa: E402
from ssd.models.draft import build_draft  # noqa: E402
from ssd.models.transformer import BackboneConfig  # noqa: E402

PRESETS = {
    # docs/cpu-physics.md's probe size: 37 M parameters, memory-bound on 2 CPU cores.
    "probe": dict(hidden=512, layers=12, heads=8, kv_heads=2, intermediate=1408, draft_layers="0,1,11"),
    # CosyVoice 2's LM shape (docs/targets.md §2.1) with the SSD paper's 8-layer draft.
    "cosyvoice2": dict(
        hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, draft_layers="0,1,18,19,20,21,22,23"
    ),
}


def build_models(args) -> tuple[CosyVoice2LM, CosyVoice2LM]:
    config = BackboneConfig(
        model_type="qwen2",
        vocab_size=args.text_vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        tie_word_embeddings=True,
    )
    target = CosyVoice2LM(config, args.speech_tokens)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        target.backbone.reset_parameters(generator, 0.02)
        for module in (target.llm_embedding, target.speech_embedding, target.llm_decoder):
            module.weight.normal_(0.0, 0.02, generator=generator)
    target = target.to(device=args.device, dtype=getattr(torch, args.dtype)).eval()
    target.backbone.init_rope(device=args.device)
    draft = build_draft(target, [int(i) for i in args.draft_layers.split(",")])
    return target, draft


def make_prompt(args) -> CosyVoice2Prompt:
    g = torch.Generator().manual_seed(1)
    text = torch.randint(0, args.text_vocab, (args.prompt_text,), generator=g).tolist()
    speech = torch.randint(
        0, args.speech_tokens, (args.prompt_len - args.prompt_text - 2,), generator=g
    ).tolist()
    return CosyVoice2Prompt(text_ids=[text], speech_ids=[speech], target_text_lens=[len(text)])


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_call(fn, device: str, repeats: int) -> float:
    """Median seconds of fn() over `repeats` runs (after one warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def step_costs(model, prompt, args, block_sizes) -> dict[int, float]:
    """Seconds per extend() of each block size at the prompt's context length."""
    cache, _ = model.prefill(prompt, max(block_sizes) + 8)
    costs = {}
    for k in block_sizes:
        tokens = torch.randint(0, args.speech_tokens, (1, k), device=args.device)

        def call(tokens=tokens, k=k):
            model.extend(cache, tokens)
            model.rollback(cache, k)

        costs[k] = time_call(call, args.device, args.repeats)
    return costs


def hf_generate_tokens_per_s(target: CosyVoice2LM, prompt, args, sampling: SamplingConfig) -> float:
    """HF `generate` on the same weights (Qwen2ForCausalLM over the speech vocabulary)."""
    from transformers import Qwen2ForCausalLM

    hf_config = target.backbone.config.to_hf()
    hf_config.vocab_size = target.vocab_size
    hf = Qwen2ForCausalLM(hf_config).to(device=args.device, dtype=getattr(torch, args.dtype)).eval()
    state = {
        f"model.{k}": v for k, v in target.backbone.state_dict().items() if not k.startswith("embed_tokens")
    }
    state["model.embed_tokens.weight"] = target.speech_embedding.weight
    state["lm_head.weight"] = target.llm_decoder.weight
    missing, _ = hf.load_state_dict(state, strict=False)
    assert not [m for m in missing if "rotary" not in m], missing
    embeds, _ = target.embed_prompt(prompt)
    kwargs = dict(
        inputs_embeds=embeds,
        attention_mask=torch.ones(embeds.shape[:2], dtype=torch.long, device=args.device),
        max_new_tokens=args.tokens,
        min_new_tokens=args.tokens,
        do_sample=True,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        pad_token_id=0,
    )
    with torch.no_grad():
        seconds = time_call(lambda: hf.generate(**kwargs), args.device, 1)
    return args.tokens / seconds


def expected_tokens(alphas: list[float]) -> float:
    """Expected tokens per round given per-position acceptance: 1 + sum_i prod_{j<=i} alpha_j."""
    total, run = 1.0, 1.0
    for a in alphas:
        run *= 0.0 if math.isnan(a) else a  # nan: position never reached
        total += run
    return total


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="probe")
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--layers", type=int)
    parser.add_argument("--heads", type=int)
    parser.add_argument("--kv-heads", type=int)
    parser.add_argument("--intermediate", type=int)
    parser.add_argument("--draft-layers", help="comma-separated target layers, e.g. 0,1,11")
    parser.add_argument("--speech-tokens", type=int, default=6561, help="speech_token_size (head = +3)")
    parser.add_argument("--text-vocab", type=int, default=1000)
    parser.add_argument("--prompt-len", type=int, default=200, help="context length at the start of decoding")
    parser.add_argument("--prompt-text", type=int, default=40)
    parser.add_argument("--tokens", type=int, default=100, help="tokens generated per measurement")
    parser.add_argument("--draft-lens", default="1,2,3,4,5")
    parser.add_argument("--rules", default="synthetic:0.6,synthetic:0.7,synthetic:0.8,exact")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--verify-rows",
        type=int,
        default=None,
        help="also run every setting with verify calls padded to this many rows",
    )
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--no-hf", action="store_true", help="skip the HF generate comparison")
    parser.add_argument("--json", type=Path, help="also write all figures to this JSON file")
    args = parser.parse_args()
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.threads:
        torch.set_num_threads(args.threads)

    console = Console(width=170)
    target, draft = build_models(args)
    prompt = make_prompt(args)
    # CosyVoice 2's sampler (RAS), no stop tokens so every run generates exactly --tokens.
    sampling = SamplingConfig(top_k=25, top_p=0.8, nucleus="cosyvoice", ras_window=10, ras_tau=0.1)
    n_params = sum(p.numel() for p in target.backbone.parameters()) / 1e6
    device_name = (
        torch.cuda.get_device_name() if args.device.startswith("cuda") else f"CPU x{torch.get_num_threads()}"
    )
    console.print(
        f"[bold]target[/] {args.layers} layers, hidden {args.hidden} ({n_params:.0f} M backbone params); "
        f"[bold]draft[/] layers [{args.draft_layers}]; {args.dtype} on {device_name}; context {args.prompt_len}"
    )

    paddings = [None] if args.verify_rows is None else [None, args.verify_rows]
    blocks = sorted({1, *[k + 1 for k in map(int, args.draft_lens.split(","))], 8, args.verify_rows or 1})
    target_cost = step_costs(target, prompt, args, blocks)
    draft_cost = step_costs(draft, prompt, args, [1, 2])
    c = draft_cost[1] / target_cost[1]
    costs = Table(title="per-call cost (median)")
    costs.add_column("rows fed")
    costs.add_column("target ms")
    costs.add_column("v = cost / decode(1)")
    for k in blocks:
        costs.add_row(str(k), f"{target_cost[k] * 1e3:.2f}", f"{target_cost[k] / target_cost[1]:.2f}")
    console.print(costs)
    console.print(
        f"draft decode(1) {draft_cost[1] * 1e3:.2f} ms, decode(2) {draft_cost[2] * 1e3:.2f} ms; c = {c:.3f}"
    )

    def run(fn) -> tuple[float, object]:
        fn()  # warm-up
        best = None
        for _ in range(3):
            result = fn()
            if best is None or result.stats.time_total < best.stats.time_total:
                best = result
        return best.stats.time_total, best

    ar_time, _ = run(
        lambda: decode_ar(
            target, prompt, sampling, max_len=args.tokens, generator=torch.Generator().manual_seed(0)
        )
    )
    ar_tps = args.tokens / ar_time
    figures = {"args": vars(args) | {"json": None}, "device": device_name, "c": c, "ar_tokens_per_s": ar_tps,
               "target_cost_s": target_cost, "draft_cost_s": draft_cost, "runs": []}  # fmt: skip
    line = f"AR (this engine): {ar_tps:.1f} tokens/s"
    if not args.no_hf:
        hf_tps = hf_generate_tokens_per_s(target, prompt, args, sampling)
        figures["hf_generate_tokens_per_s"] = hf_tps
        line += f"   HF generate, same weights: {hf_tps:.1f} tokens/s   ratio {ar_tps / hf_tps:.2f}x"
    console.print(line)

    table = Table(title="speculative decoding vs AR (same model, same run)")
    for col in ("rule", "L_d", "tokens/s", "LM s", "alpha per position", "tok/target call", "speedup", "predicted",
                "meas/pred"):  # fmt: skip
        table.add_column(col)
    for spec in args.rules.split(","):
        name, _, value = spec.partition(":")
        rule = instantiate(option_node("acceptance", name, **({"alpha": float(value)} if value else {})))
        label = f"{name} α={value} (SYNTHETIC)" if name == "synthetic" else name
        for k, rows in itertools.product(map(int, args.draft_lens.split(",")), paddings):
            if rows is not None and rows <= k + 1:
                continue
            seconds, result = run(
                lambda rule=rule, k=k, rows=rows: decode_speculative(
                    target,
                    draft,
                    prompt,
                    sampling,
                    rule,
                    draft_len=k,
                    max_len=args.tokens,
                    generator=torch.Generator().manual_seed(0),
                    verify_rows=rows,
                )  # fmt: skip
            )
            s = result.stats
            alphas = [a for a in s.alpha_per_position]
            # Per round: k draft calls (the first feeds 2 tokens after round 1) + one verify of k+1 rows.
            round_cost = draft_cost[2] + (k - 1) * draft_cost[1] + target_cost[rows or k + 1]
            predicted = expected_tokens(alphas) / round_cost * ar_time / args.tokens
            measured = ar_time / seconds
            table.add_row(
                label, f"{k}" + (f" (verify {rows} rows)" if rows else ""), f"{args.tokens / seconds:.1f}", f"{seconds:.3f}",
                " ".join("-" if math.isnan(a) else f"{a:.2f}" for a in alphas), f"{s.tokens_per_target_call:.2f}",
                f"{measured:.2f}x", f"{predicted:.2f}x", f"{measured / predicted:.2f}",
            )  # fmt: skip
            figures["runs"].append(dict(rule=label, draft_len=k, verify_rows=rows, seconds=seconds, alphas=alphas,
                                        speedup=measured, predicted=predicted,
                                        tokens_per_target_call=s.tokens_per_target_call))  # fmt: skip
    console.print(table)
    console.print(
        "predicted = E[tokens/round](measured α) x AR s/token / (draft(2) + (L_d-1) draft(1) + verify(L_d+1)), "
        "all costs measured above in this run."
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=2, default=str))


if __name__ == "__main__":
    main()
