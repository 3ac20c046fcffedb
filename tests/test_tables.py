"""Aggregation of a sweep dir into tables and figures, and choosing beta / L_d on the dev split."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from ssd.evaluation.metrics import paired_vs_ar, summarize
from ssd.evaluation.report import aggregate
from ssd.evaluation.run_dir import ERROR_FILE, METRICS_FILE, RESULTS_FILE
from ssd.evaluation.selection import matching_row, select_setting
from ssd.evaluation.sweep_runs import load_runs, setting_keys
from ssd.evaluation.tables import display_table
from tests.fixtures_eval import REPO


def _records(rng, n, rtf, wer, alpha, draft_len, ar_rtf=None):
    """Synthetic per-utterance records with a given LM-RTF, WER level and per-position acceptance; with `ar_rtf`,
    each utterance also timed by the AR baseline beside it."""
    out = []
    for i in range(n):
        audio = float(rng.uniform(2, 6))
        ref = 10
        errors = int(rng.binomial(ref, wer))
        proposed, accepted, reach = [], [], 20
        for _ in range(draft_len):
            kept = int(rng.binomial(reach, alpha))
            proposed.append(reach)
            accepted.append(kept)
            reach = kept
        out.append({
            "utt": f"u{i}", "lm_time": audio * rtf * float(rng.uniform(0.9, 1.1)), "audio_sec": audio,
            "n_tokens": int(audio * 25), "errors": errors, "ref_words": ref, "wer": errors / ref,
            "sim": float(rng.uniform(0.7, 0.8)), "target_calls": 20, "draft_calls": 20 * draft_len,
            "rounds": 20, "accepted_total": sum(accepted), "proposed": proposed, "accepted": accepted,
            "overlap_sum": [a * 1.0 for a in accepted], "tv_sum": [0.0] * draft_len, "finish_reason": "stop",
            "baseline_lm_time": audio * ar_rtf * float(rng.uniform(0.9, 1.1)) if ar_rtf else None,
        })  # fmt: skip
    return out


def _write_run(run_dir, labels, records):
    run_dir.mkdir(parents=True)
    metrics = {**summarize(records, 200, 0), **labels}
    (run_dir / METRICS_FILE).write_text(json.dumps(metrics))
    (run_dir / RESULTS_FILE).write_text("".join(json.dumps(r) + "\n" for r in records))


AR_LABELS = {"decoding": "ar", "reference": True, "setting_keys": ["decoding"]}


def make_sweep(root, split, ar_wer=0.10, seed=0):
    """AR + a 2x2 grid of (beta, L_d): beta=0.4 is faster but, at L_d=3, much worse."""
    rng = np.random.default_rng(seed)
    base = {"target": "toy", "eval": f"toy_{split}", "split": split}
    _write_run(root / "decoding=ar", {**base, **AR_LABELS}, _records(rng, 60, 0.5, ar_wer, 0, 0))
    for beta in (0.0, 0.4):
        for draft_len in (2, 3):
            rtf = 0.5 / (1.2 + beta + 0.1 * draft_len)
            wer = ar_wer + (0.3 if beta == 0.4 and draft_len == 3 else 0.0)
            labels = {**base, "decoding": "speculative", "draft": "toy", "acceptance": "tolerance", "beta": beta,
                      "draft_len": draft_len, "adaptive": False, "reference": False,
                      "setting_keys": ["decoding", "draft", "acceptance", "beta", "draft_len", "adaptive"]}  # fmt: skip
            records = _records(rng, 60, rtf, wer, 0.6 + beta / 2, draft_len, ar_rtf=0.5)
            _write_run(root / f"beta={beta:g},draft_len={draft_len}", labels, records)
    return root


def test_aggregate_writes_tables_and_figures_with_speedups(tmp_path):
    sweep = make_sweep(tmp_path / "sweep", "test")
    table = aggregate(sweep)
    assert len(table) == 5 and table["decoding"].iloc[0] == "ar"  # AR first
    spec = table[table["decoding"] == "speculative"]
    truth = 1.2 + spec["beta"] + 0.1 * spec["draft_len"]  # each run's AR beside it is this much slower
    assert (spec["speedup_ci_lo"] < truth).all() and (truth < spec["speedup_ci_hi"]).all()
    assert (spec["speedup_ci_hi"] - spec["speedup_ci_lo"] < 0.1 * truth).all()
    assert (
        table.loc[table["decoding"] == "ar", "speedup"].isna().all()
    )  # the reference is not timed against itself
    for (
        _,
        row,
    ) in spec.iterrows():  # alpha per position made it into the table (synthetic alpha = 0.6 + beta/2)
        assert row["alpha_1"] == pytest.approx(0.6 + row["beta"] / 2, abs=0.06)
        assert row[f"alpha_{int(row['draft_len'])}"] == pytest.approx(0.6 + row["beta"] / 2, abs=0.12)

    markdown = (sweep / "table.md").read_text()
    assert markdown.count("\n|") == 1 + 5  # header rule + 5 runs
    assert "LM-RTF [95% CI]" in markdown and "WER % [95% CI]" in markdown and "[" in markdown
    assert "\\begin{tabular}" in (sweep / "table.tex").read_text()
    csv = pd.read_csv(sweep / "table.csv")
    assert {"lm_rtf_ci_lo", "lm_rtf_ci_hi", "wer_ci_lo", "sim_ci_hi", "speedup"} <= set(csv.columns)
    for name in (
        "fig_speedup_acceptance_vs_draft_len.png",
        "fig_wer_sim_vs_beta.png",
        "fig_alpha_per_position.png",
    ):
        assert (sweep / name).stat().st_size > 1000


def test_failed_jobs_are_listed_not_hidden(tmp_path):
    sweep = make_sweep(tmp_path / "sweep", "test")
    (sweep / "beta=-1,draft_len=2").mkdir()
    (sweep / "beta=-1,draft_len=2" / ERROR_FILE).write_text(json.dumps({"error": "ValueError: bad beta"}))
    table = aggregate(sweep, figures=False)
    assert (table["status"] == "failed").sum() == 1
    assert "beta=-1,draft_len=2: ValueError: bad beta" in (sweep / "table.md").read_text()


def test_an_explicit_baseline_run_is_what_quality_is_paired_against(tmp_path):
    sweep = make_sweep(tmp_path / "sweep", "test")
    baseline = tmp_path / "other_ar"
    worse_ar = _records(np.random.default_rng(5), 60, 1.0, 0.5, 0, 0)
    _write_run(baseline, AR_LABELS, worse_ar)
    table = aggregate(sweep, baseline_dir=baseline, figures=False)
    spec = table[table["decoding"] == "speculative"]
    for _, row in spec.iterrows():
        records = [json.loads(line) for line in (sweep / row["run"] / RESULTS_FILE).read_text().splitlines()]
        assert row["wer_delta_vs_ar"] == pytest.approx(
            paired_vs_ar(worse_ar, records, 1000, 0)["wer_delta_vs_ar"]
        )
    assert (spec["wer_delta_vs_ar"] < -5).all()  # against a baseline at 50 % WER, not the sweep AR at 10 %


def test_select_on_dev_picks_the_fastest_setting_without_wer_loss(tmp_path):
    dev = aggregate(make_sweep(tmp_path / "dev", "dev", seed=1), figures=False)
    chosen = select_setting(dev)
    # beta=0.4, L_d=3 is the fastest but its WER CI is far above AR's: the rule must skip it.
    assert (chosen["beta"], chosen["draft_len"]) == (0.4, 2)
    test = aggregate(make_sweep(tmp_path / "test", "test", seed=2), figures=False)
    row = matching_row(test, chosen)
    assert (row["beta"], row["draft_len"], row["split"]) == (0.4, 2, "test")


def test_select_on_dev_ranks_by_the_speedup_timed_in_pairs_not_by_lm_rtfs_of_separate_processes(tmp_path):
    """The fastest setting ran in a process twice as slow as the others (its LM-RTF says it is the slowest; its
    AR decodes beside it were slowed alike): the choice follows the paired speedup. Negative control: ranking
    by LM-RTF would pick another setting."""
    sweep = make_sweep(tmp_path / "dev", "dev", seed=1)
    run = sweep / "beta=0.4,draft_len=2"
    records = [json.loads(line) for line in (run / RESULTS_FILE).read_text().splitlines()]
    for r in records:
        r["lm_time"], r["baseline_lm_time"] = 2 * r["lm_time"], 2 * r["baseline_lm_time"]
    (run / RESULTS_FILE).write_text("".join(json.dumps(r) + "\n" for r in records))
    labels = {
        k: v
        for k, v in json.loads((run / METRICS_FILE).read_text()).items()
        if k not in summarize(records, 200, 0)
    }
    (run / METRICS_FILE).write_text(json.dumps({**summarize(records, 200, 0), **labels}))
    dev = aggregate(sweep, figures=False)
    chosen = select_setting(dev)
    assert (chosen["beta"], chosen["draft_len"]) == (0.4, 2)
    by_rtf = select_setting(dev.drop(columns=["speedup"]))
    assert (by_rtf["beta"], by_rtf["draft_len"]) != (0.4, 2)


def test_select_needs_an_ar_run(tmp_path):
    sweep = make_sweep(tmp_path / "dev", "dev")
    for path in (sweep / "decoding=ar").iterdir():
        path.unlink()
    (sweep / "decoding=ar").rmdir()
    with pytest.raises(ValueError, match="decoding=ar"):
        select_setting(load_runs(sweep))


def test_load_runs_names_a_missing_sweep_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_runs(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="nothing to aggregate"):
        load_runs(tmp_path)


def test_a_user_rules_parameter_gets_its_own_column_rows_and_figure(tmp_path):
    """metrics.json lists its setting keys: a rule parameter the tables have never heard of is shown."""
    sweep = tmp_path / "sweep"
    rng = np.random.default_rng(3)
    base = {"target": "toy", "eval": "toy", "split": "test"}
    _write_run(sweep / "decoding=ar", {**base, **AR_LABELS}, _records(rng, 20, 0.5, 0.1, 0, 0))
    for gamma in (0.5, 0.1):
        labels = {**base, "decoding": "speculative", "acceptance": "my_rule", "gamma": gamma, "draft_len": 3,
                  "adaptive": False, "draft": "toy", "reference": False,
                  "setting_keys": ["decoding", "acceptance", "gamma", "draft_len", "adaptive"]}  # fmt: skip
        _write_run(sweep / f"gamma={gamma:g}", labels, _records(rng, 20, 0.4, 0.1, 0.7, 3))
    table = aggregate(sweep)
    assert setting_keys(table) == ["decoding", "acceptance", "gamma", "draft_len", "adaptive"]
    assert table["gamma"].tolist()[1:] == [0.1, 0.5]  # sorted by the parameter, AR first
    shown = display_table(table)
    assert list(shown.columns[:6]) == ["run", "decoding", "rule", "gamma", "L_d", "adaptive"]
    assert shown["gamma"].tolist() == ["-", "0.1", "0.5"]
    header, _, *rows = (sweep / "table.md").read_text().splitlines()
    assert "| gamma |" in header and len(rows) == 3
    assert "| gamma=0.1 | speculative | my_rule | 0.1 | 3 |" in rows[1]
    assert "| gamma=0.5 | speculative | my_rule | 0.5 | 3 |" in rows[2]
    assert (sweep / "fig_wer_sim_vs_gamma.png").stat().st_size > 1000  # the varying parameter is the x axis
    row = matching_row(table, table[table["gamma"] == 0.5].iloc[0])
    assert row["run"] == "gamma=0.5"


def test_make_tables_cli_prints_the_table_and_the_selection(tmp_path):
    test_dir = make_sweep(tmp_path / "test", "test", seed=2)
    dev_dir = make_sweep(tmp_path / "dev", "dev", seed=1)
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make_tables.py"), str(test_dir), "--select-on", str(dev_dir),
         "--no-figures"],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "| decoding=ar | ar |" in out.stdout
    assert "chosen on dev" in out.stdout and "'beta': 0.4" in out.stdout and "'draft_len': 2" in out.stdout
    reported = out.stdout.split("reported on test:")[1]
    assert "beta=0.4,draft_len=2" in reported and "beta=0.4,draft_len=3" not in reported


def test_the_table_pairs_each_setting_with_ar_on_the_same_utterances(tmp_path):
    """ΔWER vs AR is a paired difference with a bootstrap CI: the setting built 30 points worse must show
    ~+30 with a CI above 0, the settings built with AR's WER a CI that contains 0 (negative control)."""
    sweep = make_sweep(tmp_path / "sweep", "test")
    table = aggregate(sweep, figures=False)
    spec = table[table["acceptance"].notna()].set_index(["beta", "draft_len"])
    worse = spec.loc[(0.4, 3)]
    assert worse["wer_delta_vs_ar"] == pytest.approx(30, abs=8) and worse["wer_delta_vs_ar_ci_lo"] > 10
    for setting in ((0.0, 2), (0.0, 3), (0.4, 2)):
        row = spec.loc[setting]
        assert row["wer_delta_vs_ar_ci_lo"] <= 0 <= row["wer_delta_vs_ar_ci_hi"], setting
    shown = display_table(table)
    assert shown["ΔWER vs AR pts [95% CI]"].iloc[0] == "-"  # the AR row itself
    assert shown["ΔWER vs AR pts [95% CI]"].str.match(r"^-?\d+\.\d \[-?\d+\.\d, -?\d+\.\d\]$").iloc[1:].all()
    # The speedup is the run's own (timed beside its baseline), shown with its CI and the timed n.
    own = json.loads((sweep / "beta=0,draft_len=2" / METRICS_FILE).read_text())
    paired = {"speedup": 1.25, "speedup_ci": [1.2, 1.31], "speedup_utterances": 40}
    (sweep / "beta=0,draft_len=2" / METRICS_FILE).write_text(json.dumps({**own, **paired}))
    shown = display_table(aggregate(sweep, figures=False)).set_index("run")
    assert shown.loc["beta=0,draft_len=2", "speedup [95% CI]"] == "1.25 [1.20, 1.31]"
    assert shown.loc["beta=0,draft_len=2", "timed n"] == "40"


def test_e2e_rtf_and_throughput_come_from_the_records():
    records = [
        {"utt": "a", "lm_time": 1.0, "vocoder_time": 0.5, "decode_time_share": 0.25, "audio_sec": 2.0,
         "n_tokens": 50},
        {"utt": "b", "lm_time": None, "vocoder_time": 0.5, "decode_time_share": 0.25, "audio_sec": 4.0,
         "n_tokens": 100},
    ]  # fmt: skip
    m = summarize(records, 0)
    assert m["lm_rtf"] == pytest.approx(1.0 / 2.0)  # batch-1 latency: the timed record only
    assert m["e2e_rtf"] == pytest.approx(1.5 / 2.0)
    assert m["vocoder_share"] == pytest.approx(0.5 / 1.5) and m["timed_utterances"] == 1
    assert m["throughput_utts_per_sec"] == pytest.approx(2 / 0.5)
    assert m["throughput_tokens_per_sec"] == pytest.approx(150 / 0.5)
    old = [{k: v for k, v in r.items() if k != "vocoder_time"} for r in records]
    assert np.isnan(summarize(old, 0)["e2e_rtf"])  # not timed: unknown, not "LM time alone"


AR_LM_TIME = 0.5  # the AR run's time for each utterance in the cost test


def _cost_records(lm_times, slower=None):
    """Records with phase times: an AR call costs 0.01 s a token in the AR run; with `slower`, the run's own AR
    decodes beside it took `slower` times the AR run's, and its verify calls cost 1.2 and its draft calls 0.3 of
    those AR calls; without, 1.2 and 0.3 of the AR run's."""
    scale = slower or 1.0
    return [{"utt": f"u{i}", "lm_time": t, "audio_sec": 2.0, "n_tokens": 50, "errors": 0, "ref_words": 5,
             "wer": 0.0, "target_calls": 20, "draft_calls": 60, "rounds": 20, "time_verify": 20 * 0.012 * scale,
             "time_draft": 60 * 0.003 * scale, "proposed": [20, 15, 10], "accepted": [15, 10, 5],
             "baseline_lm_time": AR_LM_TIME * slower if slower else None, "finish_reason": "stop"}
            for i, t in enumerate(lm_times)]  # fmt: skip


def test_the_cost_columns_are_in_ar_calls_of_the_runs_own_process(tmp_path):
    """The per-call costs divide by an AR call of the process that timed the run: a run whose AR decodes beside it
    ran 1.5x slower than the AR run's is not charged 1.5x for its calls; a run that timed no AR beside it is
    measured against the AR run's calls (the negative control: the same phase times then read 1.5x)."""
    from ssd.evaluation.tables import build_table

    sweep, base = tmp_path / "sweep", {"target": "toy", "eval": "toy_test", "split": "test"}
    ar = [
        {**r, "time_verify": 20 * 0.01, "time_draft": 0.0, "draft_calls": 0}
        for r in _cost_records([AR_LM_TIME] * 6)
    ]
    _write_run(sweep / "decoding=ar", {**base, **AR_LABELS}, ar)
    spec = {**base, "decoding": "speculative", "draft": "toy", "acceptance": "exact", "draft_len": 3,
            "reference": False, "setting_keys": ["decoding", "draft_len"]}  # fmt: skip
    _write_run(sweep / "draft_len=3", spec, _cost_records([0.4] * 6, slower=1.5))
    _write_run(sweep / "draft_len=3,alone", {**spec, "draft": "alone"}, _cost_records([0.4] * 6, slower=None))
    _write_run(sweep / "draft_len=3,alone,slow", {**spec, "draft": "slow"},
               [{**r, "time_verify": r["time_verify"] * 1.5, "time_draft": r["time_draft"] * 1.5}
                for r in _cost_records([0.4] * 6)])  # fmt: skip
    table = build_table(sweep).set_index("run")
    for run in ("draft_len=3", "draft_len=3,alone"):
        assert table.loc[run, "verify_cost"] == pytest.approx(1.2)
        assert table.loc[run, "c_draft"] == pytest.approx(0.3)
        assert table.loc[run, "draft_per_round"] == pytest.approx(0.9)
    assert table.loc["draft_len=3,alone,slow", "verify_cost"] == pytest.approx(1.8)
    alpha = table.loc["draft_len=3", "acceptance_rate"]
    assert table.loc["draft_len=3", "predicted_speedup"] == pytest.approx(
        (1 - alpha**4) / (1 - alpha) / (0.9 + 1.2)
    )
