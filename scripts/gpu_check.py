"""One-shot GPU check of the decoding engine: correctness first, then timings at CosyVoice 2's shape.

Stages (each stops at its share of --budget seconds and says what it skipped):
  eager       reference logits of decode(1) and verify(4), greedy tokens (float32), same weights as HF,
              eager per-call costs, for a float32 and a bfloat16 target;
  compiled    compile_decoding once per target: logits within tolerance of eager, greedy tokens identical
              (float32), compiled per-call costs decode(1) and verify(k+1);
  exactness   chi-square of speculative (exact rule) vs AR token tuples, with a negative control (β = 1)
              that must fail;
  decoding    HF generate vs this engine's AR; AR vs speculative under SYNTHETIC α (fixed acceptance:
              random weights make real α meaningless), L_d 1-6, with the speedup predicted from α, c, v;
  batch       tokens/s at batch 1, 4, 8 (AR and speculative);
  syncs       host syncs per round (torch-function counter and CUDA's sync debug mode);
  fsdp        a short `train_draft.py trainer=fsdp` of the micro toy world's draft on up to 2 GPUs: it
              finishes and its draft.pt loads as evaluation loads it (CUDA only: Lightning's FSDP refuses a CPU).
Writes results.json and summary.md to --out (default experiments/results/gpu_engine/); exit code 1 when a
correctness check fails, 2 when there is no CUDA device (unless --device cpu --quick, which runs the same
code at a tiny shape on CPU for tests).

    make gpu-check                                   # python scripts/gpu_check.py
    python scripts/gpu_check.py --device cpu --quick --out /tmp/gpu_check_smoke
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1])
)  # the checkout this script is in, not an installed ssd
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_decoding as bench  # noqa: E402

from ssd.decoding.acceptance import ExactRule, SyntheticRule, ToleranceRule  # noqa: E402
from ssd.decoding.generate import Request, decode_ar, decode_speculative  # noqa: E402
from ssd.decoding.observe import Instruments  # noqa: E402
from ssd.decoding.sampling import SamplingConfig  # noqa: E402
from ssd.evaluation.tables import expected_tokens_per_round  # noqa: E402
from ssd.files import write_atomic  # noqa: E402

DEFAULT_OUT = bench.REPO / "experiments" / "results" / "gpu_engine"
# Share of the budget each stage may use (the rest is slack for model building and compilation).
STAGE_SHARES = {
    "eager": 0.09,
    "compiled": 0.26,
    "exactness": 0.07,
    "decoding": 0.22,
    "batch": 0.1,
    "syncs": 0.05,
    "drafters": 0.09,
    "fsdp": 0.12,
}
CHECK_STAGES = ("eager", "compiled", "exactness", "fsdp")
# A small model with a sharp head, so that draft and target laws differ and the chi-square has power.
EXACTNESS_SHAPE = bench.Shape(64, 4, 4, 2, 128, 13, (0,), text_vocab=50)
P_REJECT = 1e-3
# Compiled vs eager logits: max |diff| / max |eager logit|.
TOLERANCE = {"float32": 1e-3, "bfloat16": 5e-2}
GREEDY = SamplingConfig(temperature=0)
# The micro toy world's stages a draft training reads (its target and token shards); its own draft and
# summary stages (most of its build time) are not needed.
TRAINING_WORLD_STAGES = ("corpus", "codec", "tokens", "target")
FSDP_STEPS = 4
FSDP_NEEDS_CUDA = (
    "Lightning's FSDP needs CUDA (FSDPStrategy refuses a CPU accelerator; on CPU, trainer=ddp_sim)"
)


class Stage:
    """Wall-clock budget of one stage: `over()` once its share is spent; skipped items are recorded."""

    def __init__(self, name: str, budget_s: float, report: dict):
        self.name, self.budget_s, self.start = name, budget_s, time.perf_counter()
        self.report = report.setdefault(name, {})
        self.report["skipped"] = []
        print(f"== {name} (budget {budget_s:.0f} s)", flush=True)

    def over(self, what: str) -> bool:
        if time.perf_counter() - self.start > self.budget_s:
            self.report["skipped"].append(what)
            print(f"   {self.name}: over budget, skipping {what}", flush=True)
            return True
        return False

    def done(self) -> None:
        self.report["seconds"] = time.perf_counter() - self.start


def compile_decoding(model, args):
    """The model's static decode step, compiled (`compile_decoding`, targets and drafts alike)."""
    if not hasattr(model, "compile_decoding"):
        raise RuntimeError(
            f"{type(model).__name__} has no compile_decoding(): this engine revision has no graph-capturable "
            "decode step; run with --compile off"
        )
    return model.compile_decoding(mode=args.compile_mode, backend=args.compile_backend)


def extend_logits(model, prompt, block: torch.Tensor, room: int) -> torch.Tensor:
    """Logits of extend(block) after a fresh prefill of `prompt` with `room` positions reserved."""
    cache, _ = model.prefill(prompt, room)
    return model.extend(cache, block).float()


def chi_square_same_law(a: list[list[int]], b: list[list[int]]) -> tuple[float, int]:
    """Two-sample chi-square of token tuples: (p-value, degrees of freedom); cells seen < 10 times pooled."""
    from scipy.stats import chi2_contingency

    ca, cb = Counter(map(tuple, a)), Counter(map(tuple, b))
    cells = sorted(set(ca) | set(cb))
    rare = [c for c in cells if ca[c] + cb[c] < 10]
    common = [c for c in cells if ca[c] + cb[c] >= 10]
    table = [
        [ca[c] for c in common] + [sum(ca[c] for c in rare)],
        [cb[c] for c in common] + [sum(cb[c] for c in rare)],
    ]
    if not rare:
        table = [row[:-1] for row in table]
    result = chi2_contingency(table)
    return float(result.pvalue), int(result.dof)


def exactness(device: str, rows: int) -> dict:
    """Speculative decoding with the exact rule must give AR's law of the first 3 tokens (RAS law, L_d = 2);
    the same test must reject β = 1 (every draft token kept: the draft's law)."""
    target, draft = bench.build_models(EXACTNESS_SHAPE, device, torch.float32, seed=3, head_std=0.25)
    prompt = bench.make_prompt(EXACTNESS_SHAPE, 8, rows)
    law = SamplingConfig(nucleus="cosyvoice", top_k=25, top_p=0.9, ras_window=10, ras_tau=0.1)
    ar = decode_ar(target, Request(prompt, 3, 3, bench._generator(device, 1)), law).tokens
    out = {"rows": rows, "law": repr(law)}
    for name, rule, must_pass in (
        ("exact", ExactRule(), True),
        ("negative control β=1", ToleranceRule(1.0), False),
    ):
        spec = decode_speculative(
            target, draft, Request(prompt, 3, 3, bench._generator(device, 2)), law, rule, 2
        ).tokens
        p, dof = chi_square_same_law(ar, spec)
        out[name] = {"p_value": p, "dof": dof, "ok": (p >= P_REJECT) == must_pass}
    return out


def decode_room(args) -> int:
    return bench.decode_room(args.tokens, max(args.draft_lens))


def blocks_of(args, dtype_name: str) -> list[int]:
    """Block lengths timed per dtype: decode(1) and every verify(L_d+1) for the decoding dtype; decode(1)
    and verify(4) for the other (each block length is one more compiled graph)."""
    return [1, *(k + 1 for k in args.draft_lens)] if dtype_name == args.dtype else [1, 4]


def eager_reference(stage: Stage, args, shape: bench.Shape, targets: dict) -> dict:
    """Eager logits, greedy tokens and per-call costs of each dtype's target, before it is compiled."""
    r, prompt, room = stage.report, bench.make_prompt(shape, args.context), decode_room(args)
    r["checks"], reference = {}, {}
    for dtype_name, target in targets.items():
        if stage.over(f"eager {dtype_name}"):
            continue
        g = torch.Generator().manual_seed(5)
        blocks = {
            k: torch.randint(0, shape.speech_tokens, (1, k), generator=g).to(args.device) for k in (1, 4)
        }
        reference[dtype_name] = {"blocks": blocks, "logits": {k: extend_logits(target, prompt, b, room)
                                                             for k, b in blocks.items()}}  # fmt: skip
        if dtype_name == "float32":
            reference[dtype_name]["greedy"] = decode_ar(
                target, Request(prompt, args.tokens, args.tokens), GREEDY
            ).tokens
            if not args.no_hf:
                diff = bench.hf_logits_match(target, bench.hf_causal_lm(target), prompt)
                r["checks"]["same weights as HF (float32 max |Δ logit|)"] = {"value": diff, "ok": diff < 1e-3}
        costs = bench.step_costs(
            target, prompt, blocks_of(args, dtype_name), args.device, 5 * args.repeats, room
        )
        r[f"eager {dtype_name} ms"] = {_call_name(k): 1e3 * s for k, s in costs.items()}
        print(f"   eager {dtype_name}: {r[f'eager {dtype_name} ms']}", flush=True)
    return reference


def compiled_checks(stage: Stage, args, shape: bench.Shape, targets: dict, reference: dict) -> set[str]:
    """Compile each target once; its logits and greedy tokens against the eager reference; per-call costs.
    Returns the dtypes whose target was compiled."""
    r, prompt, room = stage.report, bench.make_prompt(shape, args.context), decode_room(args)
    r["checks"], compiled_dtypes = {}, set()
    for dtype_name, target in targets.items():  # the decoding dtype first: later stages need it compiled
        if dtype_name not in reference or stage.over(f"compiled {dtype_name}"):
            continue
        compile_decoding(target, args)
        compiled_dtypes.add(dtype_name)
        ref = reference[dtype_name]
        for k, block in ref["blocks"].items():
            for _ in range(2):  # the first call compiles and records; compare a replay
                compiled = extend_logits(target, prompt, block, room)
            rel = float((compiled - ref["logits"][k]).abs().max() / ref["logits"][k].abs().max())
            r["checks"][f"compiled == eager {_call_name(k)} logits, {dtype_name} (rel. max |Δ|)"] = {
                "value": rel, "ok": rel <= TOLERANCE[dtype_name]}  # fmt: skip
        if "greedy" in ref:
            same = (
                decode_ar(target, Request(prompt, args.tokens, args.tokens), GREEDY).tokens == ref["greedy"]
            )
            r["checks"][f"greedy tokens compiled == eager ({dtype_name})"] = {"value": same, "ok": same}
        costs = bench.step_costs(
            target, prompt, blocks_of(args, dtype_name), args.device, 5 * args.repeats, room
        )
        r[f"compiled {dtype_name} ms"] = {_call_name(k): 1e3 * s for k, s in costs.items()}
        print(f"   compiled {dtype_name}: {r[f'compiled {dtype_name} ms']}", flush=True)
    return compiled_dtypes


def exactness_check(stage: Stage, args) -> None:
    r = stage.report
    r["checks"] = {}
    result = exactness(args.device, args.chi_rows)
    for name in ("exact", "negative control β=1"):
        r["checks"][f"chi-square speculative vs AR, {name} (p; reject < {P_REJECT})"] = {
            "value": result[name]["p_value"], "ok": result[name]["ok"]}  # fmt: skip
    r["result"] = result


def _quiet() -> Instruments:
    """Phase times and counts, without the diagnostics a deployment does not compute."""
    return Instruments(diagnostics=False)


def _call_name(k: int) -> str:
    return "decode(1)" if k == 1 else f"verify({k})"


def ar_decode(args, target, prompt):
    """The timed AR decode every speedup is paired with."""
    return bench.decode_seconds(
        lambda: decode_ar(
            target,
            Request(prompt, args.tokens, args.tokens, bench._generator(args.device)),
            bench.LAW,
            _quiet(),
        )
    )


def time_decoding(stage: Stage, args, shape: bench.Shape, target, draft) -> None:
    r, device, tokens = stage.report, args.device, args.tokens
    prompt = bench.make_prompt(shape, args.context)
    engine_ar = ar_decode(args, target, prompt)
    ar_s, _ = bench.median_run(engine_ar, args.repeats)
    r["engine AR tokens/s"] = tokens / ar_s
    if not args.no_hf and not stage.over("HF generate"):
        hf = bench.hf_causal_lm(target)
        ids = torch.randint(0, shape.speech_tokens, (1, args.context), device=device)
        hf_s, _ = bench.median_run(bench.hf_generate(hf, ids, tokens, device), args.repeats)
        r["HF generate tokens/s"] = tokens / hf_s
        del hf
    blocks = [1, *(k + 1 for k in args.draft_lens)]
    t_cost = bench.step_costs(target, prompt, blocks, device, 5 * args.repeats, decode_room(args))
    c = bench.step_costs(draft.model, prompt, [1], device, 5 * args.repeats, decode_room(args))[1] / t_cost[1]
    r["c"], r["v"] = c, {k - 1: t_cost[k] / t_cost[1] for k in blocks if k > 1}
    r["runs"] = []
    for alpha in args.alphas:
        for k in args.draft_lens:
            if stage.over(f"SYNTHETIC α={alpha} L_d={k}"):
                continue
            timed = bench.paired(engine_ar, bench.decode_seconds(
                lambda alpha=alpha, k=k: decode_speculative(
                    target, draft, Request(prompt, tokens, tokens, bench._generator(device)), bench.LAW,
                    SyntheticRule(alpha), k, _quiet())), args.repeats)  # fmt: skip
            a, (lo, hi) = timed["last"].stats.acceptance_rate, timed["speedup_ci"]
            predicted = expected_tokens_per_round(a, k) / (k * c + t_cost[k + 1] / t_cost[1])
            r["runs"].append({"rule": f"SYNTHETIC α={alpha}", "draft_len": k, "alpha": a,
                              "tokens_per_s": tokens / timed["seconds"], "speedup": timed["speedup"],
                              "speedup_ci": [lo, hi], "predicted": predicted})  # fmt: skip
            print(f"   α={alpha} L_d={k}: {tokens / timed['seconds']:.1f} tokens/s, {timed['speedup']:.2f}x "
                  f"[{lo:.2f}, {hi:.2f}] (predicted {predicted:.2f}x)", flush=True)  # fmt: skip


def time_drafters(stage: Stage, args, shape: bench.Shape, target, draft) -> None:
    """Every drafter family (random weights, eager) at L_d = --drafter-len under SYNTHETIC α, beside AR."""
    if stage.over("drafter families"):
        return
    prompt = bench.make_prompt(shape, args.context)
    k = args.drafter_len
    t_cost = bench.step_costs(target, prompt, [1, k + 1], args.device, 5 * args.repeats, decode_room(args))
    stage.report["rows"] = bench.drafter_rows(target, draft, prompt, ar_decode(args, target, prompt), t_cost,
                                              [max(args.alphas)], args, args.tokens, args.device)  # fmt: skip


def time_batches(stage: Stage, args, shape: bench.Shape, target, draft) -> None:
    stage.report["rows"] = []
    for b in args.batches:
        if stage.over(f"batch {b}"):
            continue
        prompt = bench.make_prompt(shape, args.context, b)

        def request(p=prompt):
            return Request(p, args.tokens, args.tokens, bench._generator(args.device))

        ar_s, _ = bench.median_run(
            bench.decode_seconds(lambda: decode_ar(target, request(), bench.LAW, _quiet())), args.repeats
        )
        sp_s, _ = bench.median_run(bench.decode_seconds(
            lambda: decode_speculative(target, draft, request(), bench.LAW, SyntheticRule(0.8), 3, _quiet())),
            args.repeats)  # fmt: skip
        row = {"batch": b, "AR tokens/s": b * args.tokens / ar_s, "speculative tokens/s (SYNTHETIC α=0.8, L_d=3)":
               b * args.tokens / sp_s}  # fmt: skip
        stage.report["rows"].append(row)
        print(f"   {row}", flush=True)


def count_syncs(stage: Stage, args, shape: bench.Shape, target, draft) -> None:
    """The torch-function counter runs on small uncompiled models of the static cache path (what the
    decode loop asks of the host does not depend on the model's size, and a compiled step is device-only
    by construction, fullgraph=True); CUDA's sync debug mode then watches the compiled models decode."""
    prompt = bench.make_prompt(shape, args.context)
    small_target, small_draft = bench.build_models(bench.SHAPES["tiny"], args.device, torch.float32)
    small_prompt = bench.make_prompt(bench.SHAPES["tiny"], args.context)
    with bench.static_cache_path(small_target, small_draft):
        stage.report["torch-function counter"] = bench.syncs_per_round(
            small_target, small_draft, small_prompt, args.sync_tokens, 3
        )
    if torch.device(args.device).type == "cuda":
        # CUDA's own view: every synchronising call warns once in this mode.
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                result = decode_speculative(target, draft, Request(prompt, args.sync_tokens, args.sync_tokens,
                                                                   bench._generator(args.device)),
                                            bench.LAW, ExactRule(), 3, _quiet())  # fmt: skip
        finally:
            torch.cuda.set_sync_debug_mode("default")
        n = sum("synchroniz" in str(w.message) for w in caught)
        stage.report["CUDA sync debug mode, speculative"] = {"syncs": n, "rounds": result.stats.rounds,
                                                             "per_round": n / max(1, result.stats.rounds)}  # fmt: skip
    print(f"   {json.dumps(stage.report, default=str)[:400]}", flush=True)


def train_micro_draft(work: Path, trainer: list[str], timeout_s: float) -> dict:
    """`python train_draft.py toy_world=micro <trainer> max_steps=FSDP_STEPS` into `work`, on the micro toy
    world's target and shards (built here first, under `work`): the exported draft.pt loaded as evaluation
    loads it (`load_draft` on its target). Raises TimeoutError past `timeout_s` (the run killed) and
    RuntimeError when the training fails, with its output's tail and the command."""
    from rich.console import Console

    from ssd.config import compose
    from ssd.drafters.layers import load_draft
    from ssd.models.cosyvoice2 import CosyVoice2LM
    from ssd.toy_world import STAGES, build_toy_world

    start = time.perf_counter()
    world_overrides = ["toy_world=micro", f"paths.data_dir={work / 'data'}"]
    world = compose("build_toy_world", world_overrides).toy_world
    stages = [s for s in STAGES if s.name in TRAINING_WORLD_STAGES]
    build_toy_world(world, world.dir, progress=False, console=Console(quiet=True), stages=stages)
    run_dir = work / "run"
    overrides = [*world_overrides, *world.draft.overrides, *trainer, f"max_steps={FSDP_STEPS}",
                 f"val_every_steps={FSDP_STEPS // 2}", "logger=csv"]  # fmt: skip
    cmd = [sys.executable, str(bench.REPO / "train_draft.py"), *overrides, f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    log = work / "train.log"
    with log.open("w") as out:  # its own session: a timeout kills Lightning's processes of the other GPUs too
        proc = subprocess.Popen(cmd, cwd=bench.REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        try:
            proc.wait(timeout=max(1.0, timeout_s - (time.perf_counter() - start)))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise TimeoutError(f"the training ran past {timeout_s:.0f} s and was stopped") from None
    if proc.returncode != 0:
        raise RuntimeError(
            f"exit code {proc.returncode}: {log.read_text()[-3000:]}\n(command: {' '.join(cmd)})"
        )
    cfg = compose("train_draft", overrides)
    draft = load_draft(run_dir / "draft.pt", CosyVoice2LM.from_dir(cfg.target.model.model_dir))
    step = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
    return {
        "steps": step,
        "draft_layers": list(draft.recipe.layers),
        "seconds": time.perf_counter() - start,
    }


def fsdp_training(stage: Stage, args) -> None:
    """A short training with trainer=fsdp on this machine's GPUs (up to 2): it finishes, its draft loads."""
    if torch.device(args.device).type != "cuda":
        stage.report["not_run"] = FSDP_NEEDS_CUDA
        print(f"   fsdp: not run: {FSDP_NEEDS_CUDA}", flush=True)
        return
    gpus = min(2, torch.cuda.device_count())
    name = f"FSDP training ({gpus} GPU, {FSDP_STEPS} steps) exports a draft that loads"
    with tempfile.TemporaryDirectory(prefix="gpu_check_fsdp_") as work:
        try:
            run = train_micro_draft(Path(work), ["trainer=fsdp", f"trainer.devices={gpus}"], stage.budget_s)
        except TimeoutError as err:
            stage.report["skipped"].append(f"FSDP training ({err}; raise --budget)")
            return
        except Exception as err:  # the check fails, the report is still written
            stage.report["checks"] = {name: {"value": f"{type(err).__name__}: see fsdp.error", "ok": False}}
            stage.report["error"] = f"{type(err).__name__}: {err}"
            return
    ok = run["steps"] == FSDP_STEPS
    stage.report.update(run)
    stage.report["checks"] = {name: {"value": f"{run['steps']} steps, {run['seconds']:.0f} s", "ok": ok}}
    print(f"   {json.dumps(stage.report, default=str)[:400]}", flush=True)


def all_checks(report: dict) -> dict:
    return {name: c for st in CHECK_STAGES for name, c in report.get(st, {}).get("checks", {}).items()}


def summary_md(report: dict) -> str:
    lines = [f"# GPU check\n\n`{report['command']}`\n\n{report['machine']}; git {report['git']}; "
             f"{report['seconds']:.0f} s. Random weights; SYNTHETIC rows fix α (not a sample of the target).\n",
             "## Correctness\n", "| check | value | ok |", "|---|---|---|"]  # fmt: skip
    for name, check in all_checks(report).items():
        lines.append(f"| {name} | {check['value']} | {'yes' if check['ok'] else '**NO**'} |")
    kernels = {
        k: v for st in ("eager", "compiled") for k, v in report.get(st, {}).items() if k.endswith(" ms")
    }
    if kernels:
        calls = list(next(iter(kernels.values())))
        lines += [
            "\n## Per-call cost (ms)\n",
            "| mode | " + " | ".join(calls) + " |",
            "|---|" + "---|" * len(calls),
        ]
        lines += [
            f"| {m[:-3]} | " + " | ".join(f"{v[c]:.3f}" for c in calls) + " |" for m, v in kernels.items()
        ]
    dec = report.get("decoding", {})
    if dec:
        lines.append(f"\n## Decoding, batch 1 ({report['dtype']}, {report['compile']})\n")
        lines.append(f"engine AR {dec.get('engine AR tokens/s', float('nan')):.1f} tokens/s; HF generate "
                     f"{dec.get('HF generate tokens/s', float('nan')):.1f} tokens/s; c = {dec.get('c', float('nan')):.3f}\n")  # fmt: skip
        lines += ["| rule | L_d | α | tokens/s | speedup [95% CI], pairs timed side by side | predicted |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        lines += [f"| {r['rule']} | {r['draft_len']} | {r['alpha']:.2f} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}× "
                  f"[{r['speedup_ci'][0]:.2f}, {r['speedup_ci'][1]:.2f}] | {r['predicted']:.2f}× |"
                  for r in dec.get("runs", [])]  # fmt: skip
    drafters = report.get("drafters", {}).get("rows", [])
    if drafters:
        lines += [f"\n## Drafter families (random weights, eager; SYNTHETIC α, L_d = {drafters[0]['draft_len']})\n",
                  "| drafter | α | draft cost / round (target calls) | tokens/s | speedup [95% CI] | predicted |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        lines += [f"| {r['drafter']} | {r['alpha']:.2f} | {r['draft_per_round']:.3f} | {r['tokens_per_s']:.1f} | "
                  f"{r['speedup']:.2f}× [{r['speedup_ci'][0]:.2f}, {r['speedup_ci'][1]:.2f}] | {r['predicted']:.2f}× |"
                  for r in drafters]  # fmt: skip
    rows = report.get("batch", {}).get("rows", [])
    if rows:
        keys = [k for k in rows[0] if k != "batch"]
        lines += [
            "\n## Batch throughput (tokens/s)\n",
            "| batch | " + " | ".join(keys) + " |",
            "|---|" + "---|" * len(keys),
        ]
        lines += [f"| {r['batch']} | " + " | ".join(f"{r[k]:.1f}" for k in keys) + " |" for r in rows]
    syncs = report.get("syncs", {})
    if syncs:
        lines.append("\n## Host syncs per round\n")
        for mode, s in syncs.get("torch-function counter", {}).items():
            lines.append(
                f"- {mode} (torch-function counter): {s['per_round']:.1f} per round + {s['per_decode']:.1f} per decode"
            )
        if "CUDA sync debug mode, speculative" in syncs:
            lines.append(
                f"- speculative (CUDA sync debug mode): {syncs['CUDA sync debug mode, speculative']['per_round']:.1f}"
            )
    not_run = {name: s["not_run"] for name, s in report.items() if isinstance(s, dict) and s.get("not_run")}
    lines += [f"\nNot run: {name}: {reason}" for name, reason in not_run.items()]
    skipped = {name: s["skipped"] for name, s in report.items() if isinstance(s, dict) and s.get("skipped")}
    if skipped:
        lines.append(f"\nSkipped (over budget): {skipped}")
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--quick", action="store_true", help="tiny shape, few tokens (with --device cpu: the smoke test)"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--budget", type=float, default=420.0, help="seconds for all stages (H200: stays under 8 min)"
    )
    parser.add_argument("--dtype", default="bfloat16", help="dtype of the decoding/batch/syncs stages")
    parser.add_argument(
        "--compile", choices=["on", "off"], default="on", help="check and time the compiled step"
    )
    parser.add_argument(
        "--compile-mode", default="reduce-overhead", help="torch.compile mode (inductor only)"
    )
    parser.add_argument("--compile-backend", default=None,
                        help="torch.compile backend (default: inductor on CUDA; 'eager' on CPU, which captures the "
                             "graph without generating code, so --quick stays seconds)")  # fmt: skip
    parser.add_argument("--no-hf", action="store_true")
    args = parser.parse_args(argv)
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False). Run it on a GPU machine, or "
              "`python scripts/gpu_check.py --device cpu --quick` to test the script itself.", file=sys.stderr)  # fmt: skip
        sys.exit(2)
    if torch.device(args.device).type != "cuda" and not args.quick:
        print(
            "gpu_check: without CUDA only --device cpu --quick (a tiny-shape test of the script) runs.",
            file=sys.stderr,
        )
        sys.exit(2)
    cuda = torch.device(args.device).type == "cuda"
    args.compile_backend = args.compile_backend or ("inductor" if cuda else "eager")
    args.shape = "tiny" if args.quick else "cosyvoice2"
    args.context, args.tokens, args.repeats = (32, 12, 2) if args.quick else (200, 100, 6)
    args.draft_lens = [1, 2] if args.quick else [1, 2, 3, 4, 5, 6]
    args.drafter_len = 2 if args.quick else 3
    args.alphas = [0.8] if args.quick else [0.6, 0.7, 0.8]
    args.batches = [1, 2] if args.quick else [1, 4, 8]
    args.dtypes = ["float32"] if torch.device(args.device).type != "cuda" else ["float32", "bfloat16"]
    if torch.device(args.device).type != "cuda":
        args.dtype = "float32"  # bf16 on CPUs without bf16 instructions is slow and says nothing
    args.chi_rows = 2000 if args.quick else 10000
    # A decode whose caches keep the decodes' capacity (512 at context 200), so that watching the compiled
    # models replays their graphs instead of compiling new ones.
    args.sync_tokens = args.tokens if args.quick else 60
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    shape = bench.SHAPES[args.shape]
    report: dict = {"command": "python scripts/gpu_check.py " + " ".join(sys.argv[1:] if argv is None else argv),
                    "machine": bench.machine(args.device), "git": bench.git_commit(), "shape": args.shape,
                    "dtype": args.dtype, "compile": f"compiled ({args.compile_backend}, {args.compile_mode})" if args.compile == "on" else "eager"}  # fmt: skip
    budget = {name: share * args.budget for name, share in STAGE_SHARES.items()}

    target, draft = bench.build_models(shape, args.device, getattr(torch, args.dtype))
    targets = {args.dtype: target}
    for dtype_name in args.dtypes:
        targets.setdefault(dtype_name, bench.build_models(shape, args.device, getattr(torch, dtype_name))[0])

    stage = Stage("eager", budget["eager"], report)
    reference = eager_reference(stage, args, shape, targets)
    stage.done()
    if args.compile == "on":
        stage = Stage("compiled", budget["compiled"], report)
        compiled = compiled_checks(stage, args, shape, targets, reference)
        stage.done()
        if (
            args.dtype not in compiled
        ):  # its checks ran out of budget; the timings still use the compiled step
            compile_decoding(target, args)
        compile_decoding(draft, args)
    targets = reference = None  # only the decoding dtype's target stays in memory
    stage = Stage("exactness", budget["exactness"], report)
    exactness_check(stage, args)
    stage.done()
    stages = (
        ("decoding", time_decoding),
        ("drafters", time_drafters),
        ("batch", time_batches),
        ("syncs", count_syncs),
    )
    for name, fn in stages:
        stage = Stage(name, budget[name], report)
        fn(stage, args, shape, target, draft)
        stage.done()
    target = draft = None  # the training subprocess gets the GPU memory
    torch.cuda.empty_cache()
    stage = Stage("fsdp", budget["fsdp"], report)
    fsdp_training(stage, args)
    stage.done()

    report["seconds"] = time.perf_counter() - start
    failed = [n for n, c in all_checks(report).items() if not c["ok"]]
    report["failed_checks"] = failed
    args.out.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out / "results.json", json.dumps(report, indent=2, default=str))
    write_atomic(args.out / "summary.md", summary_md(report))
    print(summary_md(report))
    print(f"wrote {args.out}/results.json and summary.md ({report['seconds']:.0f} s)")
    if failed:
        print(f"FAILED: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
