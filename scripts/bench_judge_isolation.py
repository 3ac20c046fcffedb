#!/usr/bin/env python
"""Does judging one utterance slow the LM decode timed next? Paired, in one run.

  python scripts/bench_judge_isolation.py                          # the toy world's judges, --out below
  python scripts/bench_judge_isolation.py asr=whisper_base_toy --reps 6 --out /tmp/isolation

The evaluation runner alternates decoding (timed: LM-RTF) with vocoding and judging (ASR, SIM, MOS). A
judge whose thread pool busy-waits after it returns keeps a core busy during the next timed decode. This
script decodes the same test items (decoding=ar, batch 1) after each of these, interleaved so that drift
hits every condition alike:
  - nothing (back to back: the reference),
  - the vocoder and each judge as a run calls them (numpy's BLAS single-threaded, ONNX sessions that do
    not spin: `ssd.evaluation.runner.single_threaded_blas`, `ssd.audio.onnx.onnx_session`),
  - the negative controls, as they were before: the same judges with numpy's BLAS on every thread, and
    DNSMOS's ONNX sessions spinning too.
For each it prints the decode time after it / the back-to-back decode time of the same item and repetition
(median and mean of the pairs: what a judge leaves behind for a while), the decodes' total / that of
back-to-back passes made before any judge ran (what a judge leaves behind for good: a Whisper judge on
CTranslate2 with cpu_threads > 1 joins torch's OpenMP runtime and slows every later multi-threaded torch op,
so run `asr=whisper_base_toy asr.cpu_threads=2` to see it) and the judge's own time. Writes results.json, summary.md, command.txt,
machine.txt and git_commit.txt into --out. Overrides (key=value) go to the sweep config.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from ssd.evaluation.provenance import git_description, machine_description  # noqa: E402
from ssd.files import write_atomic  # noqa: E402


def spinning_dnsmos(cfg):
    """The run's DNSMOS judge with the ONNX sessions it had before (idle workers busy-wait)."""
    from hydra.utils import instantiate

    from ssd.audio.mos import DNSMOS, speechmos_model_dir
    from ssd.audio.onnx import onnx_session

    judge = instantiate(cfg.mos)
    if not isinstance(judge, DNSMOS):
        return None
    root = Path(str(cfg.mos.model_dir)) if cfg.mos.get("model_dir") else speechmos_model_dir()
    models = root / ("pdnsmos_models" if judge.personalized else "dnsmos_models")
    threads = cfg.mos.get("num_threads")
    judge.p835 = onnx_session(models / "sig_bak_ovr.onnx", threads, allow_spinning=True)
    if judge.p808 is not None:
        judge.p808 = onnx_session(root / "dnsmos_models" / "model_v8.onnx", threads, allow_spinning=True)
    return judge


def fmt(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("overrides", nargs="*", help="sweep config overrides (key=value)")
    parser.add_argument("--items", type=int, default=6, help="test items decoded")
    parser.add_argument("--reps", type=int, default=4, help="repetitions of every (item, condition)")
    parser.add_argument(
        "--out", type=Path, default=REPO / "experiments" / "results" / "bench_judge_isolation"
    )
    args = parser.parse_args(argv)

    import torch
    from omegaconf import open_dict

    from ssd.config import compose
    from ssd.evaluation import batch, runner
    from ssd.evaluation.items import build_test_list, prepare_item
    from ssd.evaluation.models import load_models
    from ssd.evaluation.settings import RunSettings

    cfg = compose("sweep", ["decoding=ar", "logger=none", "progress=false", *args.overrides])
    with open_dict(cfg):
        cfg.output_dir = str(args.out / "run")
    settings = RunSettings.from_config(cfg)
    torch.set_num_threads(int(settings.eval.num_threads))
    m = load_models(settings)
    pairs = build_test_list(settings.eval).head(args.items)
    prompts: dict = {}
    items = [
        prepare_item(m, settings.seed, i, p, None, prompts)
        for i, p in enumerate(pairs.itertuples(index=False))
    ]
    sr = m.vocoder.sample_rate
    with runner.single_threaded_blas():
        batch.warm_up(settings, m, items[0])
        decoded = [batch._timed_decode(settings, m, [it]).result.tokens[0] for it in items]
        wavs = [m.vocoder.vocode(np.asarray(m.target.codec_tokens(t), dtype=np.int64), it.vprompt)
                for t, it in zip(decoded, items)]  # fmt: skip

    judges = {"vocoder": lambda w, it: m.vocoder.vocode(
                  np.asarray(m.target.codec_tokens(decoded[it.index]), dtype=np.int64), it.vprompt),
              "asr": lambda w, it: m.asr.transcribe(w, sr),
              "sim": lambda w, it: m.speaker.embed(w, sr)}  # fmt: skip
    if m.mos is not None:
        judges["mos"] = lambda w, it: m.mos.score(w, sr)
    conditions = {"back to back": (lambda w, it: None, True)}
    conditions.update({f"{name} (as run)": (judge, True) for name, judge in judges.items()})
    conditions.update({f"{name} (BLAS on every thread)": (judges[name], False) for name in ("sim", "mos")
                       if name in judges})  # fmt: skip
    spinning = spinning_dnsmos(cfg) if m.mos is not None else None
    if spinning is not None:
        conditions["mos (BLAS on every thread, ONNX spinning: before)"] = (
            lambda w, it: spinning.score(w, sr), False)  # fmt: skip

    # Before any judge has run: the reference for what persists (a judge that slows torch for good slows
    # the interleaved back-to-back decodes too, which the paired ratio alone would hide).
    # (One pass more, dropped: the first passes after loading run slower.)
    first = np.array(
        [[batch._timed_decode(settings, m, [item]).seconds for item in items] for _ in range(args.reps + 1)]
    )[1:]
    decode_s = {name: np.zeros((args.reps, len(items))) for name in conditions}
    judge_s = {name: [] for name in conditions}
    names = list(conditions)
    for rep in range(args.reps):
        for i, (item, wav) in enumerate(zip(items, wavs)):
            for name in names if rep % 2 == 0 else names[::-1]:
                call, limited = conditions[name]
                with runner.single_threaded_blas() if limited else contextlib.nullcontext():
                    start = time.perf_counter()
                    call(wav, item)
                    judge_s[name].append(time.perf_counter() - start)
                    seconds = batch._timed_decode(settings, m, [item]).seconds
                decode_s[name][rep, i] = seconds
        print(f"repetition {rep + 1}/{args.reps} done", flush=True)

    reference = decode_s["back to back"]
    rows = [
        {
            "condition": "back to back, before any judge ran",
            "decode_s_total": float(first.sum()),
            "ratio_median": None,
            "ratio_mean": None,
            "vs_first_pass": 1.0,
            "judge_ms_per_call": 0.0,
        }
    ]
    for name in names:
        ratio = (
            decode_s[name] / reference if name != "back to back" else None
        )  # the reference itself: no ratio
        rows.append({"condition": name, "decode_s_total": float(decode_s[name].sum()),
                     "ratio_median": None if ratio is None else float(np.median(ratio)),
                     "ratio_mean": None if ratio is None else float(ratio.mean()),
                     "vs_first_pass": float(decode_s[name].sum() / first.sum()),
                     "judge_ms_per_call": 1e3 * float(np.mean(judge_s[name]))})  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out / "results.json", json.dumps(
        {"items": len(items), "reps": args.reps, "overrides": args.overrides, "rows": rows,
         "decode_seconds": {name: decode_s[name].tolist() for name in names}}, indent=2) + "\n")  # fmt: skip
    write_atomic(
        args.out / "command.txt",
        f"python scripts/bench_judge_isolation.py {' '.join(sys.argv[1:] if argv is None else argv)}\n",
    )
    write_atomic(args.out / "machine.txt", machine_description())
    write_atomic(args.out / "git_commit.txt", git_description(REPO))
    lines = [
        "# The LM decode after each judge, paired with the back-to-back decode of the same item",
        "",
        f"`python scripts/bench_judge_isolation.py` (command.txt, machine.txt, git_commit.txt): {len(items)} test "
        f"items, decoding=ar at batch 1, {args.reps} repetitions of every (item, condition), interleaved.",
        "",
        "| before each timed decode | decode time / back to back (median of pairs) | (mean) | decodes, total "
        "| total / before any judge ran | judge, per call |",
        "|---|---|---|---|---|---|",
    ]
    lines += [f"| {r['condition']} | {fmt(r['ratio_median'])} | {fmt(r['ratio_mean'])} | {r['decode_s_total']:.2f} s "
              f"| {r['vs_first_pass']:.3f} | {r['judge_ms_per_call']:.1f} ms |" for r in rows]  # fmt: skip
    write_atomic(args.out / "summary.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
