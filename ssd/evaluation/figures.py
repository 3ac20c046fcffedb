"""The figures of a sweep's table (`ssd.evaluation.report.aggregate`): speedup and acceptance vs L_d, WER and
SIM vs each numeric rule parameter that varies, α per draft position."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from ssd.evaluation.sweep_runs import setting_keys
from ssd.evaluation.tables import DECODING_KEYS, SYMBOLS, _label, reference_rows, verified_rows


def _curves(frame: pd.DataFrame, keys: list[str]):
    """(label, rows) per distinct setting of `keys` in `frame`, in order of first appearance."""
    labels = frame.apply(lambda row: _label({k: row.get(k) for k in keys}), axis=1)
    return [(label, frame[labels == label]) for label in dict.fromkeys(labels)]


def _varying_rule_parameters(spec: pd.DataFrame, keys: list[str]) -> list[str]:
    """The numeric rule parameters (setting keys that are not DECODING_KEYS) taking several values."""
    return [k for k in keys if k not in DECODING_KEYS and pd.api.types.is_numeric_dtype(spec[k])
            and not pd.api.types.is_bool_dtype(spec[k]) and spec[k].dropna().nunique() > 1]  # fmt: skip


def write_figures(table: pd.DataFrame, out_dir: Path) -> list[Path]:
    """Speedup and acceptance vs L_d (a curve per rule setting), WER and SIM vs each numeric rule parameter
    that varies (`fig_wer_sim_vs_<parameter>.png`, a curve per remaining setting), α per draft position."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    spec, ar = table[verified_rows(table)], table[reference_rows(table)]
    keys = setting_keys(table)
    written = []
    if spec.empty:
        return written
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for label, group in _curves(spec, [k for k in keys if k not in ("decoding", "draft_len")]):
        group = group.sort_values("draft_len")
        if "speedup_ci_lo" in group:
            err = [group["speedup"] - group["speedup_ci_lo"], group["speedup_ci_hi"] - group["speedup"]]
            axes[0].errorbar(
                group["draft_len"], group["speedup"], yerr=err, marker="o", capsize=3, label=label
            )
        axes[1].plot(group["draft_len"], group["acceptance_rate"], marker="o", label=label)
    axes[0].axhline(1.0, color="k", ls="--", lw=1, label="AR")
    axes[0].set(
        xlabel="draft length L_d", ylabel="speedup vs AR (timed in pairs, 95% CI)", title="speedup vs L_d"
    )
    axes[1].set(xlabel="draft length L_d", ylabel="acceptance rate", title="acceptance vs L_d")
    for ax in axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend()
        ax.grid(alpha=0.3)
    written.append(_save(fig, out_dir / "fig_speedup_acceptance_vs_draft_len.png"))

    for param in _varying_rule_parameters(spec, keys):
        symbol = SYMBOLS.get(param, param)
        rows = spec.dropna(subset=[param])
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for label, group in _curves(rows, [k for k in keys if k not in ("decoding", param)]):
            group = group.sort_values(param)
            for ax, key, scale in ((axes[0], "wer", 100), (axes[1], "sim", 1)):
                err = [
                    (group[key] - group[f"{key}_ci_lo"]) * scale,
                    (group[f"{key}_ci_hi"] - group[key]) * scale,
                ]
                ax.errorbar(group[param], group[key] * scale, yerr=err, marker="o", capsize=3, label=label)
        for _, row in ar.iterrows():
            axes[0].axhspan(
                row["wer_ci_lo"] * 100, row["wer_ci_hi"] * 100, color="k", alpha=0.1, label="AR 95% CI"
            )
            axes[1].axhspan(row["sim_ci_lo"], row["sim_ci_hi"], color="k", alpha=0.1, label="AR 95% CI")
        axes[0].set(xlabel=symbol, ylabel="WER %", title=f"WER vs {symbol}")
        axes[1].set(xlabel=symbol, ylabel="SIM to prompt", title=f"SIM vs {symbol}")
        for ax in axes:
            ax.legend()
            ax.grid(alpha=0.3)
        written.append(_save(fig, out_dir / f"fig_wer_sim_vs_{param}.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    for _, row in spec.iterrows():
        alphas = [
            row[c] for c in sorted(c for c in row.index if c.startswith("alpha_")) if not pd.isna(row[c])
        ]
        ax.plot(range(1, len(alphas) + 1), alphas, marker="o", label=row["run"])
    ax.set(
        xlabel="draft position i", ylabel="α_i = P(keep token i | tokens before kept)", title="α per position"
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    written.append(_save(fig, out_dir / "fig_alpha_per_position.png"))
    return written


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    from ssd.files import save_figure

    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return path
