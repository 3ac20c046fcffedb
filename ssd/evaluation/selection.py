"""Choosing a setting on a held-out split, and pairing settings across rules.

Choosing beta / L_d on a held-out split (`select_setting`, `scripts/make_tables.py --select-on`): on the DEV
sweep, keep the speculative settings whose WER bootstrap CI overlaps the AR baseline's WER CI (no detectable WER
loss), take the fastest, and report the SAME setting from the TEST sweep. Choosing on the test split itself
would overstate the speedup that holds at equal quality. "Fastest" is the highest speedup timed in pairs
inside each job; LM-RTFs of separate processes can differ by a third for the same tokens, so the lowest LM-RTF
decides only where a run has no paired speedup.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ssd.evaluation.tables import (
    _missing,
    describe_setting,
    reference_rows,
    setting_keys,
    setting_of,
    verified_rows,
    with_ci,
)


def select_setting(dev: pd.DataFrame) -> pd.Series:
    """On a DEV table: the fastest speculative setting (highest paired speedup; lowest LM-RTF where a run has
    none) whose WER CI overlaps the AR run's WER CI."""
    ar = dev[reference_rows(dev)]
    if ar.empty:
        raise ValueError("select_setting: the dev sweep has no decoding=ar run to compare WER against")
    ar_lo, ar_hi = float(ar["wer_ci_lo"].min()), float(ar["wer_ci_hi"].max())
    spec = dev[verified_rows(dev)]
    eligible = spec[(spec["wer_ci_lo"] <= ar_hi) & (spec["wer_ci_hi"] >= ar_lo)]
    if eligible.empty:
        raise ValueError(
            f"select_setting: no speculative setting has a WER CI overlapping the AR baseline's "
            f"[{ar_lo:.3f}, {ar_hi:.3f}]; all lose measurable quality"
        )
    if "speedup" in eligible and eligible["speedup"].notna().all():
        return eligible.sort_values("speedup", ascending=False).iloc[0]
    return eligible.sort_values("lm_rtf").iloc[0]


def matching_row(table: pd.DataFrame, setting: pd.Series) -> pd.Series:
    """The row of `table` with the same decoding setting as `setting` (every setting key of either: a key
    the row lacks must be missing in `table` too)."""
    ok = table[table["status"] == "ok"]
    keys = list(dict.fromkeys([*setting_keys(table), *setting_of(setting)]))
    mask = pd.Series(True, index=ok.index)
    for key in keys:
        value = setting.get(key)
        column = ok[key] if key in ok else pd.Series(np.nan, index=ok.index)
        mask &= column.isna() if _missing(value) else column == value
    if not mask.any():
        raise ValueError(f"the test sweep has no run with the setting chosen on dev: {setting_of(setting)}")
    return ok[mask].iloc[0]


def select_on_dev(dev: pd.DataFrame, test: pd.DataFrame) -> tuple[str, pd.DataFrame | None]:
    """The reviewer's protocol: choose on dev (select_setting), report the same setting on test.
    Returns the text and the test rows to show (AR and the chosen setting), or None."""
    try:
        chosen = select_setting(dev)
    except ValueError as err:
        return f"No setting chosen on dev: {err}.\n", None
    text = (
        f"Chosen on the dev split (fastest speculative setting whose WER CI overlaps AR's): "
        f"**{describe_setting(chosen)}** (dev speedup {with_ci(chosen, 'speedup')}, dev LM-RTF "
        f"{with_ci(chosen, 'lm_rtf')}, dev WER % {with_ci(chosen, 'wer', 1, 100)}).\n"
    )
    try:
        row = matching_row(test, chosen)
    except ValueError as err:
        return text + f"{err}\n", None
    ar = test[reference_rows(test)]
    return text + "The same setting on the test split:\n\n", test.loc[[*ar.index, row.name]]


def matched_speed(
    table: pd.DataFrame, reference: dict, candidates: dict, by: str = "speedup"
) -> tuple[str, pd.DataFrame | None]:
    """The `reference` row (e.g. {acceptance: tolerance, beta: 0.4}) and the `candidates` row (e.g.
    {acceptance: pcg}) with the closest `by` (speedup, or e.g. acceptance_rate), shown with AR and the exact
    rules' rows."""
    ok = table[verified_rows(table)]

    def rows_like(setting: dict) -> pd.DataFrame:
        mask = pd.Series(True, index=ok.index)
        for key, value in setting.items():
            mask &= (ok[key] == value) if key in ok else False
        return ok[mask]

    ref_rows, cand_rows = rows_like(reference), rows_like(candidates).dropna(subset=[by])
    if ref_rows.empty or cand_rows.empty or pd.isna(ref_rows[by].iloc[0]):
        return f"Matched {by}: the reference or candidate runs (or the AR baseline) are missing.\n", None
    ref = ref_rows.iloc[0]
    best = cand_rows.loc[(cand_rows[by] - ref[by]).abs().idxmin()]
    ar = table[reference_rows(table)]
    beta = ok["beta"] if "beta" in ok else pd.Series(np.nan, index=ok.index)
    exact = ok[(ok["acceptance"] == "exact") | ((ok["acceptance"] == "tolerance") & (beta == 0))]
    text = (
        f"Matched {by}: {describe_setting(ref)} has {by} {ref[by]:.3f} (speedup {ref['speedup']:.2f}x); the "
        f"closest candidate is {describe_setting(best)} at {best[by]:.3f} (speedup {best['speedup']:.2f}x).\n\n"
    )
    return text, table.loc[[*ar.index, *exact.index, ref.name, best.name]]
