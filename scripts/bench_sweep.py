#!/usr/bin/env python
"""The user's sweep, batch 1 vs batched evaluation, side by side in one run.

  python scripts/bench_sweep.py                                  # beta=0,0.2,0.4 draft_len=2,3,4 on the toy world
  python scripts/bench_sweep.py --batch 8 --grid beta=0,0.4 draft_len=3 --out /tmp/bench_sweep

Runs `sweep.py -m <grid>` twice, each a fresh sweep dir with its AR baseline (auto_baseline):
eval.batch_size=1, then eval.batch_size=<batch>, each timed end to end (wall clock of the whole command,
model loading, judges and tables included). Then it checks what batching must not change: every
utterance's tokens, and each job's WER, SIM and acceptance. Writes results.json, summary.md, command.txt,
machine.txt and git_commit.txt into --out (both sweep dirs under --out/runs/).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from ssd.evaluation.provenance import git_description, machine_description  # noqa: E402
from ssd.evaluation.run_dir import BASELINES_DIR, RESULTS_FILE, read_records  # noqa: E402
from ssd.files import write_atomic  # noqa: E402

COMPARED = ("wer", "sim", "acceptance_rate")  # metrics.json keys that batching must leave unchanged


def job_dirs(sweep_dir: Path, grid_keys: list[str]) -> dict[str, Path]:
    """{job: dir} of every finished job (its metrics.json), named by its grid values as its saved config
    holds them (dir names carry every override and may be length-capped); the AR baseline is `baseline`."""
    from omegaconf import OmegaConf

    found = {}
    for metrics in sorted(sweep_dir.rglob("metrics.json")):
        cfg = OmegaConf.load(metrics.parent / "config.yaml")
        name = ",".join(f"{k}={OmegaConf.select(cfg, k)}" for k in grid_keys)
        found["baseline" if BASELINES_DIR in metrics.parent.relative_to(sweep_dir).parts else name] = (
            metrics.parent
        )
    return found


def time_split(sweep_dir: Path, batch: int) -> dict[str, float]:
    """Where a sweep's wall time went, summed over its jobs' records (seconds): the decodes as run
    (batched or not), the batch-1 re-decodes that time LM-RTF in batched runs, and the vocoder; the rest
    of the wall time is the judges (ASR, SIM, MOS), prompt preparation and model loading."""
    records = [r for f in sorted(sweep_dir.rglob(RESULTS_FILE)) for r in read_records(f, repair=False)]
    decode = sum(r["decode_time_share"] for r in records)
    # At batch 1 the decode is its own timing; batched, the timed items were decoded again alone.
    redecode = 0.0 if batch == 1 else sum(r["lm_time"] for r in records if r.get("lm_time") is not None)
    return {"decode_s": decode, "latency_redecode_s": redecode,
            "vocoder_s": sum(r["vocoder_time"] for r in records), "utterance_settings": len(records)}  # fmt: skip


def toy_batch_size() -> int:
    from omegaconf import OmegaConf

    return int(OmegaConf.load(REPO / "configs" / "eval" / "toy.yaml").batch_size)


def same(x, y) -> bool:
    """Equal, counting two NaNs (AR's undefined acceptance) as equal."""
    return x == y or (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y))


def compare(a: Path, b: Path) -> dict:
    """Per-utterance tokens and the COMPARED metrics of one job at batch 1 (a) and batched (b)."""
    tokens = [{r["utt"]: r["tokens"] for r in read_records(d / RESULTS_FILE, repair=False)} for d in (a, b)]
    metrics = [json.loads((d / "metrics.json").read_text()) for d in (a, b)]
    return {
        "utterances": len(tokens[0]),
        "tokens_identical": tokens[0] == tokens[1] and len(tokens[0]) > 0,
        **{f"{k}_identical": same(metrics[0].get(k), metrics[1].get(k)) for k in COMPARED},
        **{f"{k}_batch1": metrics[0].get(k) for k in COMPARED},
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--grid", nargs="+", default=["beta=0,0.2,0.4", "draft_len=2,3,4"])
    parser.add_argument("--batch", type=int, default=toy_batch_size(),
                        help="the batched run's eval.batch_size (default: configs/eval/toy.yaml's)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=REPO / "experiments" / "results" / "bench_sweep")
    parser.add_argument("overrides", nargs="*", help="extra KEY=VALUE for both sweeps (not job-naming)")
    parser.add_argument("--report", action="store_true",
                        help="rewrite the summary from the runs and wall times already in --out (no rerun)")  # fmt: skip
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    walls, commands = {}, []
    if args.report:
        previous = json.loads((args.out / "results.json").read_text())
        walls = {1: previous["wall_s_batch1"], args.batch: previous[f"wall_s_batch{args.batch}"]}
    for batch in () if args.report else (1, args.batch):
        sweep_dir = args.out / "runs" / f"batch{batch}"
        if sweep_dir.exists():
            sys.exit(f"{sweep_dir} exists: a timing needs fresh sweep dirs (move it away or choose --out)")
        cmd = [sys.executable, "sweep.py", "-m", *args.grid, f"eval.batch_size={batch}", "logger=none",
               "progress=false", f"hydra.sweep.dir={sweep_dir}", *args.overrides]  # fmt: skip
        commands.append(" ".join(cmd[1:]))
        print(f"batch {batch}: {commands[-1]}", flush=True)
        start = time.perf_counter()
        subprocess.run(cmd, cwd=REPO, env=env, check=True)
        walls[batch] = time.perf_counter() - start
    grid_keys = [g.split("=", 1)[0] for g in args.grid]
    runs = [job_dirs(args.out / "runs" / f"batch{b}", grid_keys) for b in (1, args.batch)]
    if not runs[0] or set(runs[0]) != set(runs[1]):
        sys.exit(f"the two sweeps finished different jobs: {sorted(runs[0])} vs {sorted(runs[1])}")
    jobs = {name: compare(runs[0][name], runs[1][name]) for name in sorted(runs[0])}
    identical = all(all(v for k, v in j.items() if k.endswith("_identical")) for j in jobs.values())
    splits = {b: time_split(args.out / "runs" / f"batch{b}", b) for b in (1, args.batch)}
    result = {"grid": args.grid, "batch": args.batch, "wall_s_batch1": round(walls[1], 1),
              f"wall_s_batch{args.batch}": round(walls[args.batch], 1),
              "speedup": round(walls[1] / walls[args.batch], 2), "all_identical": identical,
              "time_split": {f"batch{b}": split for b, split in splits.items()}, "jobs": jobs}  # fmt: skip
    write_atomic(args.out / "results.json", json.dumps(result, indent=1))
    if not args.report:
        write_atomic(
            args.out / "command.txt",
            f"python scripts/bench_sweep.py {' '.join(sys.argv[1:])}\n" + "\n".join(commands) + "\n",
        )
        write_atomic(args.out / "machine.txt", machine_description())
        write_atomic(args.out / "git_commit.txt", git_description(REPO))

    def split_row(label: str, key: str) -> str:
        return f"| {label} | " + " | ".join(f"{splits[b][key]:.1f} s" for b in (1, args.batch)) + " |"

    rest = {b: walls[b] - sum(v for k, v in splits[b].items() if k.endswith("_s")) for b in (1, args.batch)}
    rows = [f"| {n} | {j['utterances']} | {j['tokens_identical']} | "
            + " | ".join(f"{j[f'{k}_batch1']:.4f} ({'=' if j[f'{k}_identical'] else '≠'})" if j[f"{k}_batch1"] is not None
                         else "—" for k in COMPARED) + " |" for n, j in jobs.items()]  # fmt: skip
    summary = [
        f"# The user's sweep, batch 1 vs batch {args.batch}",
        "",
        f"`python sweep.py -m {' '.join(args.grid)}` (with its AR baseline), run twice by `scripts/bench_sweep.py`",
        "(command.txt, machine.txt, git_commit.txt). Wall clock of the whole command each time.",
        "",
        f"| | batch 1 | batch {args.batch} |",
        "|---|---|---|",
        f"| wall time | {walls[1]:.1f} s | {walls[args.batch]:.1f} s ({result['speedup']:.2f}× faster) |",
        split_row("LM decoding, as run", "decode_s"),
        split_row("batch-1 re-decodes timing LM-RTF", "latency_redecode_s"),
        split_row("vocoder", "vocoder_s"),
        f"| the rest: judges (ASR, SIM, MOS), prompts, loading | {rest[1]:.1f} s | {rest[args.batch]:.1f} s |",
        "",
        f"The decoding itself is {splits[1]['decode_s'] / splits[args.batch]['decode_s']:.1f}× faster batched; the "
        "command's wall time is bounded by the per-utterance work batching does not touch.",
        "",
        f"Every job's per-utterance tokens and metrics identical: **{identical}**.",
        "",
        "| job | utterances | tokens identical | "
        + " | ".join(f"{k} (batch 1; = same batched)" for k in COMPARED)
        + " |",
        "|---|---|---|" + "---|" * len(COMPARED),
        *rows,
        "",
    ]
    write_atomic(args.out / "summary.md", "\n".join(summary))
    print("\n".join(summary))
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
