"""`python sweep.py` as a user runs it: composition, subprocess multiruns on the micro toy world, a failing
job that does not stop the sweep, W&B offline, and resume after a kill."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from ssd.evaluation.run_dir import BASELINES_DIR, ERROR_FILE, METRICS_FILE, RESULTS_FILE, read_records
from tests.fixtures_eval import (
    REPO,
    compose_sweep_config,
    run_sweep,
    sweep_env,
    write_micro_config,
)

# --- composition (no models) -----------------------------------------------------------------------


def test_the_users_sweep_keys_are_top_level():
    cfg = compose_sweep_config(["beta=0.2", "draft_len=4", "theta=0.3"])
    assert cfg.acceptance._target_ == "ssd.decoding.acceptance.ToleranceRule" and cfg.acceptance.beta == 0.2
    assert cfg.decoding._target_.endswith("Speculative") and cfg.decoding.draft_len == 4
    assert compose_sweep_config(["acceptance=pcg", "theta=0.3"]).acceptance.theta == 0.3
    assert compose_sweep_config(["decoding=ar"]).decoding._target_.endswith("Autoregressive")
    assert compose_sweep_config(["decoding=draft_only"]).decoding._target_.endswith("DraftOnly")
    adaptive = compose_sweep_config(["decoding.adaptive.enabled=true"]).decoding.adaptive
    assert adaptive.enabled and adaptive.min_len <= adaptive.max_len


def test_eval_configs_document_the_paper_setting():
    test = compose_sweep_config(["eval=libritts_test_clean"]).eval
    assert (test.n_utts, test.n_speakers, list(test.target_sec)) == (500, 37, [4.0, 10.0])
    assert 2.0 <= sum(test.prompt_sec) / 2 <= 4.0  # ~3 s prompts
    dev = compose_sweep_config(["eval=libritts_dev_clean"]).eval
    assert dev.split == "dev" and list(dev.subsets) == ["dev-clean"]
    assert compose_sweep_config(["eval=toy_dev"]).eval.subsets[0] == "dev-clean"


@pytest.mark.parametrize("launcher", ["joblib", "submitit_slurm", "submitit_local"])
def test_launcher_configs_compose_render_and_build(launcher, tmp_path):
    cfg = compose_sweep_config([f"hydra/launcher={launcher}", f"hydra.sweep.dir={tmp_path}"], with_hydra=True)
    rendered = OmegaConf.to_yaml(cfg.hydra.launcher, resolve=True)
    assert "_target_" in rendered
    pytest.importorskip(f"hydra_plugins.hydra_{launcher.split('_')[0]}_launcher")  # optional extras
    launcher_obj = instantiate(cfg.hydra.launcher)  # the plugin accepts every field we set
    assert type(launcher_obj).__name__ in ("JoblibLauncher", "SlurmLauncher", "LocalLauncher")
    if launcher == "submitit_slurm":
        assert str(tmp_path) in cfg.hydra.launcher.submitit_folder


def test_job_dirs_are_named_by_overrides_without_paths():
    cfg = compose_sweep_config(["beta=0", "draft_len=2", "paths.data_dir=/x/y"], with_hydra=True)
    assert "paths.data_dir" in cfg.hydra.job.config.override_dirname.exclude_keys
    assert "${ssd.job_dirname:${hydra.job.override_dirname}}" in OmegaConf.to_yaml(cfg.hydra.sweep)
    assert "ssd.evaluation.callbacks.AggregateOnMultirunEnd" in OmegaConf.to_yaml(cfg.hydra.callbacks)


def test_submitit_multirun_renders_from_the_command_line():
    out = run_sweep(["hydra/launcher=submitit_slurm", "--cfg", "hydra", "--resolve"], timeout=120)
    assert out.returncode == 0, out.stderr
    assert "SlurmLauncher" in out.stdout and "timeout_min" in out.stdout


# --- subprocess sweeps on the micro world --------------------------------------------------------------


def _job_dirs(sweep_dir):
    """The sweep's job dirs (not the shared AR baselines)."""
    return sorted(
        p
        for p in sweep_dir.iterdir()
        if p.is_dir() and not p.name.startswith(".") and p.name != BASELINES_DIR
    )


def test_failed_job_keeps_the_others_and_wandb_runs_offline(micro_world, tmp_path):
    """beta=-1 is invalid: that job writes error.json, the beta=0.4 job finishes and logs to W&B offline."""
    config_dir = write_micro_config(micro_world, tmp_path / "conf", n_utts=2, max_len=20)
    sweep_dir = tmp_path / "sweep"
    out = run_sweep(["--config-dir", str(config_dir), "--config-name", "micro_sweep", "-m", "logger=wandb",
                     "beta=-1,0.4", "draft_len=2", f"hydra.sweep.dir={sweep_dir}"])  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    failed, ok = sweep_dir / "beta=-1,draft_len=2", sweep_dir / "beta=0.4,draft_len=2"
    error = json.loads((failed / ERROR_FILE).read_text())
    assert "beta=-1.0 must be >= 0" in error["error"] and not (failed / METRICS_FILE).exists()
    assert "sweep continues" in out.stderr + out.stdout
    assert len(read_records(ok / RESULTS_FILE)) == 2
    assert json.loads((ok / METRICS_FILE).read_text())["beta"] == 0.4
    offline_runs = list((ok / "wandb").glob("offline-run-*/run-*.wandb"))
    assert offline_runs, sorted(p.name for p in ok.rglob("*"))[:30]
    table = (sweep_dir / "table.md").read_text()
    assert "beta=0.4,draft_len=2" in table and "Failed jobs" in table and "beta=-1,draft_len=2" in table


def test_a_rule_from_a_users_own_module_runs_through_a_sweep(micro_world, tmp_path):
    """tests/plugin_rule.py lies outside the package and speaks only ssd.contracts.AcceptanceRule: one
    `_target_` override plugs it in, its own parameter labels the runs and the table."""
    config_dir = write_micro_config(micro_world, tmp_path / "conf", n_utts=2, max_len=15)
    sweep_dir = tmp_path / "sweep"
    out = run_sweep(["--config-dir", str(config_dir), "--config-name", "micro_sweep", "-m", "logger=none",
                     "acceptance=exact", "acceptance._target_=tests.plugin_rule.ThresholdRule",
                     "+acceptance.gamma=0.01,0.5", f"hydra.sweep.dir={sweep_dir}"])  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    metrics = {}
    for job in _job_dirs(sweep_dir):
        m = json.loads((job / METRICS_FILE).read_text())
        metrics[m["gamma"]] = m
        assert m["acceptance"] == "threshold" and "gamma" in m["setting_keys"]
        assert len(read_records(job / RESULTS_FILE)) == 2
    assert sorted(metrics) == [0.01, 0.5]
    # a looser threshold accepts more: the rule's own law reached the engine
    assert metrics[0.01]["acceptance_rate"] > metrics[0.5]["acceptance_rate"]
    header = (sweep_dir / "table.md").read_text().splitlines()[0]
    assert "gamma" in header


@pytest.mark.slow
def test_multirun_writes_every_job_and_the_table_then_resumes(micro_world, tmp_path):
    config_dir = write_micro_config(micro_world, tmp_path / "conf", n_utts=2, max_len=20)
    sweep_dir = tmp_path / "sweep"
    args = ["--config-dir", str(config_dir), "--config-name", "micro_sweep", "-m", "logger=none",
            "beta=0,0.4", "draft_len=2,3", f"hydra.sweep.dir={sweep_dir}"]  # fmt: skip
    out = run_sweep(args)
    assert out.returncode == 0, out.stderr[-3000:]
    jobs = _job_dirs(sweep_dir)
    assert [p.name for p in jobs] == [f"beta={b},draft_len={d}" for b in ("0", "0.4") for d in (2, 3)]
    for job in jobs:
        assert len(read_records(job / RESULTS_FILE)) == 2
        metrics = json.loads((job / METRICS_FILE).read_text())
        assert len(metrics["alpha_per_position"]) == metrics["draft_len"]
    for name in ("table.md", "table.tex", "table.csv", "fig_speedup_acceptance_vs_draft_len.png",
                 "fig_wer_sim_vs_beta.png", "fig_alpha_per_position.png"):  # fmt: skip
        assert (sweep_dir / name).is_file(), name
    assert (sweep_dir / "table.md").read_text().count("| speculative |") == 4
    before = {job.name: (job / RESULTS_FILE).read_bytes() for job in jobs}

    again = run_sweep(args)  # the same command into the same sweep dir: every job resumes, nothing redone
    assert again.returncode == 0, again.stderr[-3000:]
    assert (again.stdout + again.stderr).count("2 already done, 0 to go") == 4
    assert {job.name: (job / RESULTS_FILE).read_bytes() for job in jobs} == before


@pytest.mark.slow
def test_killed_run_resumes_without_loss_or_duplicates(micro_world, tmp_path):
    config_dir = write_micro_config(micro_world, tmp_path / "conf", n_utts=5, max_len=30)
    run_dir = tmp_path / "run"
    # Batches of 2: the kill lands between batches, and the resume picks up at utterance granularity.
    cmd = [sys.executable, str(REPO / "sweep.py"), "--config-dir", str(config_dir), "--config-name",
           "micro_sweep", "logger=none", "eval.batch_size=2", f"hydra.run.dir={run_dir}"]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    results = run_dir / RESULTS_FILE
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and (not results.is_file() or results.read_text().count("\n") < 2):
        if proc.poll() is not None:
            pytest.fail("the run finished before it could be killed")
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    written = read_records(results)
    assert 2 <= len(written) < 5

    out = run_sweep(["--config-dir", str(config_dir), "--config-name", "micro_sweep", "logger=none",
                     "eval.batch_size=2", f"hydra.run.dir={run_dir}"])  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    final = read_records(results)
    utts = [r["utt"] for r in final]
    assert len(utts) == len(set(utts)) == 5
    assert final[: len(written)] == written
    assert json.loads((run_dir / METRICS_FILE).read_text())["num_utterances"] == 5


def _kill_a_launched_sweep_then_resume(micro_world, tmp_path, launcher: list[str]) -> None:
    """`python sweep.py -m <launcher> beta=0,0.4` killed (its whole process group: the launcher's workers
    too) once a job has written a record, then the same command again into the same sweep dir: every job
    finishes with its whole test list, the records written before the kill kept, none twice."""
    n = 3
    config_dir = write_micro_config(micro_world, tmp_path / "conf", n_utts=n, max_len=15)
    sweep_dir = tmp_path / "sweep"
    # No AR baseline and no MOS judge (each job would load one): the resume of the launcher's jobs is what is
    # tested. Batches of 1: a job writes its records one by one, so the kill lands inside a job's list.
    args = ["--config-dir", str(config_dir), "--config-name", "micro_sweep", "-m", "logger=none",
            "auto_baseline=false", "mos=none", "eval.batch_size=1", "beta=0,0.4", "draft_len=2",
            f"hydra.sweep.dir={sweep_dir}", *launcher]  # fmt: skip
    log = tmp_path / "killed_sweep.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, str(REPO / "sweep.py"), *args], cwd=REPO, env=sweep_env(),
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 600  # generous: this machine may be paused by other work
    while not any(read_records(p) for p in sweep_dir.glob(f"*/{RESULTS_FILE}")):
        if proc.poll() is not None or time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):  # whatever of the sweep still runs
                os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(
                f"no job wrote a record before the sweep ended (rc {proc.poll()}):\n{log.read_text()[-3000:]}"
            )
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    before = {job.name: read_records(job / RESULTS_FILE) for job in _job_dirs(sweep_dir)}
    assert not all((sweep_dir / name / METRICS_FILE).is_file() for name in before), "the kill came too late"

    again = run_sweep(args)
    assert again.returncode == 0, again.stderr[-3000:]
    jobs = _job_dirs(sweep_dir)
    assert [job.name.split(",")[0] for job in jobs] == ["beta=0", "beta=0.4"]
    for job in jobs:
        records = read_records(job / RESULTS_FILE)
        utts = [r["utt"] for r in records]
        assert len(utts) == len(set(utts)) == n, job.name
        assert records[: len(before.get(job.name, []))] == before.get(job.name, []), job.name
        assert json.loads((job / METRICS_FILE).read_text())["num_utterances"] == n


def test_a_joblib_sweep_killed_midway_resumes_every_job(micro_world, tmp_path):
    _kill_a_launched_sweep_then_resume(
        micro_world, tmp_path, ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"]
    )


def test_a_submitit_local_sweep_killed_midway_resumes_every_job(micro_world, tmp_path):
    # submitit's local executor runs each job under a controller process that it starts in our process group
    # (no new session), so killing the group kills the controllers and their jobs with the sweep.
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")  # pip install -e ".[slurm]"
    _kill_a_launched_sweep_then_resume(micro_world, tmp_path, ["hydra/launcher=submitit_local"])


def test_a_sweep_without_ar_gets_its_speedup_and_paired_wer_from_one_shared_baseline(micro_world, tmp_path):
    """The user's command names no decoding=ar: the first job runs the matching AR baseline once into
    <sweep>/baselines/ (same test list, seeds, target and sampling), the other reuses it, and every job's
    metrics and the table carry its speedup (timed beside AR in the job, whose AR tokens are the baseline's)
    and ΔWER vs AR, each with its CI. Rerun: nothing is decoded again."""
    config_dir = write_micro_config(micro_world, tmp_path / "conf", n_utts=3, max_len=20)
    sweep_dir = tmp_path / "sweep"
    args = ["--config-dir", str(config_dir), "--config-name", "micro_sweep", "-m", "logger=none",
            "beta=0,0.4", "draft_len=2", f"hydra.sweep.dir={sweep_dir}"]  # fmt: skip
    out = run_sweep(args)
    assert out.returncode == 0, out.stderr[-3000:]
    (baseline,) = _job_dirs(sweep_dir / BASELINES_DIR)  # one AR run for both settings
    ar = json.loads((baseline / METRICS_FILE).read_text())
    assert ar["decoding"] == "ar" and ar["num_utterances"] == 3
    ar_records = {r["utt"]: r for r in read_records(baseline / RESULTS_FILE)}
    for job in _job_dirs(sweep_dir):
        metrics = json.loads((job / METRICS_FILE).read_text())
        assert metrics["baseline_dir"] == str(baseline)
        records = read_records(job / RESULTS_FILE)
        assert metrics["speedup_utterances"] == 3 and metrics["speedup"] == pytest.approx(
            sum(r["baseline_lm_time"] for r in records) / sum(r["lm_time"] for r in records)
        )
        assert metrics["speedup_ci"][0] <= metrics["speedup"] <= metrics["speedup_ci"][1]
        assert metrics["paired_utterances"] == 3
        lo, hi = metrics["wer_delta_vs_ar_ci"]
        assert lo <= metrics["wer_delta_vs_ar"] <= hi
        # Same seeds per utterance as the baseline: the prompt's speech is identical.
        assert [r["seed"] for r in records] == [ar_records[r["utt"]]["seed"] for r in records]
    header, _, *rows = (sweep_dir / "table.md").read_text().splitlines()
    assert "speedup" in header and "ΔWER vs AR" in header and "E2E-RTF" in header
    spec_rows = [row for row in rows if "| speculative |" in row]
    assert len(spec_rows) == 2 and any(row.startswith(f"| {BASELINES_DIR}/") for row in rows)
    columns = header.split(" | ")
    for row in spec_rows:
        cells = row.split(" | ")
        assert (
            cells[columns.index("speedup [95% CI]")] != "-"
            and cells[columns.index("ΔWER vs AR pts [95% CI]")] != "-"
        )

    again = run_sweep(args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (again.stdout + again.stderr).count("3 already done, 0 to go") == 2
    assert "AR baseline for the speedup column" not in again.stdout + again.stderr
