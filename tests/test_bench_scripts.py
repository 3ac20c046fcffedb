"""Smoke tests of the benchmark scripts at a tiny shape, and of the host-sync counter they rely on."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_sync_counter_counts_every_host_read_and_nothing_else():
    bench = load_script("bench_decoding")
    x = torch.tensor([3.0, -1.0, 2.0])

    def seven_syncs(x):
        x.sum().item()
        int(x[0])
        float(x[1])
        x.tolist()
        x.nonzero()
        _ = x[x > 0]
        if x.max() > 0:  # __bool__
            pass

    def device_only(x):
        y = torch.where(x > 0, x, -x).cumsum(0)
        return torch.softmax(y, 0).argmax(), y[1:], x.clamp_min(0)

    with bench.HostSyncCounter() as counter:
        seven_syncs(x)
    assert counter.total == 7, counter.calls
    assert counter.calls["__getitem__[bool mask]"] == 1 and counter.calls["item"] == 1
    with bench.HostSyncCounter() as counter:
        device_only(x)
    assert counter.total == 0, counter.calls


def test_a_resampling_law_before_min_len_adds_no_host_read_to_a_round():
    """CosyVoice 2's own law (eos_mode=resample) refuses EOS before min_len, and a row whose law sits wholly on
    stop tokens falls back to the masked law. Finding those rows must not read the host: a decode that runs
    wholly before min_len makes as many host reads under that law as under the masking one (SYNTHETIC verdicts,
    drawn from the rows' own streams, give both the same rounds)."""
    bench = load_script("bench_decoding")
    from ssd.drafters.heads import HeadsDrafter

    shape = bench.SHAPES["tiny"]
    target, _ = bench.build_models(shape, "cpu", torch.float32)
    prompt = bench.make_prompt(shape, 12)
    drafter = HeadsDrafter(target, heads=3, kind="mtp")
    resample = bench.SamplingConfig(top_k=25, top_p=0.8, nucleus="cosyvoice", ras_window=10,
                                    stop_tokens=tuple(target.stop_tokens), eos_mode="resample")  # fmt: skip
    tokens = 24

    def reads(law, speculative: bool) -> int:
        request = bench.Request(prompt, tokens, tokens, bench._generator("cpu"))
        with torch.no_grad(), bench.HostSyncCounter() as counter:
            if speculative:
                result = bench.decode_speculative(target, drafter, request, law, bench.SyntheticRule(0.6), 3)
            else:
                result = bench.decode_ar(target, request, law)
        assert len(result.tokens[0]) == tokens
        return counter.total

    for speculative in (True, False):
        assert reads(resample, speculative) == reads(replace(resample, eos_mode="mask"), speculative)


def test_paired_timing_alternates_the_order_and_reports_the_ratio_of_sums():
    """Every speedup the benchmarks print comes from pairs timed side by side: after one warm-up of each, the
    baseline runs first in even pairs and second in odd ones; speedup = Σ baseline / Σ candidate, with a CI."""
    bench = load_script("bench_decoding")
    order, base_s, own_s = [], iter([9.0, 2.0, 2.2, 1.8, 2.0]), iter([9.0, 1.0, 1.2, 0.9, 1.1])

    def baseline():
        order.append("baseline")
        return next(base_s), None

    def candidate():
        order.append("candidate")
        return next(own_s), "last result"

    out = bench.paired(baseline, candidate, 4)
    pairs = [("baseline", "candidate"), ("candidate", "baseline")] * 2
    assert order == ["baseline", "candidate", *(name for pair in pairs for name in pair)]
    assert out["speedup"] == pytest.approx(8.0 / 4.2) and out["last"] == "last result" and out["n"] == 4
    assert out["speedup_ci"][0] < out["speedup"] < out["speedup_ci"][1]


def test_bench_decoding_runs_only_the_parts_asked_for(tmp_path):
    """--parts drafters: the per-call costs, the AR row and the drafter families, each with the torch calls its
    round makes in AR steps (a drafter that drafts must ask more of torch per round than an AR step does); no
    speculative section, so no speedup figure."""
    bench = load_script("bench_decoding")
    results = bench.main(
        ["--shape", "tiny", "--quick", "--no-hf", "--parts", "drafters", "--out", str(tmp_path)]
    )
    assert {p.name for p in tmp_path.iterdir()} == {"results.json", "results.md"}
    res = results["shapes"][0]
    assert {"costs", "ar", "drafters"} <= set(res) and not {"syncs", "sampler", "speculative", "batch"} & set(
        res
    )
    assert len(res["drafters"]) == 5 and all(row["ops_per_round"] > 1 for row in res["drafters"])
    assert "Drafter families" in (tmp_path / "results.md").read_text()
    with pytest.raises(SystemExit):
        bench.parse_args(["--parts", "drafterz"])


def test_bench_acceptance_times_every_rule_and_counts_the_calls_of_one_step(tmp_path):
    """Every rule gets a row, timed beside the exact rule's step with a CI; its torch-call column is what one step
    asks of torch, counted by the benchmark's own counter: PCG's group work asks more of torch than the exact
    rule's ratio test does."""
    bench_acceptance = load_script("bench_acceptance")
    argv = ["--vocabs", "toy", "--batches", "1", "--group-sizes", "2", "--repeats", "2", "--no-target"]
    results = bench_acceptance.main([*argv, "--out", str(tmp_path)])
    assert {p.name for p in tmp_path.iterdir()} == {"results.json", "results.md"}
    rows = {row["rule"]: row for row in results["rows"]}
    assert set(rows) == {
        "exact",
        "tolerance β=0.4",
        "greedy",
        "target_only",
        "typical",
        "pcg, mean group 2.0",
    }
    assert all(row["step_ms"] > 0 for row in rows.values())
    assert all(row["vs_exact_ci"][0] <= row["vs_exact"] <= row["vs_exact_ci"][1] for row in rows.values())
    assert rows["pcg, mean group 2.0"]["torch_calls"] > rows["exact"]["torch_calls"] > 10
    assert "torch calls" in (tmp_path / "results.md").read_text()
    assert all(row["vs_target_call"] is None for row in rows.values())  # --no-target: no call was timed


def test_bench_acceptance_gives_each_step_as_a_share_of_a_target_call_with_its_ci(tmp_path):
    """The share of a target call is × exact times the exact step's share, each from its pairs: a rule's CI
    holds its estimate and every rule's share is its × exact times the same factor. (How large a share is, is
    the benchmark's finding, not a test's: the tests share the machine.)"""
    bench_acceptance = load_script("bench_acceptance")
    argv = ["--vocabs", "toy", "--batches", "1", "--group-sizes", "2", "--repeats", "6"]
    results = bench_acceptance.main([*argv, "--out", str(tmp_path)])
    rows = {row["rule"]: row for row in results["rows"]}
    for row in rows.values():
        lo, hi = row["vs_target_call_ci"]
        assert lo <= row["vs_target_call"] <= hi and row["vs_target_call"] > 0 and row["target_call_ms"] > 0
    factor = rows["exact"]["vs_target_call"] / rows["exact"]["vs_exact"]
    assert rows["pcg, mean group 2.0"]["vs_target_call"] == pytest.approx(
        rows["pcg, mean group 2.0"]["vs_exact"] * factor
    )
    assert "% of a target call [95% CI]" in (tmp_path / "results.md").read_text()


def test_bench_decoding_quick_run_writes_its_tables(tmp_path):
    bench = load_script("bench_decoding")
    results = bench.main(["--shape", "tiny", "--quick", "--out", str(tmp_path)])
    assert {p.name for p in tmp_path.iterdir()} == {"results.json", "results.md", "speedup.png"}
    assert json.loads((tmp_path / "results.json").read_text())["shapes"][0]["shape"] == "tiny"
    res = results["shapes"][0]
    assert res["ar"]["hf_max_abs_logit_diff"] < 1e-4  # HF holds the engine's weights
    systems = {(r["system"], r["rule"]) for r in res["speculative"]}
    assert ("engine", "exact (random-weight α)") in systems and ("engine", "SYNTHETIC α=0.8") in systems
    assert any(system == "HF assisted" for system, _ in systems)
    assert all(r["tokens_per_s"] > 0 and r["speedup_ci"][0] <= r["speedup"] <= r["speedup_ci"][1]
               for r in res["speculative"])  # fmt: skip
    assert [r["batch"] for r in res["batch"]] == [1, 2]
    assert set(res["syncs"]) == {"eager cache path", "static cache path"}
    for per_mode in res["syncs"].values():
        assert per_mode["ar"]["rounds"] == 2 * res["tokens"]  # AR's round is one token; the longer decode
        for s in per_mode.values():
            assert s["per_round"] > 0 and sum(s["by_call"].values()) == s["syncs"]
            # Both cache paths (eager, and the static one a compiled step runs) read the device once per round.
            assert s["per_round"] <= 1.0
    md = (tmp_path / "results.md").read_text()
    for heading in (
        "Per-call cost",
        "Sampler",
        "Host syncs per round",
        "Speculative, batch 1",
        "Batch throughput",
    ):
        assert heading in md
    assert "SYNTHETIC" in md


def test_gpu_check_runs_on_cpu_when_quick_and_refuses_otherwise(tmp_path, capsys):
    gpu_check = load_script("gpu_check")
    assert gpu_check.main(["--device", "cpu", "--quick", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "results.json").read_text())
    checks = gpu_check.all_checks(report)
    assert all(c["ok"] for c in checks.values()), checks
    assert any("negative control" in name for name in checks) and any(
        "compiled == eager" in n for n in checks
    )
    assert (
        report["decoding"]["runs"] and report["batch"]["rows"] and report["syncs"]["torch-function counter"]
    )
    drafters = {r["drafter"] for r in report["drafters"]["rows"]}
    assert drafters == {"layers (SSD)", "medusa heads", "mtp heads", "eagle (feature)", "block (parallel)"}
    summary = (tmp_path / "summary.md").read_text()
    assert "Correctness" in summary and "Drafter families" in summary
    assert report["fsdp"]["not_run"] == gpu_check.FSDP_NEEDS_CUDA and not any("FSDP" in n for n in checks)
    assert f"Not run: fsdp: {gpu_check.FSDP_NEEDS_CUDA}" in summary
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.parse_args(["--device", "cpu"])
    assert exit_info.value.code == 2
    assert "--device cpu --quick" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as exit_info:
            gpu_check.parse_args([])
        assert exit_info.value.code == 2


def test_gpu_checks_fsdp_stage_trains_the_micro_draft_and_loads_it_with_the_cpu_trainer(tmp_path):
    """The fsdp stage's world, command and load check, with trainer=cpu: Lightning runs FSDP on CUDA only,
    where `make gpu-check` runs this same path with trainer=fsdp."""
    for tool in ("flite", "sox"):
        if shutil.which(tool) is None:
            pytest.skip(f"the toy world needs `{tool}` (apt-get install -y flite sox)")
    gpu_check = load_script("gpu_check")
    run = gpu_check.train_micro_draft(tmp_path, ["trainer=cpu"], timeout_s=900)
    assert run["steps"] == gpu_check.FSDP_STEPS and run["draft_layers"]


@pytest.mark.slow  # the batched records' equality is tested in the fast suite (test_runner.py)
def test_bench_sweep_times_batch_1_against_batched_and_finds_them_identical(micro_world, tmp_path):
    from tests.fixtures_eval import sweep_overrides

    bench = load_script("bench_sweep")
    out = tmp_path / "bench"
    args = [
        *sweep_overrides(micro_world, n_utts=3, max_len=15),
        "--grid",
        "beta=0,0.4",
        "--batch",
        "3",
        "--out",
        str(out),
    ]
    assert bench.main(args) == 0
    result = json.loads((out / "results.json").read_text())
    assert result["all_identical"] is True and result["wall_s_batch1"] > 0 and result["wall_s_batch3"] > 0
    assert set(result["jobs"]) == {"beta=0.0", "beta=0.4", "baseline"}
    assert all(j["utterances"] == 3 and j["tokens_identical"] for j in result["jobs"].values())
    assert {p.name for p in out.iterdir()} >= {"summary.md", "command.txt", "machine.txt", "git_commit.txt"}
    with pytest.raises(SystemExit, match="exists"):  # a timing never reuses a finished sweep dir
        bench.main(args)


def test_bench_judge_isolation_pairs_every_condition_with_back_to_back(micro_world, tmp_path):
    from tests.fixtures_eval import sweep_overrides

    bench = load_script("bench_judge_isolation")
    out = tmp_path / "isolation"
    assert bench.main([*sweep_overrides(micro_world, n_utts=2, max_len=10), "--items", "2", "--reps", "2",
                       "--out", str(out)]) == 0  # fmt: skip
    result = json.loads((out / "results.json").read_text())
    rows = {r["condition"]: r for r in result["rows"]}
    assert set(rows) == {
        "back to back, before any judge ran", "back to back", "vocoder (as run)", "asr (as run)", "sim (as run)",
        "mos (as run)", "sim (BLAS on every thread)", "mos (BLAS on every thread)",
        "mos (BLAS on every thread, ONNX spinning: before)",
    }  # fmt: skip
    # Each ratio pairs a condition's decode with the back-to-back decode of the same (repetition, item).
    seconds = {name: np.array(times) for name, times in result["decode_seconds"].items()}
    assert seconds["back to back"].shape == (2, 2) and rows["back to back"]["ratio_median"] is None
    for name, times in seconds.items():
        if name != "back to back":
            assert rows[name]["ratio_median"] == pytest.approx(
                float(np.median(times / seconds["back to back"]))
            )
    assert rows["mos (as run)"]["judge_ms_per_call"] > 0
    assert all(r["decode_s_total"] > 0 and r["vs_first_pass"] > 0 for r in rows.values())
    assert {p.name for p in out.iterdir()} >= {"summary.md", "command.txt", "machine.txt", "git_commit.txt"}
