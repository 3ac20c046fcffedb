"""The β audit (`reproduce.study: beta_audit`): are the draft tokens that SSD's tolerance β lets through
acoustically interchangeable with what the target preferred?

Every tolerance run with β > 0 and `acceptance.audit_groups` (a PCGRule) records, per kept draft token, the
engine's diagnostic (`ToleranceRule.audit`, fields `ToleranceRule.audit_fields`). This study reads those records from the
test sweep and tabulates, per β: the share of kept draft tokens kept ONLY because of β (u >= min(1, q/p)),
the distribution of q(x) and of q(x)/max q for them, how often they are the target's argmax, lie in the
PCG group of the argmax, and the chance that a draw from q at that step shares their group. The tokens the
exact ratio kept (u < min(1, q/p)) are the reference: they are draws the target law stands behind.
Files: beta_audit.{csv,md}, fig_beta_audit_q_over_max.png.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from ssd.decoding.acceptance import ToleranceRule
from ssd.evaluation.run_dir import RESULTS_FILE, read_records
from ssd.evaluation.sweep_runs import load_runs
from ssd.evaluation.tables import to_markdown
from ssd.experiments import StudyResult
from ssd.files import save_figure, write_atomic

if TYPE_CHECKING:
    from ssd.experiments.driver import Experiment

FIGURE = "fig_beta_audit_q_over_max.png"


def audit_tokens(records: list[dict]) -> pd.DataFrame:
    """One row per kept draft token of a run (columns ToleranceRule.audit_fields); empty without audit records."""
    columns = {name: [] for name in ToleranceRule.audit_fields}
    for record in records:
        audit = record.get("beta_audit") or {}
        for name in ToleranceRule.audit_fields:
            columns[name].extend(audit.get(name, []))
    return pd.DataFrame(columns)


def summarize_audit(tokens: pd.DataFrame) -> list[dict]:
    """Two rows (β-only tokens, ratio-kept tokens) of the audit table for one run's tokens."""
    rows = []
    beta_only = tokens["beta_only"] > 0.5
    for label, part in (
        ("kept only because of β", tokens[beta_only]),
        ("kept by the exact ratio", tokens[~beta_only]),
    ):
        if part.empty:
            rows.append({"tokens": label, "n": 0})
            continue
        q, ratio = part["q"].to_numpy(), part["q_over_max"].to_numpy()
        rows.append({
            "tokens": label,
            "n": len(part),
            "% of kept draft tokens": 100 * len(part) / len(tokens),
            "q(x) median [10%, 90%]": f"{np.median(q):.3f} [{np.quantile(q, 0.1):.3f}, {np.quantile(q, 0.9):.3f}]",
            "q(x)/max q median [10%, 90%]": (
                f"{np.median(ratio):.3f} [{np.quantile(ratio, 0.1):.3f}, {np.quantile(ratio, 0.9):.3f}]"
            ),
            "% with q(x)/max q < 0.1": 100 * float((ratio < 0.1).mean()),
            "% = argmax q": 100 * float(part["is_argmax"].mean()),
            "% in argmax's PCG group": 100 * float(part["in_argmax_group"].mean()),
            "% P(y ~ q shares x's group)": 100 * float(part["group_q_mass"].mean()),
        })  # fmt: skip
    return rows


def _figure(per_run: dict[str, pd.DataFrame], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    bins = np.linspace(0, 1, 21)
    for label, tokens in per_run.items():
        part = tokens[tokens["beta_only"] > 0.5]["q_over_max"]
        if len(part):
            ax.hist(part, bins=bins, histtype="step", density=True, label=f"{label}: kept only by β")
    reference = pd.concat(list(per_run.values()))
    ax.hist(reference[reference["beta_only"] < 0.5]["q_over_max"], bins=bins, histtype="stepfilled", alpha=0.25,
            density=True, color="gray", label="kept by the exact ratio (all β)")  # fmt: skip
    ax.set_xlabel("q(x) / max q at that step")
    ax.set_ylabel("density")
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def run_beta_audit_study(experiment: Experiment) -> StudyResult:
    """The audit table of the test sweep's tolerance runs with β > 0 (after the experiment's sweeps)."""
    sweep = experiment.runs / "test"
    runs = load_runs(sweep)
    runs = runs[
        (runs["status"] == "ok") & (runs.get("acceptance") == "tolerance") & (runs.get("beta", 0) > 0)
    ]
    rows, per_run = [], {}
    group_note = ""
    for _, run in runs.sort_values("beta").iterrows():
        tokens = audit_tokens(read_records(sweep / run["run"] / RESULTS_FILE, repair=False))
        if tokens.empty:
            continue
        label = f"β = {run['beta']:g}"
        per_run[label] = tokens
        rows += [{"β": run["beta"], **row} for row in summarize_audit(tokens)]
    if not rows:
        return StudyResult(
            sections=["## β audit\n\nNo run holds β-audit records (set acceptance.audit_groups).\n"]
        )
    groups = experiment.cfg.acceptance.get("audit_groups") or {}
    if groups:
        group_note = (
            f" PCG groups: source `{groups.get('source', 'embedding')}`, mean group size "
            f"{groups.get('group_size')} (theta resolved on this target)."
        )
    table = pd.DataFrame(rows)
    write_atomic(experiment.out_dir / "beta_audit.csv", table.to_csv(index=False))
    shown = table.map(lambda v: f"{v:.1f}" if isinstance(v, float) and not np.isnan(v) else v)
    write_atomic(experiment.out_dir / "beta_audit.md", to_markdown(shown) + "\n")
    _figure(per_run, experiment.out_dir / FIGURE)
    section = (
        "## β audit: are the tokens β admits interchangeable with the target's?\n\n"
        "Per kept draft token of the test runs (engine diagnostic, `ToleranceRule.audit`): kept only because "
        "of β means u >= min(1, q/p)(x), i.e. exact speculative sampling would have rejected it at that draw. "
        "'In argmax's PCG group': x shares a group with the target's most likely token; '% P(y ~ q shares "
        f"x's group)': the chance that a token drawn from q at that step lies in x's group.{group_note}\n\n"
        + to_markdown(shown)
        + "\n"
    )
    return StudyResult(sections=[section], figures=["beta_audit.md", "beta_audit.csv", FIGURE])
