"""Acceptance-step benchmark: one verification's acceptance step for every rule (`rule.verify` on B rows of
L_d draft tokens, plus PCG's `settle` for the rows its thinning left), at the vocabularies of the toy target
(V = 1027), CosyVoice 2 (6564) and LLaSA's full head (193,800), batch 1 and 8, next to one target decode(1)
call of a random-weight model of that shape (docs/benchmarks.md).

The laws are what the verifier sees: CosyVoice 2's top-k 25 / top-p 0.8 law of random logits for q, and of the
same logits plus noise for the draft's p (acceptance about 0.6); PCG's groups are consecutive blocks of a given
size (`Groups.blocks`: every token in as many groups as its block has members, as cosine groups are).

    python scripts/bench_acceptance.py --out experiments/results/bench_acceptance
    python scripts/bench_acceptance.py --vocabs toy --batches 1 --repeats 3 --no-target --out /tmp/acc
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_decoding as bench  # noqa: E402  (the shapes, random models, timing and machine helpers)

from ssd.contracts import SettlingRule  # noqa: E402
from ssd.decoding.acceptance import (  # noqa: E402
    ExactRule,
    GreedyRule,
    TargetOnlyRule,
    ToleranceRule,
    TypicalRule,
)
from ssd.decoding.pcg import Groups, PCGRule  # noqa: E402
from ssd.decoding.rng import RowRandom  # noqa: E402
from ssd.decoding.sampling import distribution  # noqa: E402
from ssd.decoding.sequences import UNSETTLED  # noqa: E402
from ssd.files import write_atomic  # noqa: E402


def rules(vocab: int, group_sizes: list[int]) -> list[tuple[str, object]]:
    """Every rule of the engine; PCG once per group size (its groups: consecutive blocks)."""
    out = [("exact", ExactRule()), ("tolerance β=0.4", ToleranceRule(0.4)), ("greedy", GreedyRule()),
           ("target_only", TargetOnlyRule()), ("typical", TypicalRule())]  # fmt: skip
    for size in group_sizes:
        rule = PCGRule()
        rule.groups, rule.speech_tokens = (
            Groups.blocks(vocab, size),
            vocab,
        )  # groups given, not built from vectors
        out.append((f"pcg, mean group {float(rule.groups.sizes.float().mean()):.1f}", rule))
    return out


def laws(vocab: int, batch: int, k: int, seed: int = 0):
    """(p [B, k, V], q [B, k + 1, V], x [B, k]): q of random logits, p of the same plus noise, x ~ p."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, k + 1, vocab, generator=g) * 2.0
    law = bench.COSYVOICE_LAW
    q = distribution(law, logits.reshape(-1, vocab)).reshape(batch, k + 1, vocab)
    noisy = logits[:, :k] + torch.randn(batch, k, vocab, generator=g)
    p = distribution(law, noisy.reshape(-1, vocab)).reshape(batch, k, vocab)
    x = torch.multinomial(p.reshape(-1, vocab), 1, generator=g).reshape(batch, k)
    return p, q, x


def acceptance_step(rule, p, q, x):
    """(step, unsettled): one acceptance step of `rule` timed by itself, returning (seconds, None) as
    `bench.paired` wants, and the fraction of rows `settle` had to finish in each step so far."""
    streams = RowRandom(range(x.shape[0]), x.device)
    unsettled = []
    # warm a settling rule's rare path too: a one-off setup there (PCG's sparse membership) is no step's cost
    if isinstance(rule, SettlingRule):
        rule.settle(torch.full_like(rule.verify(p, q, x, streams)[1], UNSETTLED))

    def step():
        start = time.perf_counter()
        n_acc, y = rule.verify(p, q, x, streams)
        left = y == UNSETTLED
        if bool(left.any()):  # the engine reads this on the round's one sync
            rule.settle(y)
        seconds = time.perf_counter() - start
        unsettled.append(float(left.float().mean()))
        return seconds, None

    return step, unsettled


def reciprocal_ci(ci: list[float]) -> list[float]:
    """The CI of 1/R from R's (unbounded above when R's reaches 0)."""
    lo, hi = ci
    return [1 / hi, 1 / lo if lo > 0 else float("inf")]


def torch_calls(step) -> float:
    """Torch calls per step, counted over OP_ROUNDS steps."""
    with bench.OpCounter() as ops:  # a round's count includes its share of the random blocks mixed ahead
        for _ in range(OP_ROUNDS):
            step()
    return ops.calls / OP_ROUNDS


OP_ROUNDS = 32  # steps the torch calls are counted over (a random block serves several)


def target_call(name: str, batch: int, context: int):
    """One decode(1) of a random-weight target of `name`'s shape at `context` positions (then rolled back),
    as a step for `bench.paired`: returns (seconds, None)."""
    shape = bench.SHAPES[name]
    target, _ = bench.build_models(shape, "cpu", torch.float32)
    with torch.inference_mode():
        cache, _ = target.prefill(bench.make_prompt(shape, context, batch), 16)
    tokens = torch.zeros(batch, 1, dtype=torch.long)

    def call():
        start = time.perf_counter()
        target.extend(cache, tokens)
        target.rollback(cache, 1)
        return time.perf_counter() - start, None

    return call


def chained(ratio: float, ci: list[float], by: float, by_ci: list[float]) -> tuple[float, list[float]]:
    """ratio × by, with a 95 % CI from the two (independent) ones: their half-widths on the log scale add in
    quadrature (the delta method)."""
    half = math.hypot(*(math.log(hi / lo) / 2 for lo, hi in (ci, by_ci)))
    product = ratio * by
    return product, [product * math.exp(-half), product * math.exp(half)]


def run(args) -> dict:
    results = {"command": "python scripts/bench_acceptance.py " + " ".join(args.argv), "machine": bench.machine("cpu"),
               "git": bench.git_commit(), "draft_len": args.draft_len, "rows": []}  # fmt: skip
    for name in args.vocabs:
        vocab = bench.SHAPES[name].speech_tokens + 3
        for batch in args.batches:
            p, q, x = laws(vocab, batch, args.draft_len)
            (_, exact), *others = rules(vocab, args.group_sizes)
            exact_step, _ = acceptance_step(exact, p, q, x)
            call = None
            if not args.no_target:
                with torch.inference_mode():
                    # the exact rule's step timed in pairs beside the target call; every other rule's beside the
                    # exact one: their product is a rule's share of a call, and a drift of the machine's speed
                    # between the two timings falls on both sides of each pair
                    on_call = bench.paired(target_call(name, batch, args.context), exact_step, args.repeats)
                call = 1e3 * on_call["baseline_seconds"]
                exact_share, exact_share_ci = 1 / on_call["speedup"], reciprocal_ci(on_call["speedup_ci"])
            for label, rule in [("exact", exact), *others]:
                step, unsettled = acceptance_step(rule, p, q, x)
                with torch.inference_mode():
                    timed = bench.paired(exact_step, step, args.repeats)
                    calls = torch_calls(step)
                ms, vs_exact = 1e3 * timed["seconds"], 1 / timed["speedup"]
                row = {"shape": name, "vocab": vocab, "batch": batch, "rule": label, "step_ms": ms,
                       "vs_exact": vs_exact, "vs_exact_ci": reciprocal_ci(timed["speedup_ci"]),
                       "target_call_ms": call, "vs_target_call": None, "vs_target_call_ci": None,
                       "settled_rows": sum(unsettled) / len(unsettled), "torch_calls": calls}  # fmt: skip
                if call is not None:
                    row["vs_target_call"], row["vs_target_call_ci"] = chained(
                        vs_exact, row["vs_exact_ci"], exact_share, exact_share_ci
                    )
                results["rows"].append(row)
                print(f"V={vocab} B={batch} {label}: {ms:.3f} ms ({vs_exact:.2f}x exact"
                      + (f", {100 * row['vs_target_call']:.1f} % of a target call)" if call else ")"), flush=True)  # fmt: skip
    return results


def markdown(results: dict) -> str:
    lines = [f"# Acceptance-step benchmark\n\n`{results['command']}`\n\n{results['machine']}; git {results['git']}.",
             f"\nOne acceptance step: `verify` on B rows of L_d = {results['draft_len']} draft tokens (+ `settle` for "
             "the rows PCG's thinning left), median of the repeats, each beside a step of the exact rule (× exact: the "
             "ratio of their summed times, 95 % CI over the pairs); the target call: one decode(1) of a random-weight "
             "model of that shape, median of the repeats, timed in pairs beside the exact rule's step (% of a target "
             "call: × exact times the exact step's share of a call, each from its pairs; docs/benchmarks.md).\n",
             "| shape | V | B | rule | step ms | × exact [95% CI] | torch calls | target call ms | % of a target call [95% CI] | rows settled |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in results["rows"]:
        call = "-" if r["target_call_ms"] is None else f"{r['target_call_ms']:.1f}"
        share = "-"
        if r["vs_target_call"] is not None:
            lo, hi = (100 * c for c in r["vs_target_call_ci"])
            share = f"{100 * r['vs_target_call']:.2f} [{lo:.2f}, {hi:.2f}]"
        lines.append(f"| {r['shape']} | {r['vocab']} | {r['batch']} | {r['rule']} | {r['step_ms']:.3f} | "
                     f"{r['vs_exact']:.2f} [{r['vs_exact_ci'][0]:.2f}, {r['vs_exact_ci'][1]:.2f}] | {r['torch_calls']:.1f} | {call} | {share} | {100 * r['settled_rows']:.1f} % |")  # fmt: skip
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vocabs", default="toy,cosyvoice2,llasa", help="shapes of bench_decoding.py")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--group-sizes", default="2,16,140", help="PCG's group (block) sizes")
    parser.add_argument("--draft-len", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--context", type=int, default=200, help="positions before the timed target call")
    parser.add_argument("--no-target", action="store_true", help="skip the target-call column")
    parser.add_argument("--out", type=Path, default=Path("experiments/results/bench_acceptance"))
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.vocabs = args.vocabs.split(",")
    unknown = [v for v in args.vocabs if v not in bench.SHAPES]
    if unknown:
        parser.error(f"--vocabs {unknown}: choose among {list(bench.SHAPES)}")
    args.batches = [int(b) for b in args.batches.split(",")]
    args.group_sizes = [int(g) for g in args.group_sizes.split(",")]
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    results = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out / "results.json", json.dumps(results, indent=2))
    write_atomic(args.out / "results.md", markdown(results))
    print(markdown(results))
    print(f"wrote {args.out}/results.json, results.md")
    return results


if __name__ == "__main__":
    main()
