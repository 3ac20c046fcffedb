"""How many timed utterances a speedup needs: one sweep job run `--repeats` times (each a fresh process, with
every test item timed beside the AR target), then the speedup's 95 % CI half-width over the first N timed
utterances for several N, and whether the repeats' CIs overlap (docs/algorithms.md §4).

    python scripts/bench_paired_timing.py --out experiments/results/paired_timing
    python scripts/bench_paired_timing.py --setting "acceptance=pcg theta=0.4" --out /tmp/pt
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench_decoding import git_commit, machine  # noqa: E402

from ssd.evaluation.metrics import paired_speedup, paired_speedup_ci  # noqa: E402
from ssd.evaluation.run_dir import METRICS_FILE, RESULTS_FILE, read_records  # noqa: E402
from ssd.files import write_atomic  # noqa: E402


def run_repeat(out: Path, setting: list[str], extra: list[str]) -> Path:
    """One sweep of the setting (and its AR baseline) in a fresh process; the job's run dir."""
    command = [sys.executable, "sweep.py", "-m", *setting, "logger=none", "eval.timed_utts=null",
               f"hydra.sweep.dir={out}", *extra]  # fmt: skip
    print("$", " ".join(command[1:]), flush=True)
    subprocess.run(command, cwd=REPO, check=True)
    jobs = [p.parent for p in out.glob(f"*/{METRICS_FILE}") if p.parent.name != "baselines"]
    if len(jobs) != 1:
        raise RuntimeError(f"expected one job dir under {out}, found {[j.name for j in jobs]}")
    return jobs[0]


def half_width(records: list[dict]) -> float:
    lo, hi = paired_speedup_ci(records)
    return (hi - lo) / 2 / paired_speedup(records)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--setting", default="beta=0.4 draft_len=3", help="the sweep overrides of the timed job"
    )
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--sizes", default="10,20,30,40", help="numbers of timed utterances to report")
    parser.add_argument("--out", type=Path, default=REPO / "experiments" / "results" / "paired_timing")
    parser.add_argument("overrides", nargs="*", help="more sweep overrides, e.g. eval.n_utts=60")
    args = parser.parse_args(argv)
    setting = args.setting.split()
    sizes = [int(n) for n in args.sizes.split(",")]
    repeats = []
    for i in range(args.repeats):
        job = run_repeat(args.out / f"repeat_{i + 1}", setting, args.overrides)
        records = [r for r in read_records(job / RESULTS_FILE) if r.get("baseline_lm_time") is not None]
        metrics = json.loads((job / METRICS_FILE).read_text())
        repeats.append({"run": str(job.relative_to(args.out)), "timed": len(records),
                        "speedup": metrics["speedup"], "speedup_ci": metrics["speedup_ci"],
                        "acceptance_rate": metrics["acceptance_rate"],
                        "half_width": {n: half_width(records[:n]) for n in sizes if n <= len(records)},
                        "baseline_lm_time": metrics["baseline_lm_time"], "lm_time": metrics["lm_time"]})  # fmt: skip
    cis = [r["speedup_ci"] for r in repeats]
    overlap = max(lo for lo, _ in cis) <= min(hi for _, hi in cis)
    results = {"command": "python scripts/bench_paired_timing.py " + " ".join(sys.argv[1:] if argv is None else argv),
               "git": git_commit(), "machine": machine("cpu"), "setting": setting, "repeats": repeats,
               "cis_overlap": overlap}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out / "results.json", json.dumps(results, indent=2))
    lines = [f"# Paired timing: how many timed utterances a speedup needs\n\n`{results['command']}`\n\n"
             f"{results['machine']}; git {results['git']}. Setting: `{' '.join(setting)}`, each repeat a fresh "
             "process timing every test item beside the AR target (docs/algorithms.md §4).\n",
             "| repeat | timed n | speedup [95% CI] | acceptance | extra AR time s | " +
             " | ".join(f"± at n={n}" for n in sizes) + " |",
             "|---|---|---|---|---|" + "---|" * len(sizes)]  # fmt: skip
    for r in repeats:
        widths = " | ".join(
            f"{100 * r['half_width'][n]:.1f} %" if n in r["half_width"] else "-" for n in sizes
        )
        lines.append(f"| {r['run']} | {r['timed']} | {r['speedup']:.3f} [{r['speedup_ci'][0]:.3f}, "
                     f"{r['speedup_ci'][1]:.3f}] | {r['acceptance_rate']:.3f} | {r['baseline_lm_time']:.1f} | {widths} |")  # fmt: skip
    lines.append(f"\nThe repeats' CIs {'overlap' if overlap else 'do NOT overlap'}.")
    write_atomic(args.out / "summary.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return results


if __name__ == "__main__":
    main()
