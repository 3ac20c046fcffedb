"""The runs of a sweep dir and their state (`load_runs`): every evaluation run dir below it, finished (its
metrics as a row) or not (failed, running, incomplete: a row with a note, never left out), and the setting
keys that name them (`setting_keys`). `ssd.evaluation.tables` builds the tables from these rows."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from ssd.evaluation.run_dir import ERROR_FILE, METRICS_FILE, RESULTS_FILE, TEST_LIST_FILE, read_records
from ssd.files import KIND_FILE, dir_kind, lock_holder


def setting_keys(table: pd.DataFrame) -> list[str]:
    """The setting keys over all runs of `table`, each run's order kept: the runs' distinct key lists are
    merged in sorted order (the same order for any subset of the runs), a key not listed yet going just
    before the next of its run's keys already listed (so `theta` lands next to `beta`, before `draft_len`)."""
    keys: list[str] = []
    for text in sorted(table["setting_keys"].dropna().unique()):
        run_keys = [k for k in str(text).split(",") if k]
        for i, key in enumerate(run_keys):
            if key not in keys:
                keys.insert(next((keys.index(k) for k in run_keys[i + 1 :] if k in keys), len(keys)), key)
    return keys


def run_dirs(sweep_dir: Path) -> list[Path]:
    """The evaluation run dirs below `sweep_dir`: any dir holding a run's file, not marked as another kind
    (the sweep dir itself, its baselines/), hidden dirs (.hydra, .submitit) left out."""
    names = (METRICS_FILE, ERROR_FILE, RESULTS_FILE, TEST_LIST_FILE, KIND_FILE)
    out = []
    for d in sorted({p.parent for name in names for p in sweep_dir.rglob(name)}):
        hidden = any(part.startswith(".") for part in d.relative_to(sweep_dir).parts)
        if not hidden and dir_kind(d)[0] in ("evaluation run", None):
            out.append(d)
    return out


def _metrics_row(path: Path, sweep_dir: Path) -> dict:
    metrics = json.loads(path.read_text())
    row = {"run": str(path.parent.relative_to(sweep_dir)) or ".", "status": "ok"}
    for key, value in metrics.items():
        if isinstance(value, list) and len(value) == 2 and key.endswith("_ci"):
            row[f"{key}_lo"], row[f"{key}_hi"] = value
        elif not isinstance(value, (list, dict)):
            row[key] = value
    if "setting_keys" not in metrics or "reference" not in metrics:
        raise ValueError(f"{path} names no setting_keys/reference (an older ssd wrote it): rerun that job")
    row["setting_keys"] = ",".join(metrics["setting_keys"])
    for i, (alpha, beta_t) in enumerate(zip(metrics.get("alpha_per_position", []),
                                             metrics.get("beta_per_position", []))):  # fmt: skip
        row[f"alpha_{i + 1}"], row[f"beta_t_{i + 1}"] = alpha, beta_t
    for i, tv in enumerate(metrics.get("tv_per_position", [])):
        row[f"tv_{i + 1}"] = tv
    for slot, acc in (metrics.get("slot_accuracy") or {}).items():
        row[f"slot_{slot}"] = acc
    return row


def _progress(run_dir: Path) -> str:
    """'k of n utterances' of an unfinished run (n from its test list, when written)."""
    done = len(read_records(run_dir / RESULTS_FILE, repair=False))
    test_list = run_dir / TEST_LIST_FILE
    total = (
        sum(1 for line in test_list.read_text().splitlines() if line.strip()) if test_list.is_file() else "?"
    )
    return f"{done} of {total} utterances"


def load_runs(sweep_dir: str | Path) -> pd.DataFrame:
    """One row per evaluation run dir below `sweep_dir`: its setting labels and metrics (`status=ok`), or
    `status` failed / running / incomplete with a `note` (never left out). Column `setting_keys` holds each
    finished run's setting keys, comma-joined."""
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise FileNotFoundError(f"sweep dir {sweep_dir} does not exist")
    rows = []
    for run_dir in run_dirs(sweep_dir):
        name = str(run_dir.relative_to(sweep_dir)) or "."
        holder = lock_holder(run_dir)
        error = (
            json.loads((run_dir / ERROR_FILE).read_text()).get("error", "")
            if (run_dir / ERROR_FILE).is_file()
            else None
        )
        if holder is not None:
            rows.append(
                {"run": name, "status": "running", "note": f"running now ({holder}): {_progress(run_dir)}"}
            )
        elif (run_dir / METRICS_FILE).is_file():
            row = _metrics_row(run_dir / METRICS_FILE, sweep_dir)
            if error is not None:  # a success clears error.json: this came from a later attempt
                row["note"] = f"its metrics are from an earlier attempt; the last one failed: {error}"
            rows.append(row)
        elif error is not None:
            rows.append({"run": name, "status": "failed", "error": error, "note": error})
        else:
            rows.append({"run": name, "status": "incomplete",
                         "note": f"stopped before its metrics (killed?): {_progress(run_dir)}; rerun to resume"})  # fmt: skip
    if not rows:
        raise FileNotFoundError(
            f"no evaluation run ({METRICS_FILE}, {ERROR_FILE} or {RESULTS_FILE}) below {sweep_dir}: nothing to aggregate"
        )
    table = pd.DataFrame(rows)
    for key in ("decoding", "acceptance", "reference", "setting_keys", "note", *setting_keys(table)):
        if key not in table:
            table[key] = np.nan
    return table
