"""One table (markdown, LaTeX, CSV) over all runs of a sweep dir.

`build_table(sweep_dir)` reads every evaluation run dir below `sweep_dir` (`ssd.evaluation.sweep_runs`: a
finished one is a row, every other one is listed under the table with what it is, never dropped). It adds ΔWER, ΔSIM and
ΔNMOS against the reference run of the same sweep (the target alone, `reference: true` in its metrics) or a
`baseline` run dir, and the measured per-call costs (`add_cost_columns`); `write_table` writes
`table.{md,tex,csv}` (`ssd.evaluation.report.aggregate` adds the figures). The experiment driver
(`ssd.experiments`) writes its tables with the same `write_table`; `ssd.evaluation.selection` chooses a
setting on a held-out split.

A run's decoding setting is named by the keys listed in its metrics.json `setting_keys` (its decoder's labels,
e.g. ["decoding", "draft", "acceptance", "beta", "draft_len", "adaptive"]; a rule's own parameters, whatever
their names, are among them). The table's setting columns are those keys over all runs (`setting_keys`);
sorting, the shown columns, the figures' curves and matching a setting across sweeps all use them.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ssd.evaluation.metrics import paired_vs_ar
from ssd.evaluation.run_dir import (
    METRICS_FILE,
    RESULTS_FILE,
    read_records,
)
from ssd.evaluation.sweep_runs import load_runs, setting_keys
from ssd.files import write_atomic

# Setting keys that are not an acceptance rule's own parameters.
DECODING_KEYS = ("decoding", "draft", "acceptance", "draft_len", "adaptive")
COLUMN_NAMES = {"acceptance": "rule", "draft_len": "L_d"}  # setting key -> table header
SYMBOLS = {"beta": "β", "draft_len": "L_d"}  # setting key -> figure label
COST_KEYS = ("time_draft", "draft_calls", "time_verify", "target_calls", "rounds")
# Speculative - AR, paired by utterance (nmos: runs with a MOS judge).
PAIRED_KEYS = ("wer_delta_vs_ar", "sim_delta_vs_ar", "nmos_delta_vs_ar")


# --------------------------------------------------------------------------------------------------
# Rows
# --------------------------------------------------------------------------------------------------


def reference_rows(table: pd.DataFrame) -> pd.Series:
    """The finished runs every other run is compared with (the target alone, its tokens vocoded as generated)."""
    return (table["status"] == "ok") & table["reference"].fillna(False).astype(bool)


def verified_rows(table: pd.DataFrame) -> pd.Series:
    """The finished runs whose drafts an acceptance rule verified (speculative decoding)."""
    return (table["status"] == "ok") & table["acceptance"].notna()


def _ar_runs(table: pd.DataFrame, row: pd.Series) -> pd.DataFrame:
    """The reference runs of `table` with the row's target and eval."""
    same = reference_rows(table)
    for key in ("target", "eval"):
        if key in table:
            same &= table[key] == row.get(key)
    return table[same]


def add_paired_wer(
    table: pd.DataFrame, sweep_dir: str | Path, baseline_dir: str | Path | None = None
) -> pd.DataFrame:
    """ΔWER (points of %), ΔSIM (and ΔNMOS where both runs judged naturalness) vs AR on the same
    utterances, with paired bootstrap 95% CIs
    (`paired_vs_ar`), for rows whose metrics.json lacks them: against `baseline_dir` when given (then for
    every row), else the sweep's first AR run with the same target and eval."""
    sweep_dir = Path(sweep_dir)
    table = table.copy()
    for key in PAIRED_KEYS:
        for column in (key, f"{key}_ci_lo", f"{key}_ci_hi"):
            if column not in table or baseline_dir is not None:
                table[column] = np.nan
    for idx, row in table[(table["status"] == "ok") & ~reference_rows(table)].iterrows():
        if not pd.isna(row["wer_delta_vs_ar"]):
            continue
        if baseline_dir is not None:
            ar_dir = Path(baseline_dir)
        else:
            ar = _ar_runs(table, row)
            if ar.empty:
                continue
            ar_dir = sweep_dir / ar["run"].iloc[0]
        try:
            paired = paired_vs_ar(read_records(ar_dir / RESULTS_FILE, repair=False),
                                  read_records(sweep_dir / row["run"] / RESULTS_FILE, repair=False))  # fmt: skip
        except ValueError:  # the runs share fewer than 2 utterances: nothing to pair
            continue
        for key in (k for k in PAIRED_KEYS if k in paired):
            table.loc[idx, key] = paired[key]
            table.loc[idx, [f"{key}_ci_lo", f"{key}_ci_hi"]] = paired[f"{key}_ci"]
    return table


def _timed_records(run_dir: Path) -> list[dict]:
    """A run's batch-1 timed records (read only: the run may still be writing); the others' phase times are not
    batch-1 costs."""
    return [r for r in read_records(run_dir / RESULTS_FILE, repair=False) if r.get("lm_time") is not None]


def _run_sums(records: list[dict]) -> dict[str, float]:
    """Sums of the timing counts over timed records."""
    return {key: sum(float(r.get(key) or 0) for r in records) for key in COST_KEYS}


def _ar_speed_beside(records: list[dict], ar_records: list[dict]) -> float:
    """How much slower the AR decodes timed beside a run's own were than the AR run's decodes of the same
    utterances (Σ baseline_lm_time / Σ lm_time); 1 where the run timed no AR beside it."""
    ar_time = {r["utt"]: r["lm_time"] for r in ar_records}
    paired = [r for r in records if r.get("baseline_lm_time") is not None and r.get("utt") in ar_time]
    alone = sum(ar_time[r["utt"]] for r in paired)
    return sum(r["baseline_lm_time"] for r in paired) / alone if alone else 1.0


def expected_tokens_per_round(alpha: float, draft_len: int) -> float:
    """E(α, γ) = (1 - α^(γ+1)) / (1 - α): tokens per target pass with i.i.d. acceptance (docs/algorithms.md §1.4)."""
    return draft_len + 1.0 if alpha >= 1 else (1 - alpha ** (draft_len + 1)) / (1 - alpha)


def add_cost_columns(table: pd.DataFrame, sweep_dir: str | Path) -> pd.DataFrame:
    """Per-call costs measured in each run, in AR target calls, and the speedup they predict from the measured
    α: c = the drafter's time per drafted token, d = its time per round (all of a round's drafting: k calls of an
    autoregressive drafter, one of a block drafter), v = a verify call; predicted = E(α, L_d) / (d + v).
    An AR call's time is the AR run's, scaled by how much slower or faster the AR decodes timed beside the run
    were on the same utterances: the costs are then in the run's own process's AR calls, as its paired speedup."""
    sweep_dir = Path(sweep_dir)
    table = table.copy()
    for column in ("c_draft", "draft_per_round", "verify_cost", "predicted_speedup"):
        table[column] = np.nan
    ar_records: dict[str, list[dict]] = {}  # per AR run, read once
    for idx, row in table[verified_rows(table)].iterrows():
        ar = _ar_runs(table, row)
        if ar.empty or pd.isna(row.get("draft_len")):
            continue
        ar_run = ar["run"].iloc[0]
        if ar_run not in ar_records:
            ar_records[ar_run] = _timed_records(sweep_dir / ar_run)
        records = _timed_records(sweep_dir / row["run"])
        ar_sums, sums = _run_sums(ar_records[ar_run]), _run_sums(records)
        if not (
            sums["draft_calls"] and sums["rounds"] and ar_sums["time_verify"] and ar_sums["target_calls"]
        ):
            continue
        t_ar = (
            ar_sums["time_verify"] / ar_sums["target_calls"] * _ar_speed_beside(records, ar_records[ar_run])
        )
        c = sums["time_draft"] / sums["draft_calls"] / t_ar
        d = sums["time_draft"] / sums["rounds"] / t_ar
        v = sums["time_verify"] / sums["target_calls"] / t_ar
        table.loc[idx, ["c_draft", "draft_per_round", "verify_cost"]] = c, d, v
        table.loc[idx, "predicted_speedup"] = expected_tokens_per_round(
            row["acceptance_rate"], int(row["draft_len"])
        ) / (d + v)
    return table


def _sort(table: pd.DataFrame) -> pd.DataFrame:
    """Reference runs first, then runs without a rule (draft alone, the stress test), then the rest by setting."""
    order = (~reference_rows(table)).astype(int) + verified_rows(table).astype(int)
    by = ["_order", *setting_keys(table), "run"]
    return (
        table.assign(_order=order)
        .sort_values(by, na_position="first")
        .drop(columns="_order")
        .reset_index(drop=True)
    )


def build_table(sweep_dir: str | Path, baseline_dir: str | Path | None = None) -> pd.DataFrame:
    """The full numeric table of a sweep dir (sorted, with paired ΔWER vs AR and per-call costs); writes
    nothing. Each run's speedup is its own, timed beside its baseline in its process (metrics.json)."""
    sweep_dir = Path(sweep_dir)
    if baseline_dir is not None and not (Path(baseline_dir) / METRICS_FILE).is_file():
        raise FileNotFoundError(f"baseline run dir {baseline_dir} has no {METRICS_FILE}")
    table = add_paired_wer(load_runs(sweep_dir), sweep_dir, baseline_dir)
    return add_cost_columns(_sort(table), sweep_dir)


# --------------------------------------------------------------------------------------------------
# Formatting
# --------------------------------------------------------------------------------------------------


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _fmt(value, digits: int = 3) -> str:
    if _missing(value):
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _fmt_setting(value: Any) -> str:
    if _missing(value):
        return "-"
    return f"{value:g}" if isinstance(value, float) else str(value)


def with_ci(row: pd.Series, key: str, digits: int = 3, scale: float = 1.0) -> str:
    """'value [lo, hi]' of metric `key` (its CI from the `<key>_ci_lo/hi` columns, left out when unknown)."""
    value = row.get(key)
    if _missing(value):
        return "-"
    lo, hi = row.get(f"{key}_ci_lo"), row.get(f"{key}_ci_hi")
    text = f"{value * scale:.{digits}f}"
    if not (_missing(lo) or _missing(hi)):
        text += f" [{lo * scale:.{digits}f}, {hi * scale:.{digits}f}]"
    return text


def _throughput(row: pd.Series) -> str:
    """Utterances/s of the decode as run, with its batch size: '12.3 (B=8)'."""
    value = row.get("throughput_utts_per_sec")
    if _missing(value):
        return "-"
    batch = row.get("batch_size")
    return f"{value:.2f}" + ("" if _missing(batch) else f" (B={int(batch)})")


def _stalls(row: pd.Series, count: str, total: str) -> str:
    """'late chunks / seconds of stall': '0 / 0.00'."""
    if _missing(row.get(count)):
        return "-"
    return f"{int(row[count])} / {row[total]:.2f}"


def setting_of(row: pd.Series) -> dict[str, Any]:
    """The decoding setting of one table row, {key: plain value} (keys it does not have are left out)."""
    text = row.get("setting_keys")
    keys = text.split(",") if isinstance(text, str) else []
    out = {}
    for key in keys:
        value = row.get(key)
        value = value.item() if hasattr(value, "item") else value
        if not _missing(value):
            out[key] = int(value) if isinstance(value, float) and value.is_integer() else value
    return out


def describe_setting(row: pd.Series) -> str:
    """'decoding=speculative, acceptance=tolerance, beta=0.4, ...'."""
    return ", ".join(f"{k}={_fmt_setting(v)}" for k, v in setting_of(row).items())


def _label(values: dict[str, Any]) -> str:
    """A figure's curve label: 'tolerance β=0.2', 'pcg theta=0.4 L_d=3', 'exact adaptive'."""
    parts = []
    for key, value in values.items():
        if _missing(value) or (isinstance(value, (bool, np.bool_)) and not value):
            continue
        if key == "acceptance":
            parts.append(str(value))
        elif isinstance(value, (bool, np.bool_)):
            parts.append(key)
        else:
            parts.append(f"{SYMBOLS.get(key, key)}={_fmt_setting(value)}")
    return " ".join(parts) or "speculative"


def display_table(table: pd.DataFrame) -> pd.DataFrame:
    """The human-readable table: setting columns, LM-RTF, speedup, WER (%), SIM, NMOS (runs with a MOS
    judge), acceptance with 95% CIs, and the measured per-call costs where `add_cost_columns` found them."""
    ok = table[table["status"] == "ok"]
    keys = setting_keys(table) or ["decoding"]
    if ok.empty:
        names = [COLUMN_NAMES.get(k, k) for k in keys]
        return pd.DataFrame(columns=["run", *names, "n", "LM-RTF [95% CI]", "WER % [95% CI]"])
    out = pd.DataFrame({"run": ok["run"]})
    for key in keys:
        out[COLUMN_NAMES.get(key, key)] = ok[key].map(_fmt_setting)
    out = out.assign(**{
        "n": ok["num_utterances"].astype(int),
        "LM-RTF [95% CI]": [with_ci(r, "lm_rtf") for _, r in ok.iterrows()],
        "speedup [95% CI]": [with_ci(r, "speedup", 2) for _, r in ok.iterrows()],
        "timed n": ok.get("speedup_utterances", ok.get("timed_utterances", pd.Series(np.nan, index=ok.index)))
        .map(lambda v: _fmt(v, 0)),
        # Runs written before these columns existed show "-".
        "E2E-RTF": ok.get("e2e_rtf", pd.Series(np.nan, index=ok.index)).map(_fmt),
        "vocoder % of E2E": ok.get("vocoder_share", pd.Series(np.nan, index=ok.index)).map(lambda v: _fmt(v * 100, 0)),
        "utt/s (batch)": [_throughput(r) for _, r in ok.iterrows()],
        "WER % [95% CI]": [with_ci(r, "wer", 1, 100) for _, r in ok.iterrows()],
        "ΔWER vs AR pts [95% CI]": [with_ci(r, "wer_delta_vs_ar", 1) for _, r in ok.iterrows()],
        "WER/utt %": ok["wer_per_utt"].map(lambda v: _fmt(v * 100, 1)),
        "SIM [95% CI]": [with_ci(r, "sim") for _, r in ok.iterrows()],
        "accept": ok["acceptance_rate"].map(_fmt),
        "acc. len": ok["mean_accepted_length"].map(lambda v: _fmt(v, 2)),
        "target calls/token": ok["target_calls_per_token"].map(_fmt),
    })  # fmt: skip
    if "nmos" in ok and ok["nmos"].notna().any():  # the MOS judge's primary estimate (DNSMOS: OVRL)
        out.insert(
            out.columns.get_loc("SIM [95% CI]") + 1,
            "NMOS [95% CI]",
            [with_ci(r, "nmos", 2) for _, r in ok.iterrows()],
        )
        if "nmos_delta_vs_ar" in ok and ok["nmos_delta_vs_ar"].notna().any():
            out.insert(out.columns.get_loc("NMOS [95% CI]") + 1, "ΔNMOS vs AR [95% CI]",
                       [with_ci(r, "nmos_delta_vs_ar", 2) for _, r in ok.iterrows()])  # fmt: skip
    tv_columns = [c for c in ok.columns if c.startswith("tv_") and c[3:].isdigit()]
    if tv_columns:  # per-step TV(output law, target law), mean over draft positions: 0 for exact rules
        out["TV drift"] = ok[tv_columns].mean(axis=1).map(lambda v: _fmt(v, 4))
    if "group_mean_size" in ok and ok["group_mean_size"].notna().any():  # PCG's groups (rule or stress test)
        out["group mean / median"] = [
            "-"
            if _missing(r.get("group_mean_size"))
            else f"{r['group_mean_size']:.2f} / {r['group_median_size']:.0f}"
            for _, r in ok.iterrows()
        ]
        out["singletons %"] = ok["group_singleton_fraction"].map(lambda v: _fmt(v * 100, 1))
        out["θ (resolved)"] = ok["group_theta"].map(lambda v: _fmt(v, 3))
    if "swap_fraction" in ok:  # the stress test: tokens swapped before vocoding, paired vs the AR run
        out["swapped %"] = ok["swap_fraction"].map(lambda v: _fmt(v * 100, 1))
        out["ΔSIM vs AR [95% CI]"] = [with_ci(r, "sim_delta_vs_ar") for _, r in ok.iterrows()]
    if "first_packet_median" in ok and ok["first_packet_median"].notna().any():  # eval.streaming=true
        out["first packet ms [95% CI]"] = [
            with_ci(r, "first_packet_median", 0, 1000) for _, r in ok.iterrows()
        ]
        out["Δ first packet vs AR ms [95% CI]"] = [
            with_ci(r, "first_packet_delta_vs_ar", 0, 1000) for _, r in ok.iterrows()
        ]
        out["stalls n / s"] = [_stalls(r, "stall_count", "stall_total") for _, r in ok.iterrows()]
        out["AR beside: stalls n / s"] = [
            _stalls(r, "baseline_stall_count", "baseline_stall_total") for _, r in ok.iterrows()
        ]
        out["stream RTF"] = ok["stream_rtf"].map(_fmt)
    if "wer_wrong_sentence" in ok:
        out["WER vs wrong text %"] = ok["wer_wrong_sentence"].map(lambda v: _fmt(v * 100, 1))
    if "predicted_speedup" in ok and ok["predicted_speedup"].notna().any():
        out["c (draft/AR call)"] = ok["c_draft"].map(_fmt)
        out["drafting/round (AR calls)"] = ok["draft_per_round"].map(_fmt)
        out["verify/AR call"] = ok["verify_cost"].map(lambda v: _fmt(v, 2))
        out["predicted speedup"] = ok["predicted_speedup"].map(lambda v: _fmt(v, 2))
    return out.reset_index(drop=True)


def to_markdown(frame: pd.DataFrame) -> str:
    # Written out because pandas' to_markdown needs `tabulate`, which the project does not depend on.
    header = "| " + " | ".join(frame.columns) + " |"
    rule = "|" + "|".join("---" for _ in frame.columns) + "|"
    lines = ["| " + " | ".join(str(v) for v in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join([header, rule, *lines]) + "\n"


NOT_SHOWN = {"failed": "Failed jobs (see error.json in each)", "running": "Running jobs (not in the table yet)",
             "incomplete": "Incomplete jobs (not in the table)"}  # fmt: skip


def table_notes(table: pd.DataFrame) -> list[str]:
    """What the table does not show, one line each: failed, running and incomplete jobs (with why), runs whose
    last attempt failed, and runs timed on an oversubscribed CPU (their speed columns are unreliable)."""
    lines = []
    for status, title in NOT_SHOWN.items():
        rows = table[table["status"] == status]
        if not rows.empty:
            lines += [f"{title}:", *(f"- {r['run']}: {r['note']}" for _, r in rows.iterrows())]
    ok = table[table["status"] == "ok"]
    later = ok[ok["note"].notna()] if "note" in ok else ok.iloc[:0]
    if not later.empty:
        lines += [
            "Shown from an earlier attempt:",
            *(f"- {r['run']}: {r['note']}" for _, r in later.iterrows()),
        ]
    if "oversubscribed" in ok and ok["oversubscribed"].fillna(False).astype(bool).any():
        busy = ok[ok["oversubscribed"].fillna(False).astype(bool)]
        lines += ["Timed with more threads than cores (speed columns unreliable):",
                  *(f"- {r['run']}: {r.get('cpu_note', '')}" for _, r in busy.iterrows())]  # fmt: skip
    return lines


def write_table(table: pd.DataFrame, out_dir: str | Path, stem: str = "table") -> pd.DataFrame:
    """<stem>.csv (every column, every run with its status), <stem>.md and <stem>.tex (the readable table,
    `table_notes` under it); returns the readable table. All three are rendered before any is written, each
    written atomically."""
    out_dir = Path(out_dir)
    shown = display_table(table)
    notes = table_notes(table)
    texts = {
        "csv": table.to_csv(index=False),
        "md": to_markdown(shown)
        + "".join(f"{line}\n" if line.startswith("- ") else f"\n{line}\n" for line in notes),
        "tex": shown.to_latex(index=False, escape=True) + "".join(f"% {line}\n" for line in notes),
    }
    for suffix, text in texts.items():
        write_atomic(out_dir / f"{stem}.{suffix}", text)
    return shown


def paper_table(rows: list[dict] | None) -> str:
    """The paper's numbers (an experiment config's `reproduce.paper`), as they are."""
    if not rows:
        return "(the paper reports no numbers for this experiment)\n"
    names = {"setting": "setting", "lm_rtf": "LM-RTF", "speedup": "speedup", "wer_pct": "WER %", "sim": "SIM",
             "nmos": "NMOS"}  # fmt: skip
    columns = [c for c in names if any(c in r for r in rows)]
    columns += [c for r in rows for c in r if c not in columns]
    frame = pd.DataFrame([{names.get(c, c): r.get(c, "-") for c in columns} for r in rows])
    return to_markdown(frame)
