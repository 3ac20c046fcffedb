"""One table (markdown, LaTeX, CSV) and a few figures over all runs of a sweep dir.

`aggregate(sweep_dir)` reads every `metrics.json` below `sweep_dir` (and lists jobs that left an
`error.json`), computes the speedup of each run against the `decoding=ar` run of the same sweep
(same target and eval: add it to the sweep dir with `python sweep.py -m decoding=ar
hydra.sweep.dir=<sweep dir>`, which also re-aggregates), or against a `baseline` run dir, and writes
`table.{md,tex,csv}` and `fig_*.png` into the sweep dir.

Choosing beta / L_d on a held-out split (`select_setting`, `scripts/make_tables.py --select-on`):
on the DEV sweep, keep the speculative settings whose WER bootstrap CI overlaps the AR baseline's WER CI
(no detectable WER loss), take the one with the lowest LM-RTF, and report the SAME setting from the TEST
sweep. Choosing on the test split itself would overstate the speedup that holds at equal quality.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd

from ssd.evaluation.runner import ERROR_FILE, METRICS_FILE

SETTING_KEYS = ("decoding", "acceptance", "beta", "theta", "draft_len", "adaptive")
TABLE_FILES = ("table.md", "table.tex", "table.csv")


def load_runs(sweep_dir: str | Path) -> pd.DataFrame:
    """One row per run dir below `sweep_dir`: its setting labels and metrics; failed jobs have `status=failed`."""
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise FileNotFoundError(f"sweep dir {sweep_dir} does not exist")
    rows = []
    for path in sorted(sweep_dir.rglob(METRICS_FILE)):
        metrics = json.loads(path.read_text())
        row = {"run": str(path.parent.relative_to(sweep_dir)) or ".", "status": "ok"}
        for key, value in metrics.items():
            if isinstance(value, list) and len(value) == 2 and key.endswith("_ci"):
                row[f"{key}_lo"], row[f"{key}_hi"] = value
            elif not isinstance(value, (list, dict)):
                row[key] = value
        for i, (alpha, beta_t) in enumerate(zip(metrics.get("alpha_per_position", []),
                                                 metrics.get("beta_per_position", []))):  # fmt: skip
            row[f"alpha_{i + 1}"], row[f"beta_t_{i + 1}"] = alpha, beta_t
        for i, tv in enumerate(metrics.get("tv_per_position", [])):
            row[f"tv_{i + 1}"] = tv
        for slot, acc in (metrics.get("slot_accuracy") or {}).items():
            row[f"slot_{slot}"] = acc
        rows.append(row)
    for path in sorted(sweep_dir.rglob(ERROR_FILE)):
        if not (path.parent / METRICS_FILE).is_file():
            error = json.loads(path.read_text()).get("error", "")
            rows.append({"run": str(path.parent.relative_to(sweep_dir)), "status": "failed", "error": error})
    if not rows:
        raise FileNotFoundError(
            f"no {METRICS_FILE} (or {ERROR_FILE}) below {sweep_dir}: nothing to aggregate"
        )
    table = pd.DataFrame(rows)
    for key in SETTING_KEYS:
        if key not in table:
            table[key] = np.nan
    return table


def add_speedup(table: pd.DataFrame, baseline_rtf: float | None = None) -> pd.DataFrame:
    """speedup = LM-RTF of the AR run (same target and eval) / LM-RTF of the row; `baseline_rtf` overrides."""
    table = table.copy()
    speedups = []
    for _, row in table.iterrows():
        base = baseline_rtf
        if base is None and row.get("status") == "ok":
            same = (table["decoding"] == "ar") & (table["status"] == "ok")
            for key in ("target", "eval"):
                if key in table:
                    same &= table[key] == row.get(key)
            if same.any():
                base = float(table.loc[same, "lm_rtf"].mean())
        if base is None and not math.isnan(float(row.get("speedup", np.nan) or np.nan)):
            speedups.append(float(row["speedup"]))  # from the run's own baseline_dir
            continue
        rtf = row.get("lm_rtf")
        speedups.append(base / rtf if base is not None and rtf and not math.isnan(rtf) else np.nan)
    table["speedup"] = speedups
    return table


def _sort(table: pd.DataFrame) -> pd.DataFrame:
    order = {"ar": 0, "draft_only": 1, "speculative": 2}
    key = table["decoding"].map(order).fillna(3)
    return (
        table.assign(_order=key)
        .sort_values(["_order", "acceptance", "beta", "theta", "draft_len", "run"], na_position="first")
        .drop(columns="_order")
        .reset_index(drop=True)
    )


def _fmt(value, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _with_ci(row: pd.Series, key: str, digits: int = 3, scale: float = 1.0) -> str:
    value = row.get(key)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    lo, hi = row.get(f"{key}_ci_lo"), row.get(f"{key}_ci_hi")
    text = f"{value * scale:.{digits}f}"
    if lo is not None and hi is not None and not (math.isnan(lo) or math.isnan(hi)):
        text += f" [{lo * scale:.{digits}f}, {hi * scale:.{digits}f}]"
    return text


def display_table(table: pd.DataFrame) -> pd.DataFrame:
    """The human-readable table: setting, LM-RTF, speedup, WER (%), SIM, acceptance, with 95% CIs."""
    ok = table[table["status"] == "ok"]
    if ok.empty:
        return pd.DataFrame(
            columns=["run", "decoding", "rule", "beta", "L_d", "n", "LM-RTF [95% CI]", "WER % [95% CI]"]
        )
    out = pd.DataFrame(
        {
            "run": ok["run"],
            "decoding": ok["decoding"],
            "rule": ok["acceptance"].map(_fmt),
            "beta": ok["beta"].map(lambda v: _fmt(v, 2)),
            "L_d": ok["draft_len"].map(lambda v: _fmt(int(v)) if not pd.isna(v) else "-"),
            "n": ok["num_utterances"].astype(int),
            "LM-RTF [95% CI]": [_with_ci(r, "lm_rtf") for _, r in ok.iterrows()],
            "speedup": ok["speedup"].map(lambda v: _fmt(v, 2)),
            "WER % [95% CI]": [_with_ci(r, "wer", 1, 100) for _, r in ok.iterrows()],
            "WER/utt %": ok["wer_per_utt"].map(lambda v: _fmt(v * 100, 1)),
            "SIM [95% CI]": [_with_ci(r, "sim") for _, r in ok.iterrows()],
            "accept": ok["acceptance_rate"].map(_fmt),
            "acc. len": ok["mean_accepted_length"].map(lambda v: _fmt(v, 2)),
            "target calls/token": ok["target_calls_per_token"].map(_fmt),
        }
    )
    tv_columns = [c for c in ok.columns if c.startswith("tv_") and c[3:].isdigit()]
    if tv_columns:  # per-step TV(output law, target law), mean over draft positions: 0 for exact rules
        out["TV drift"] = ok[tv_columns].mean(axis=1).map(lambda v: _fmt(v, 4)).to_numpy()
    if "wer_wrong_sentence" in ok:
        out["WER vs wrong text %"] = ok["wer_wrong_sentence"].map(lambda v: _fmt(v * 100, 1))
    return out.reset_index(drop=True)


def to_markdown(frame: pd.DataFrame) -> str:
    # Written out because pandas' to_markdown needs `tabulate`, which the project does not depend on.
    header = "| " + " | ".join(frame.columns) + " |"
    rule = "|" + "|".join("---" for _ in frame.columns) + "|"
    lines = ["| " + " | ".join(str(v) for v in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join([header, rule, *lines]) + "\n"


def _figures(table: pd.DataFrame, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    ok = table[table["status"] == "ok"]
    spec = ok[ok["decoding"] == "speculative"]
    ar = ok[ok["decoding"] == "ar"]
    written = []
    if not spec.empty:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for beta, group in spec.groupby(spec["beta"].fillna(-1)):
            group = group.sort_values("draft_len")
            label = f"β={beta:g}" if beta >= 0 else str(group["acceptance"].iloc[0])
            err = [group["lm_rtf"] - group["lm_rtf_ci_lo"], group["lm_rtf_ci_hi"] - group["lm_rtf"]]
            axes[0].errorbar(
                group["draft_len"], group["lm_rtf"], yerr=err, marker="o", capsize=3, label=label
            )
            axes[1].plot(group["draft_len"], group["acceptance_rate"], marker="o", label=label)
        for _, row in ar.iterrows():
            axes[0].axhline(row["lm_rtf"], color="k", ls="--", lw=1, label="AR")
        axes[0].set(xlabel="draft length L_d", ylabel="LM-RTF (lower is faster)", title="LM-RTF vs L_d")
        axes[1].set(xlabel="draft length L_d", ylabel="acceptance rate", title="acceptance vs L_d")
        for ax in axes:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.legend()
            ax.grid(alpha=0.3)
        written.append(_save(fig, out_dir / "fig_rtf_acceptance_vs_draft_len.png"))

        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for draft_len, group in spec.groupby("draft_len"):
            group = group.dropna(subset=["beta"]).sort_values("beta")
            if group.empty:
                continue
            for ax, key, scale in ((axes[0], "wer", 100), (axes[1], "sim", 1)):
                err = [
                    (group[key] - group[f"{key}_ci_lo"]) * scale,
                    (group[f"{key}_ci_hi"] - group[key]) * scale,
                ]
                ax.errorbar(
                    group["beta"],
                    group[key] * scale,
                    yerr=err,
                    marker="o",
                    capsize=3,
                    label=f"L_d={draft_len:g}",
                )
        for _, row in ar.iterrows():
            axes[0].axhspan(
                row["wer_ci_lo"] * 100, row["wer_ci_hi"] * 100, color="k", alpha=0.1, label="AR 95% CI"
            )
            axes[1].axhspan(row["sim_ci_lo"], row["sim_ci_hi"], color="k", alpha=0.1, label="AR 95% CI")
        axes[0].set(xlabel="β", ylabel="WER %", title="WER vs β")
        axes[1].set(xlabel="β", ylabel="SIM to prompt", title="SIM vs β")
        for ax in axes:
            ax.legend()
            ax.grid(alpha=0.3)
        written.append(_save(fig, out_dir / "fig_wer_sim_vs_beta.png"))

        fig, ax = plt.subplots(figsize=(6, 4))
        for _, row in spec.iterrows():
            alphas = [
                row[c] for c in sorted(c for c in row.index if c.startswith("alpha_")) if not pd.isna(row[c])
            ]
            ax.plot(range(1, len(alphas) + 1), alphas, marker="o", label=row["run"])
        ax.set(
            xlabel="draft position i",
            ylabel="α_i = P(keep token i | tokens before kept)",
            title="α per position",
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
        written.append(_save(fig, out_dir / "fig_alpha_per_position.png"))
    return written


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def aggregate(
    sweep_dir: str | Path, baseline_dir: str | Path | None = None, figures: bool = True
) -> pd.DataFrame:
    """Write table.{md,tex,csv} (+ figures) into `sweep_dir`; returns the full numeric table."""
    sweep_dir = Path(sweep_dir)
    baseline_rtf = None
    if baseline_dir is not None:
        path = Path(baseline_dir) / METRICS_FILE
        if not path.is_file():
            raise FileNotFoundError(f"baseline run dir {baseline_dir} has no {METRICS_FILE}")
        baseline_rtf = float(json.loads(path.read_text())["lm_rtf"])
    table = _sort(add_speedup(load_runs(sweep_dir), baseline_rtf))
    table.to_csv(sweep_dir / "table.csv", index=False)
    shown = display_table(table)
    failed = table[table["status"] == "failed"]
    markdown = to_markdown(shown)
    if not failed.empty:
        markdown += "\nFailed jobs (see error.json in each):\n" + "".join(
            f"- {r['run']}: {r['error']}\n" for _, r in failed.iterrows()
        )
    (sweep_dir / "table.md").write_text(markdown)
    (sweep_dir / "table.tex").write_text(shown.to_latex(index=False, escape=True))
    if figures:
        _figures(table, sweep_dir)
    return table


def select_setting(dev: pd.DataFrame) -> pd.Series:
    """On a DEV table: the fastest speculative setting whose WER CI overlaps the AR run's WER CI."""
    ok = dev[dev["status"] == "ok"]
    ar = ok[ok["decoding"] == "ar"]
    if ar.empty:
        raise ValueError("select_setting: the dev sweep has no decoding=ar run to compare WER against")
    ar_lo, ar_hi = float(ar["wer_ci_lo"].min()), float(ar["wer_ci_hi"].max())
    spec = ok[ok["decoding"] == "speculative"]
    eligible = spec[(spec["wer_ci_lo"] <= ar_hi) & (spec["wer_ci_hi"] >= ar_lo)]
    if eligible.empty:
        raise ValueError(
            f"select_setting: no speculative setting has a WER CI overlapping the AR baseline's "
            f"[{ar_lo:.3f}, {ar_hi:.3f}]; all lose measurable quality"
        )
    return eligible.sort_values("lm_rtf").iloc[0]


def matching_row(table: pd.DataFrame, setting: pd.Series) -> pd.Series:
    """The row of `table` with the same decoding setting (SETTING_KEYS) as `setting`."""
    ok = table[table["status"] == "ok"]
    mask = pd.Series(True, index=ok.index)
    for key in SETTING_KEYS:
        value = setting.get(key)
        mask &= ok[key].isna() if pd.isna(value) else ok[key] == value
    if not mask.any():
        described = {k: setting.get(k) for k in SETTING_KEYS}
        raise ValueError(f"the test sweep has no run with the setting chosen on dev: {described}")
    return ok[mask].iloc[0]
