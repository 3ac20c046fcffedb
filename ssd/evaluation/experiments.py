"""Reproduce a paper table or figure with one command: `python scripts/reproduce.py <name>|all`.

An experiment is a Hydra config `configs/experiment/<name>.yaml` (`# @package _global_`): its
`hydra.sweeper.params` is the grid that `python sweep.py -m experiment=<name>` runs, and its `reproduce`
node tells this driver what else to do:

    reproduce:
      title: str                      # the summary's heading
      baseline: bool                  # also run decoding=ar into the same sweep dir (speedups)
      extra_grids: [{key: value}]     # further grids into the same sweep dir (e.g. exact rule, SSD betas)
      dev: [override, ...]            # the same grid(s) on a held-out split: choose the setting there
      match: {reference: {...}, candidates: {...}}   # pair rows at matched speed (PCG vs SSD)
      study: exactness | draft_training              # experiment-specific work (below)
      paper: [{setting, lm_rtf, speedup, wer_pct, ...}]   # the paper's numbers (REFERENCE §1), shown as is

`reproduce(name, out_root, overrides)` runs every sweep as a subprocess of `sweep.py` (and
`train_draft.py` for draft_training) into `<out_root>/<name>/runs/`, then writes into `<out_root>/<name>/`
the tables (md, csv, tex; aggregate.py's table plus experiment-specific columns), the figures (PNG),
`command.txt`, `git_commit.txt`, `machine.txt` and `summary.md`. Every number written is computed from
the run files; the paper's numbers come from the experiment config. Rerunning resumes: the runner skips
finished utterances, train.py resumes from its last checkpoint and a finished training is not redone.

`overrides` (e.g. `paths.data_dir=...`, `draft.checkpoint=...`, `eval.n_utts=4`) apply to every command
whose config has their root key; they do not name job dirs (only the grid does).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import shlex
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from ssd.evaluation.aggregate import (
    SETTING_KEYS,
    aggregate,
    display_table,
    matching_row,
    select_setting,
    to_markdown,
)
from ssd.evaluation.metrics import bootstrap_ci
from ssd.evaluation.runner import RESULTS_FILE, read_records

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO / "configs"
EXPERIMENT_DIR = CONFIG_DIR / "experiment"
DEFAULT_OUT = REPO / "experiments" / "results"
STUDIES = ("exactness", "draft_training")


def experiment_names() -> list[str]:
    """Every experiment config, in the order `all` runs them."""
    return sorted(p.stem for p in EXPERIMENT_DIR.glob("*.yaml") if not p.stem.startswith("_"))


# --------------------------------------------------------------------------------------------------
# Overrides and configs
# --------------------------------------------------------------------------------------------------


def override_key(override: str) -> str:
    """'eval.n_utts=4' -> 'eval.n_utts'; '+x=1' -> 'x'; '~x' -> 'x'."""
    return override.split("=", 1)[0].lstrip("+~")


def override_value(value: Any) -> str:
    """A config value as Hydra override text (lists as [a,b], None as null)."""
    if isinstance(value, (ListConfig, DictConfig)):
        value = OmegaConf.to_container(value, resolve=True)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(override_value(v) for v in value) + "]"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def merge_overrides(*groups: Sequence[str]) -> list[str]:
    """Concatenate override lists; for a key given twice the later one wins (Hydra refuses duplicates)."""
    merged: dict[str, str] = {}
    for group in groups:
        for override in group:
            merged.pop(override_key(override), None)
            merged[override_key(override)] = override
    return list(merged.values())


def compose(config_name: str, overrides: Sequence[str] = (), with_hydra: bool = False) -> DictConfig:
    """configs/<config_name>.yaml composed with `overrides`, as the entry point would see it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    if config_name == "train_draft":
        from ssd.training.schema import register_schema

        register_schema()
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        return hydra_compose(config_name, overrides=list(overrides), return_hydra_config=with_hydra)


def load_experiment(name: str, overrides: Sequence[str] = ()) -> DictConfig:
    """The sweep config of experiment `name` (with its `hydra` and `reproduce` nodes), checked."""
    if name not in experiment_names():
        raise ValueError(
            f"unknown experiment {name!r}: choose one of {experiment_names()} (configs/experiment/)"
        )
    driver_only = [
        o for o in overrides if override_key(o).split(".")[0] == "reproduce"
    ]  # e.g. smaller studies
    cfg = compose(
        "sweep", [f"experiment={name}", *applicable(overrides, "sweep"), *driver_only], with_hydra=True
    )
    spec = cfg.get("reproduce")
    where = f"configs/experiment/{name}.yaml"
    if spec is None or not spec.get("title"):
        raise ValueError(
            f"{where}: needs a `reproduce:` node with a title (see ssd/evaluation/experiments.py)"
        )
    if spec.get("study") not in (None, *STUDIES):
        raise ValueError(f"{where}: reproduce.study must be one of {STUDIES} or absent, got {spec.study!r}")
    if not cfg.hydra.sweeper.get("params"):
        raise ValueError(f"{where}: hydra.sweeper.params (the experiment's grid) is empty")
    return cfg


_ROOT_KEYS: dict[str, set[str]] = {}


def applicable(overrides: Sequence[str], config_name: str) -> list[str]:
    """The overrides whose root key exists in configs/<config_name> (hydra.* always applies)."""
    if config_name not in _ROOT_KEYS:
        cfg = compose(config_name)
        _ROOT_KEYS[config_name] = set(cfg.keys()) | {"hydra"}
    return [o for o in overrides if override_key(o).split(".")[0].split("/")[0] in _ROOT_KEYS[config_name]]


def grid_overrides(grid: Any) -> list[str]:
    """{key: value} of an extra grid as multirun overrides ('0.2,0.4' sweeps)."""
    return [f"{k}={override_value(v)}" for k, v in OmegaConf.to_container(grid).items()]


# --------------------------------------------------------------------------------------------------
# Subprocess commands
# --------------------------------------------------------------------------------------------------


@dataclass
class CommandLog:
    """The exact commands of one experiment, as run (command.txt)."""

    path: Path
    lines: list[str] = field(default_factory=list)

    def add(self, argv: Sequence[str]) -> None:
        self.lines.append(" ".join(shlex.quote(a) for a in argv))
        self.path.write_text(
            f"# run from {REPO} (python = {sys.executable})\n" + "\n".join(self.lines) + "\n"
        )


def _env() -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_SILENT": "true"}
    env.setdefault("WANDB_MODE", "offline")
    return env


def run_command(argv: Sequence[str], commands: CommandLog, log_path: Path) -> None:
    """Run one entry point from the repo root, its output appended to `log_path`; raise if it fails."""
    commands.add(argv)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("a") as out:
        out.write(f"\n$ {commands.lines[-1]}\n")
        out.flush()
        done = subprocess.run(list(argv), cwd=REPO, env=_env(), stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise RuntimeError(f"command failed (exit {done.returncode}): {commands.lines[-1]}\nsee {log_path}")


def sweep_argv(name: str, sweep_dir: Path, grid: Sequence[str], world: Sequence[str], exclude: Sequence[str]):
    """`python sweep.py -m experiment=<name> <grid> <world>` into `sweep_dir`; world keys do not name dirs."""
    keys = list(dict.fromkeys([*exclude, *(override_key(o) for o in world)]))
    return [
        sys.executable, str(REPO / "sweep.py"), "-m", f"experiment={name}", *grid, *world,
        f"hydra.sweep.dir={sweep_dir}", f"hydra.job.config.override_dirname.exclude_keys={override_value(keys)}",
    ]  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Provenance
# --------------------------------------------------------------------------------------------------


def machine_description() -> str:
    cpu = platform.processor() or "unknown"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                 if line.startswith("model name")]  # fmt: skip
        cpu = names[0] if names else cpu
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (no CUDA device)"
    return (
        f"cpu: {cpu}\ncores: {os.cpu_count()}\ntorch threads: {torch.get_num_threads()}\n"
        f"torch: {torch.__version__}\ndevice: {device}\npython: {platform.python_version()}\n"
        f"platform: {platform.platform()}\n"
    )


def git_description() -> str:
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    commit = git("rev-parse", "HEAD") or "unknown (not a git checkout)"
    dirty = [line for line in git("status", "--porcelain", "--untracked-files=no").splitlines() if line]
    text = f"{commit}\n"
    if dirty:
        text += f"uncommitted changes to {len(dirty)} tracked files:\n" + "\n".join(dirty) + "\n"
    return text


# --------------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------------


def _run_sums(run_dir: Path) -> dict[str, float]:
    records = read_records(run_dir / RESULTS_FILE)
    keys = ("time_draft", "draft_calls", "time_verify", "target_calls")
    return {k: float(sum(r.get(k) or 0 for r in records)) for k in keys}


def expected_tokens_per_round(alpha: float, draft_len: int) -> float:
    """E(α, γ) = (1 - α^(γ+1)) / (1 - α): tokens per target pass with i.i.d. acceptance (REFERENCE §1.4)."""
    return draft_len + 1.0 if alpha >= 1 else (1 - alpha ** (draft_len + 1)) / (1 - alpha)


def add_cost_columns(table: pd.DataFrame, sweep_dir: Path) -> pd.DataFrame:
    """Per-call costs measured in each run, and the speedup they predict from the measured α:
    c = draft call / AR target call, v = verify call / AR target call, predicted = E(α, L_d) / (L_d·c + v)."""
    table = table.copy()
    for column in ("c_draft", "verify_cost", "predicted_speedup"):
        table[column] = np.nan
    ok = table["status"] == "ok"
    ar = table[ok & (table["decoding"] == "ar")]
    if ar.empty:
        return table
    ar_sums = [_run_sums(sweep_dir / run) for run in ar["run"]]
    t_ar = sum(s["time_verify"] for s in ar_sums) / max(1.0, sum(s["target_calls"] for s in ar_sums))
    for idx, row in table[ok & (table["decoding"] == "speculative")].iterrows():
        sums = _run_sums(sweep_dir / row["run"])
        if not (sums["draft_calls"] and sums["target_calls"] and t_ar):
            continue
        c = sums["time_draft"] / sums["draft_calls"] / t_ar
        v = sums["time_verify"] / sums["target_calls"] / t_ar
        k = int(row["draft_len"])
        table.loc[idx, ["c_draft", "verify_cost"]] = c, v
        table.loc[idx, "predicted_speedup"] = expected_tokens_per_round(row["acceptance_rate"], k) / (
            k * c + v
        )
    return table


def shown_table(table: pd.DataFrame) -> pd.DataFrame:
    """aggregate's display table plus the cost columns (speculative rows)."""
    shown = display_table(table)
    ok = table[table["status"] == "ok"].reset_index(drop=True)
    if "predicted_speedup" in ok and len(shown) == len(ok):
        shown["theta"] = ok["theta"].map(lambda v: "-" if pd.isna(v) else f"{v:g}").to_numpy()
        shown["c (draft/AR call)"] = ok["c_draft"].map(lambda v: "-" if pd.isna(v) else f"{v:.3f}").to_numpy()
        shown["verify/AR call"] = (
            ok["verify_cost"].map(lambda v: "-" if pd.isna(v) else f"{v:.2f}").to_numpy()
        )
        shown["predicted speedup"] = (
            ok["predicted_speedup"].map(lambda v: "-" if pd.isna(v) else f"{v:.2f}").to_numpy()
        )
    return shown


def write_table(table: pd.DataFrame, out_dir: Path, stem: str) -> pd.DataFrame:
    """<stem>.csv (every numeric column), <stem>.md and <stem>.tex (the readable table)."""
    table.to_csv(out_dir / f"{stem}.csv", index=False)
    shown = shown_table(table)
    markdown = to_markdown(shown)
    failed = table[table["status"] == "failed"]
    if not failed.empty:
        markdown += "\nFailed jobs:\n" + "".join(
            f"- {r['run']}: {r['error']}\n" for _, r in failed.iterrows()
        )
    (out_dir / f"{stem}.md").write_text(markdown)
    (out_dir / f"{stem}.tex").write_text(shown.to_latex(index=False, escape=True))
    return shown


def paper_table(rows: Any) -> str:
    """The paper's numbers from the experiment config, as they are."""
    rows = OmegaConf.to_container(rows) if rows is not None else []
    if not rows:
        return "(the paper reports no numbers for this experiment)\n"
    names = {"setting": "setting", "lm_rtf": "LM-RTF", "speedup": "speedup", "wer_pct": "WER %", "sim": "SIM"}
    columns = [c for c in names if any(c in r for r in rows)]
    columns += [c for r in rows for c in r if c not in columns]
    frame = pd.DataFrame([{names.get(c, c): r.get(c, "-") for c in columns} for r in rows])
    return to_markdown(frame)


def _setting_text(row: pd.Series) -> str:
    parts = [f"{k}={row[k]:g}" if isinstance(row[k], float) else f"{k}={row[k]}"
             for k in SETTING_KEYS if k in row and not pd.isna(row[k])]  # fmt: skip
    return ", ".join(parts)


def _fmt_ci(row: pd.Series, key: str, scale: float = 1.0, digits: int = 3) -> str:
    value = row.get(key)
    if value is None or pd.isna(value):
        return "-"
    return f"{value * scale:.{digits}f} [{row[f'{key}_ci_lo'] * scale:.{digits}f}, {row[f'{key}_ci_hi'] * scale:.{digits}f}]"


def select_on_dev(dev: pd.DataFrame, test: pd.DataFrame) -> tuple[str, pd.DataFrame | None]:
    """The reviewer's protocol: choose on dev (aggregate.select_setting), report the same setting on test."""
    try:
        chosen = select_setting(dev)
    except ValueError as err:
        return f"No setting chosen on dev: {err}.\n", None
    text = (
        f"Chosen on the dev split (fastest speculative setting whose WER CI overlaps AR's): "
        f"**{_setting_text(chosen)}** (dev LM-RTF {_fmt_ci(chosen, 'lm_rtf')}, dev WER % "
        f"{_fmt_ci(chosen, 'wer', 100, 1)}).\n"
    )
    try:
        row = matching_row(test, chosen)
    except ValueError as err:
        return text + f"{err}\n", None
    ar = test[(test["decoding"] == "ar") & (test["status"] == "ok")]
    return text + "The same setting on the test split:\n\n", test.loc[[*ar.index, row.name]]


def matched_speed(table: pd.DataFrame, match: Any) -> tuple[str, pd.DataFrame | None]:
    """The reference row (e.g. SSD β = 0.4) and the candidate (e.g. PCG θ) with the closest speedup."""
    ok = table[(table["status"] == "ok") & (table["decoding"] == "speculative")]

    def rows_like(setting: dict) -> pd.DataFrame:
        mask = pd.Series(True, index=ok.index)
        for key, value in setting.items():
            mask &= ok[key] == value
        return ok[mask]

    reference = rows_like(OmegaConf.to_container(match.reference))
    candidates = rows_like(OmegaConf.to_container(match.candidates)).dropna(subset=["speedup"])
    if reference.empty or candidates.empty or pd.isna(reference["speedup"].iloc[0]):
        return "Matched speed: the reference or candidate runs (or the AR baseline) are missing.\n", None
    ref = reference.iloc[0]
    best = candidates.loc[(candidates["speedup"] - ref["speedup"]).abs().idxmin()]
    ar = table[(table["decoding"] == "ar") & (table["status"] == "ok")]
    exact = ok[ok["acceptance"].isin(["exact"]) | ((ok["acceptance"] == "tolerance") & (ok["beta"] == 0))]
    text = (
        f"Matched speed: {_setting_text(ref)} runs at {ref['speedup']:.2f}x; the closest candidate is "
        f"{_setting_text(best)} at {best['speedup']:.2f}x.\n\n"
    )
    return text, table.loc[[*ar.index, *exact.index, ref.name, best.name]]


# --------------------------------------------------------------------------------------------------
# Exactness: chi-square on early tokens, TV drift, paired differences
# --------------------------------------------------------------------------------------------------


def chi_square_homogeneity(a: Sequence, b: Sequence, min_cell: int = 5) -> dict[str, float]:
    """Two-sample chi-square test that samples `a` and `b` (hashable outcomes) come from one law.

    Outcomes seen fewer than `min_cell` times in both samples together are pooled into one cell (the
    chi-square approximation needs expected counts of about 5). Returns statistic, dof, p-value."""
    from scipy.stats import chi2_contingency

    count_a, count_b = Counter(a), Counter(b)
    cells = sorted(set(count_a) | set(count_b), key=lambda c: (-(count_a[c] + count_b[c]), str(c)))
    frequent = [c for c in cells if count_a[c] + count_b[c] >= min_cell]
    rare = [c for c in cells if count_a[c] + count_b[c] < min_cell]
    table = np.array(
        [
            [count_a[c] for c in frequent] + [sum(count_a[c] for c in rare)],
            [count_b[c] for c in frequent] + [sum(count_b[c] for c in rare)],
        ]
    )
    table = table[:, table.sum(0) > 0]
    if table.shape[1] < 2:
        return {"statistic": 0.0, "dof": 0, "p_value": 1.0, "cells": int(table.shape[1])}
    statistic, p_value, dof, _ = chi2_contingency(table, correction=False)
    return {
        "statistic": float(statistic),
        "dof": int(dof),
        "p_value": float(p_value),
        "cells": int(table.shape[1]),
    }


def sample_early_tokens(
    decode: Callable[[Any, torch.Generator], Any],
    make_prompt: Callable[[int], Any],
    n_samples: int,
    batch: int,
    n_tokens: int,
    seed: int,
) -> list[tuple[int, ...]]:
    """The first `n_tokens` generated tokens of `n_samples` decodes of one prompt, `batch` rows at a time."""
    generator = torch.Generator().manual_seed(seed)
    out: list[tuple[int, ...]] = []
    with torch.inference_mode():
        for start in range(0, n_samples, batch):
            rows = min(batch, n_samples - start)
            result = decode(make_prompt(rows), generator)
            short = [t for t in result.tokens if len(t) < n_tokens]
            if short:
                raise ValueError(f"a decode stopped before {n_tokens} tokens: set min_len >= n_tokens")
            out.extend(tuple(t[:n_tokens]) for t in result.tokens)
    return out


def repeat_rate(samples: Sequence[tuple[int, ...]]) -> float:
    """Fraction of sequences in which a token repeats an earlier one: only there can RAS act (a nucleus
    draw of a token already in its window is replaced by a draw from the full law), so only there can a
    verifier without RAS be told from the target."""
    return float(np.mean([len(set(s)) < len(s) for s in samples])) if samples else 0.0


def ar_decoder(target, sampling, tokens: int) -> Callable[[Any, torch.Generator], Any]:
    """decode(prompt, generator) -> the target's own AR decode of exactly `tokens` tokens."""
    from ssd.decoding.generate import decode_ar

    def decode(prompt, generator):
        return decode_ar(target, prompt, sampling, max_len=tokens, min_len=tokens, generator=generator)

    return decode


@dataclass
class ExactnessArm:
    name: str  # shown in the table
    beta: float
    ras_in_verifier: bool  # False: the verifier (and draft) use plain top-k/top-p, RAS off
    expect_equal: bool  # what a correct engine must give


EXACTNESS_ARMS = (
    ExactnessArm("speculative beta = 0 (RAS law in the verifier)", 0.0, True, True),
    ExactnessArm("speculative beta = 0.4", 0.4, True, False),
    ExactnessArm("speculative beta = 0, verifier without RAS (plain top-k/top-p)", 0.0, False, False),
)


def exactness_chi_square(
    target,
    draft,
    sampling,
    make_prompt: Callable[[int], Any],
    *,
    samples: int,
    batch: int,
    tokens: int = 3,
    draft_len: int = 2,
    min_cell: int = 5,
    alpha: float = 0.001,
    beta_broken: float = 0.4,
    seed: int = 0,
    arms: Sequence[ExactnessArm] = EXACTNESS_ARMS,
) -> pd.DataFrame:
    """AR samples of the target (which samples WITH its RAS law) against each speculative arm.

    Tests the joint law of tokens 1..`tokens` and of tokens 2..`tokens` (token 1 comes from the target's
    prefill in both decoders, so only tokens 2.. exercise the verifier). Equality is rejected when p < alpha.
    """
    from ssd.decoding.acceptance import make_rule
    from ssd.decoding.generate import decode_speculative

    reference = sample_early_tokens(
        ar_decoder(target, sampling, tokens), make_prompt, samples, batch, tokens, seed
    )
    rows = []
    for i, arm in enumerate(arms):
        beta = beta_broken if arm.beta > 0 else 0.0
        verifier_law = sampling if arm.ras_in_verifier else replace(sampling, ras_window=0)
        rule = make_rule("tolerance", beta=beta)

        def spec(prompt, generator, law=verifier_law, rule=rule):
            return decode_speculative(target, draft, prompt, law, rule, draft_len=draft_len, max_len=tokens,
                                      min_len=tokens, generator=generator)  # fmt: skip

        drawn = sample_early_tokens(spec, make_prompt, samples, batch, tokens, seed + 1 + i)
        joint = chi_square_homogeneity(reference, drawn, min_cell)
        later = chi_square_homogeneity([s[1:] for s in reference], [s[1:] for s in drawn], min_cell)
        name = arm.name.replace("0.4", f"{beta:g}") if arm.beta > 0 else arm.name
        rows.append({
            "arm": name, "samples": samples, f"chi2 tokens 1-{tokens}": joint["statistic"],
            f"dof 1-{tokens}": joint["dof"], f"p tokens 1-{tokens}": joint["p_value"],
            f"chi2 tokens 2-{tokens}": later["statistic"], f"dof 2-{tokens}": later["dof"],
            f"p tokens 2-{tokens}": later["p_value"],
            "equal law accepted": bool(min(joint["p_value"], later["p_value"]) >= alpha),
            "expected": "equal" if arm.expect_equal else "different",
        })  # fmt: skip
    return pd.DataFrame(rows)


def tv_drift(target, draft, sampling, prompt, min_len, max_len, betas, draft_len, seed=0) -> pd.DataFrame:
    """Mean per-step TV(output law of the tolerance rule, target law q) per draft position, per beta:
    exact (no sampling noise in the TV itself), along real speculative decodes of `prompt`."""
    from ssd.decoding.acceptance import make_rule
    from ssd.decoding.generate import decode_speculative

    rows = []
    for beta in betas:
        generator = torch.Generator().manual_seed(seed)
        with torch.inference_mode():
            result = decode_speculative(target, draft, prompt, sampling, make_rule("tolerance", beta=float(beta)),
                                        draft_len=draft_len, max_len=max_len, min_len=min_len,
                                        generator=generator, track_tv=True)  # fmt: skip
        stats = result.stats
        row = {"beta": float(beta), "mean TV": sum(stats.tv_sum) / max(1, sum(stats.proposed)),
               "acceptance": stats.acceptance_rate, "positions": sum(stats.proposed)}  # fmt: skip
        row.update({f"TV pos {i + 1}": v for i, v in enumerate(stats.tv_per_position)})
        rows.append(row)
    return pd.DataFrame(rows)


def paired_differences(ar_dir: Path, spec_dir: Path, n_resamples: int = 1000, seed: int = 0) -> pd.DataFrame:
    """Speculative minus AR on the same utterances: corpus WER and mean SIM, paired bootstrap 95% CIs."""
    ar = {r["utt"]: r for r in read_records(ar_dir / RESULTS_FILE)}
    pairs = [(ar[r["utt"]], r) for r in read_records(spec_dir / RESULTS_FILE) if r["utt"] in ar]
    if len(pairs) < 2:
        raise ValueError(f"{ar_dir} and {spec_dir} share fewer than 2 utterances: nothing to pair")

    def wer_diff(ps):
        def wer(side):
            return sum(p[side]["errors"] for p in ps) / max(1, sum(p[side]["ref_words"] for p in ps))

        return wer(1) - wer(0)

    def sim_diff(ps):
        both = [(a["sim"], s["sim"]) for a, s in ps if a.get("sim") is not None and s.get("sim") is not None]
        return float(np.mean([s - a for a, s in both])) if both else float("nan")

    rows = []
    for name, fn, scale in (("WER (points of %)", wer_diff, 100.0), ("SIM", sim_diff, 1.0)):
        lo, hi = bootstrap_ci(pairs, fn, n_resamples, seed)
        value = fn(pairs)
        rows.append({"metric": name, "speculative - AR": value * scale, "95% CI lo": lo * scale,
                     "95% CI hi": hi * scale, "CI contains 0": bool(lo <= 0 <= hi), "pairs": len(pairs)})  # fmt: skip
    return pd.DataFrame(rows)


def _exactness_models(cfg: DictConfig):
    """Target, draft, sampling law and the first test item's prompt pieces, from the experiment's config."""
    from hydra.utils import instantiate

    from ssd.audio.features import load_audio
    from ssd.data.prepare import load_speech_tokenizer
    from ssd.evaluation.runner import build_test_list

    target = instantiate(cfg.target.model)
    draft = instantiate(cfg.draft, target=target)
    sampling = instantiate(cfg.target.sampling)
    pairs = build_test_list(cfg.eval)
    tokenizer = load_speech_tokenizer(cfg.speech_tokenizer.kind, cfg.speech_tokenizer.path)
    items = []
    for pair in pairs.itertuples(index=False):
        wav, sr = load_audio(pair.prompt_wav, None)
        items.append((pair.text, pair.prompt_text, np.asarray(tokenizer.encode(wav, sr)).tolist()))
    return target, draft, sampling, items


def run_exactness_study(cfg: DictConfig, out_dir: Path, test: pd.DataFrame, sweep_dir: Path) -> str:
    """The in-process parts of `exactness`: chi-square, TV drift, paired differences. Returns summary text."""
    spec = cfg.reproduce
    chi, drift = spec.chi_square, spec.tv_drift
    torch.set_num_threads(int(cfg.eval.get("num_threads") or 1))
    target, draft, sampling, items = _exactness_models(cfg)

    def prompt_of(item):
        text, prompt_text, prompt_tokens = item
        prompt_tokens = prompt_tokens[: int(chi.prompt_speech_tokens)]
        return lambda rows: target.make_prompt([text] * rows, [prompt_text] * rows, [prompt_tokens] * rows)

    # The prompt: of the first candidates, the one whose AR decodes repeat a token most often (the
    # negative control without RAS needs prompts where RAS acts to have any power).
    candidates = items[: max(1, int(chi.get("prompt_candidates", 1)))]
    probe = ar_decoder(target, sampling, int(chi.tokens))
    rates = [
        repeat_rate(sample_early_tokens(probe, prompt_of(item), int(chi.get("probe_samples", 1000)),
                                        int(chi.batch), int(chi.tokens), int(cfg.seed)))
        for item in candidates
    ] if len(candidates) > 1 else [float("nan")]  # fmt: skip
    chosen_item = int(np.nanargmax(rates)) if len(candidates) > 1 else 0
    make_prompt = prompt_of(candidates[chosen_item])

    chi_table = exactness_chi_square(
        target, draft, sampling, make_prompt, samples=int(chi.samples), batch=int(chi.batch),
        tokens=int(chi.tokens), draft_len=int(chi.draft_len), min_cell=int(chi.min_cell), alpha=float(chi.alpha),
        beta_broken=float(chi.beta_broken), seed=int(cfg.seed),
    )  # fmt: skip
    chi_table["AR repeat rate (prompt probe)"] = rates[chosen_item]
    chi_table.to_csv(out_dir / "chi_square.csv", index=False)
    shown_chi = chi_table.copy()
    for column in shown_chi.columns:
        if column.startswith("chi2"):
            shown_chi[column] = shown_chi[column].map(lambda v: f"{v:.1f}")
        elif column.startswith("p "):
            shown_chi[column] = shown_chi[column].map(lambda v: f"{v:.3g}")
    (out_dir / "chi_square.md").write_text(to_markdown(shown_chi))

    chosen = items[: int(drift.prompts)]
    prompt = target.make_prompt([i[0] for i in chosen], [i[1] for i in chosen], [i[2] for i in chosen])
    min_len, max_len = target.length_limits(prompt)
    if cfg.eval.get("max_len") is not None:
        max_len = max_len.clamp(max=int(cfg.eval.max_len))
        min_len = torch.minimum(min_len, max_len)
    drift_table = tv_drift(target, draft, sampling, prompt, min_len, max_len, list(drift.betas),
                           int(cfg.draft_len), int(cfg.seed))  # fmt: skip
    drift_table.to_csv(out_dir / "tv_drift.csv", index=False)
    (out_dir / "tv_drift.md").write_text(to_markdown(drift_table.map(
        lambda v: f"{v:.4f}" if isinstance(v, float) else v)))  # fmt: skip
    _tv_figure(drift_table, out_dir / "fig_tv_drift_vs_beta.png")

    ok = test[test["status"] == "ok"]
    ar, spec_rows = ok[ok["decoding"] == "ar"], ok[ok["decoding"] == "speculative"]
    paired_text = "The AR and speculative runs are missing: no paired comparison.\n"
    if not ar.empty and not spec_rows.empty:
        paired = paired_differences(sweep_dir / ar["run"].iloc[0], sweep_dir / spec_rows["run"].iloc[0],
                                    int(cfg.eval.get("bootstrap_resamples", 1000)), int(cfg.seed))  # fmt: skip
        paired.to_csv(out_dir / "paired_differences.csv", index=False)
        paired_text = to_markdown(paired.map(lambda v: f"{v:.4f}" if isinstance(v, float) else v))
    verdicts = "".join(
        f"- {r['arm']}: equality {'accepted' if r['equal law accepted'] else 'rejected'} at p < {chi.alpha} "
        f"(expected: {r['expected']}){'' if r['equal law accepted'] == (r['expected'] == 'equal') else ' **UNEXPECTED**'}\n"
        for _, r in chi_table.iterrows()
    )  # fmt: skip
    return (
        "## beta = 0 vs AR on the same utterances and seeds (paired bootstrap)\n\n" + paired_text +
        f"\n## Chi-square on the first {chi.tokens} generated tokens ({chi.samples} decodes of one test "
        f"prompt per arm, L_d = {chi.draft_len}, cells under {chi.min_cell} counts pooled; token 1 comes from "
        "the target's prefill in both decoders, so tokens 2.. are tested alone too)\n\n"
        f"The prompt is test item {chosen_item} of the first {len(candidates)}: the one whose AR decodes "
        "repeat a token most often (RAS acts only on a repeat, so only there can a verifier without RAS be "
        "told from the target); repeat rate per candidate: "
        + ", ".join(f"{r:.3f}" for r in rates) + ".\n\n"
        + to_markdown(shown_chi) + "\n" + verdicts +
        f"\n## Per-step TV(output law, target law) as beta grows ({len(chosen)} test prompts, L_d = "
        f"{cfg.draft_len})\n\n" + (out_dir / "tv_drift.md").read_text()
    )  # fmt: skip


def _tv_figure(drift: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(drift["beta"], drift["mean TV"], marker="o", color="k", label="mean over positions")
    for column in [c for c in drift.columns if c.startswith("TV pos")]:
        ax.plot(drift["beta"], drift[column], marker=".", alpha=0.6, label=column.replace("TV ", ""))
    ax.set(xlabel="β", ylabel="TV(output law, target law) per step", title="Distribution drift vs β")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------
# Draft training
# --------------------------------------------------------------------------------------------------


def draft_training(name: str, cfg: DictConfig, runs: Path, world: Sequence[str], train_world: Sequence[str],
                   commands: CommandLog, exclude: Sequence[str]) -> pd.DataFrame:  # fmt: skip
    """Train each variant with train_draft.py (skipped when finished), evaluate it into runs/test/<variant>;
    returns one row per variant with its training metrics. world: the sweeps' overrides; train_world:
    train_draft.py's (they win over the experiment's `train.common`, the variant's settings win over both)."""
    spec = cfg.reproduce.train
    common = [f"{k}={override_value(v)}" for k, v in OmegaConf.to_container(spec.common).items()]
    rows = []
    for variant, settings in spec.variants.items():
        variant_overrides = [f"{k}={override_value(v)}" for k, v in OmegaConf.to_container(settings).items()]
        train_dir = runs / "train" / variant
        finished = (train_dir / "metrics.json").is_file() and (train_dir / "draft.pt").is_file()
        if not finished:
            argv = [sys.executable, str(REPO / "train_draft.py"),
                    *merge_overrides(common, train_world, variant_overrides),
                    f"hydra.run.dir={train_dir}"]  # fmt: skip
            run_command(argv, commands, runs / "logs" / f"train_{variant}.log")
        else:
            log.info("%s: training %s already finished", name, variant)
        metrics = json.loads((train_dir / "metrics.json").read_text())
        draft_keys = [o for o in variant_overrides if override_key(o).startswith("draft.")]
        grid = ["hydra.sweeper.params=null", "decoding=speculative", *draft_keys,
                f"draft.checkpoint={train_dir / 'draft.pt'}", f"hydra.sweep.subdir={variant}"]  # fmt: skip
        run_command(
            sweep_argv(name, runs / "test", grid, world, exclude), commands, runs / "logs" / "sweep.log"
        )
        rows.append({
            "run": variant, **{override_key(o): o.split("=", 1)[1] for o in variant_overrides},
            "train steps": metrics.get("global_step"),
            "dev alpha before": metrics.get("before/dev/alpha_softmax"),
            "dev alpha after": metrics.get("dev/alpha_softmax"),
            "dev alpha (target sampling) after": metrics.get("dev/alpha_target_sampling"),
            "dev top-1 agreement after": metrics.get("dev/top1_agreement"),
        })  # fmt: skip
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------------------------------
# The driver
# --------------------------------------------------------------------------------------------------


def _copy_figures(sweep_dir: Path, out_dir: Path, suffix: str = "") -> list[str]:
    names = []
    for fig in sorted(sweep_dir.glob("fig_*.png")):
        target = out_dir / f"{fig.stem}{suffix}.png"
        target.write_bytes(fig.read_bytes())
        names.append(target.name)
    return names


def run_sweeps(name: str, cfg: DictConfig, sweep_dir: Path, world: Sequence[str], exclude: Sequence[str],
               commands: CommandLog, log_path: Path) -> None:  # fmt: skip
    """The experiment's grid, its extra grids and the AR baseline, all into `sweep_dir`."""
    spec = cfg.reproduce
    run_command(sweep_argv(name, sweep_dir, [], world, exclude), commands, log_path)
    for grid in spec.get("extra_grids") or []:
        argv = sweep_argv(
            name, sweep_dir, ["hydra.sweeper.params=null", *grid_overrides(grid)], world, exclude
        )
        run_command(argv, commands, log_path)
    if spec.get("baseline"):
        argv = sweep_argv(name, sweep_dir, ["hydra.sweeper.params=null", "decoding=ar"], world, exclude)
        run_command(argv, commands, log_path)


def reproduce(
    name: str,
    out_root: str | Path = DEFAULT_OUT,
    overrides: Sequence[str] = (),
    train_overrides: Sequence[str] = (),
) -> Path:
    """Run experiment `name` end to end (resuming) and write its results dir; returns that dir."""
    cfg = load_experiment(name, overrides)
    spec = cfg.reproduce
    out_dir = Path(out_root).resolve() / name
    runs = out_dir / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    (out_dir / "machine.txt").write_text(machine_description())
    (out_dir / "git_commit.txt").write_text(git_description())
    commands = CommandLog(out_dir / "command.txt")
    world = applicable(overrides, "sweep")
    if not any(override_key(o) == "logger" for o in world):
        world.insert(0, "logger=none")  # W&B start-up costs seconds per job; pass logger=wandb to mirror
    world = merge_overrides(["~reproduce"], world)  # the driver's notes are not part of a run's config
    exclude = [*cfg.hydra.job.config.override_dirname.exclude_keys, "experiment"]
    log_path = runs / "logs" / "sweep.log"

    run_sweeps(name, cfg, runs / "test", world, exclude, commands, log_path)
    variants = None
    if spec.get("study") == "draft_training":
        train_world = [*applicable(overrides, "train_draft"), *train_overrides]
        variants = draft_training(name, cfg, runs, world, train_world, commands, exclude)

    test = add_cost_columns(aggregate(runs / "test"), runs / "test")
    if variants is not None:
        test = test.merge(variants, on="run", how="left")
    shown = write_table(test, out_dir, "table")
    figures = _copy_figures(runs / "test", out_dir)
    sections = [f"## Toy world, test split (this run)\n\n{to_markdown(shown)}"]
    if variants is not None:
        keep = [c for c in ("run", "draft.trainable", "kd_weight", "train steps", "dev alpha before", "dev alpha after",
                            "dev alpha (target sampling) after", "acceptance_rate", "speedup", "wer")
                if c in test]  # fmt: skip
        extra = (
            test[test["status"] == "ok"][keep]
            .assign(wer=lambda t: t["wer"] * 100)
            .rename(columns={"wer": "WER %"})
        )
        extra = extra.map(lambda v: "-" if v is None or (isinstance(v, float) and np.isnan(v)) else
                          f"{v:.3f}" if isinstance(v, float) else v)  # fmt: skip
        sections.append("## Draft variants (trained with train_draft.py, evaluated on the split above)\n\n"
                        + to_markdown(extra))  # fmt: skip

    if spec.get("dev"):
        dev_world = merge_overrides(list(spec.dev), world)
        run_sweeps(name, cfg, runs / "dev", dev_world, exclude, commands, log_path)
        dev = add_cost_columns(aggregate(runs / "dev"), runs / "dev")
        dev_shown = write_table(dev, out_dir, "table_dev")
        figures += _copy_figures(runs / "dev", out_dir, "_dev")
        text, chosen = select_on_dev(dev, test)
        section = "## Held-out choice (dev split -> test split)\n\n" + text
        if chosen is not None:
            section += "\n" + to_markdown(shown_table(chosen))
        sections.append(section + f"\n\nDev split, every setting:\n\n{to_markdown(dev_shown)}")
    if spec.get("match"):
        text, matched = matched_speed(test, spec.match)
        sections.append(
            "## Matched speed\n\n" + text + (to_markdown(shown_table(matched)) if matched is not None else "")
        )
    if spec.get("study") == "exactness":
        study_cfg = load_experiment(name, overrides)
        sections.append(run_exactness_study(study_cfg, out_dir, test, runs / "test"))
        figures.append("fig_tv_drift_vs_beta.png")

    summary = [
        f"# {spec.title}\n",
        f"Produced by `python scripts/reproduce.py {name}` (commands: command.txt; commit: git_commit.txt; "
        f"machine: machine.txt). Every number below except the paper's is computed from the run files under "
        f"runs/; speedups are measured wall-clock LM-RTF ratios on this machine, never GPU numbers.\n",
        f"## The paper\n\n{paper_table(spec.get('paper'))}",
        *sections,
        "## Files\n\n" + "\n".join(f"- {f}" for f in ["table.md", "table.csv", *figures]) + "\n",
    ]
    (out_dir / "summary.md").write_text("\n".join(summary))
    return out_dir


def reproduce_all(out_root=DEFAULT_OUT, overrides=(), train_overrides=()) -> list[Path]:
    return [reproduce(n, out_root, overrides, train_overrides) for n in experiment_names()]
