"""Acceptance over many seeds (`reproduce.study: acceptance_seeds`): does a rule accept more draft tokens
than another on the same utterances?

A sweep decodes each test utterance once (one seed), so two rules' acceptance rates differ by the noise of
one sample path per utterance as well as by the rules; at a few dozen utterances that noise is a few points,
as large as the effect PCG is after. This study decodes the first `utterances` test items `seeds` times
each (seed s: the runner's per-utterance seed of `seed + s`, so s = 0 is the sweep's own decode) under
every rule of `rules` (overrides of the experiment's config), decoding only (no vocoder, no judges), and
compares each rule with the first on the same utterances: the difference of acceptance rates (accepted /
proposed draft tokens, summed), with a percentile bootstrap CI over utterances (every seed of an utterance
resampled together: the seeds of one text are not independent draws of the test set).

    reproduce:
      study: acceptance_seeds
      acceptance_seeds: {utterances: 24, seeds: 10, rules: [{acceptance: exact}, {acceptance: pcg, ...}]}

Each rule decodes into its own run dir, runs/acceptance_seeds/<i>_<rule> (the runner's layout: config.yaml and
one record per utterance, its seeds' counts in lists; a rerun decodes only what is missing and refuses another configuration). Files:
acceptance_seeds.csv (one row per rule, utterance and seed), acceptance_seeds.md, fig_acceptance_seeds.png.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import torch
from omegaconf import OmegaConf

from ssd.config import compose
from ssd.config_files import as_overrides
from ssd.evaluation.metrics import bootstrap_ci
from ssd.evaluation.tables import to_markdown
from ssd.experiments import StudyResult
from ssd.files import save_figure, write_atomic

if TYPE_CHECKING:
    from ssd.experiments.driver import Experiment

RESULTS, TABLE, FIGURE = "acceptance_seeds.csv", "acceptance_seeds.md", "fig_acceptance_seeds.png"


def rule_label(rule: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in rule.items())


def decode_counts(
    cfg, run_dir: Path, utterances: int, seeds: int, label: str, progress: bool = False
) -> pd.DataFrame:
    """Accepted / proposed draft tokens of the first `utterances` test items, `seeds` decodes each (one
    batch per utterance), under `cfg` (a sweep job's config). `run_dir` is a run dir as the runner keeps
    one (config.yaml; utterances.jsonl, one record per utterance with its seeds' counts): a rerun decodes
    only the utterances it lacks, and refuses results of another configuration or other model files."""
    from omegaconf import open_dict
    from tqdm import tqdm

    from ssd.evaluation.batch import decode_items
    from ssd.evaluation.items import build_test_list, prepare_item, utterance_seed
    from ssd.evaluation.models import load_models
    from ssd.evaluation.run_dir import RunDir, append_record, read_records, run_inputs
    from ssd.evaluation.settings import RunSettings

    cfg = cfg.copy()
    with open_dict(cfg):
        cfg.output_dir = str(run_dir)
    settings = RunSettings.from_config(cfg)
    with RunDir(run_dir) as run:
        inputs = run_inputs(settings.resolved)
        run.check_config(settings.resolved, inputs)
        pairs = list(build_test_list(settings.eval).itertuples(index=False))[:utterances]
        done = {r["utt"]: r for r in read_records(run.results)}
        other = sorted({len(r["accepted"]) for r in done.values()} - {seeds})
        if other:
            raise ValueError(
                f"{run_dir} holds decodes of {other} seeds per utterance, not {seeds}: choose a new results dir "
                "or keep reproduce.acceptance_seeds.seeds"
            )
        todo = [(index, p) for index, p in enumerate(pairs) if p.utt not in done]  # index: in the test list
        if todo:
            models = load_models(settings)
            run.write_config(settings.resolved, inputs)
        prompts = {}
        for index, pair in tqdm(todo, desc=label, disable=not progress):
            item = prepare_item(models, settings.seed, index, pair, None, prompts)
            batch = [replace(item, seed=utterance_seed(settings.seed + s, pair.utt)) for s in range(seeds)]
            with torch.inference_mode():
                result, _, _ = decode_items(settings, models, batch)
            record = {"utt": pair.utt, "accepted": [sum(r["accepted"]) for r in result.rows],
                      "proposed": [sum(r["proposed"]) for r in result.rows], "tokens": [r["tokens"] for r in result.rows]}  # fmt: skip
            append_record(run.results, record)
            done[pair.utt] = record
    rows = [
        {"utt": p.utt, "seed": s, **{key: done[p.utt][key][s] for key in ("accepted", "proposed", "tokens")}}
        for p in pairs for s in range(seeds)
    ]  # fmt: skip
    return pd.DataFrame(rows).assign(rule=label)


def _rate(per_utt: list[dict], key: str) -> float:
    proposed = sum(r[f"{key}_proposed"] for r in per_utt)
    return sum(r[f"{key}_accepted"] for r in per_utt) / proposed if proposed else float("nan")


def compare(counts: pd.DataFrame, labels: list[str], n_resamples: int = 1000, seed: int = 0) -> pd.DataFrame:
    """One row per rule: acceptance, and its difference from the first rule's with a bootstrap CI over
    utterances (each resample takes an utterance's decodes under both rules together)."""
    sums = counts.groupby(["rule", "utt"])[["accepted", "proposed"]].sum()
    reference = labels[0]
    table = []
    for label in labels:
        per_utt = [
            {"ref_accepted": sums.loc[(reference, u), "accepted"], "ref_proposed": sums.loc[(reference, u), "proposed"],
             "rule_accepted": sums.loc[(label, u), "accepted"], "rule_proposed": sums.loc[(label, u), "proposed"]}
            for u in sums.loc[reference].index if (label, u) in sums.index
        ]  # fmt: skip

        def difference(records):
            return _rate(records, "rule") - _rate(records, "ref")

        lo, hi = bootstrap_ci(per_utt, difference, n_resamples, seed) if label != reference else (0.0, 0.0)
        part = counts[counts["rule"] == label]
        table.append({
            "rule": label, "utterances": part["utt"].nunique(), "decodes": len(part),
            "draft tokens": int(part["proposed"].sum()), "acceptance": _rate(per_utt, "rule"),
            f"Δ vs {reference}": difference(per_utt), "Δ CI low": lo, "Δ CI high": hi,
            "resolved": bool(lo > 0 or hi < 0),
        })  # fmt: skip
    return pd.DataFrame(table)


def _figure(table: pd.DataFrame, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    delta = [c for c in table.columns if c.startswith("Δ vs")][0]
    fig, ax = plt.subplots(figsize=(6, 0.5 * len(table) + 1.5))
    y = np.arange(len(table))[::-1]
    ax.errorbar(table[delta], y, xerr=[table[delta] - table["Δ CI low"], table["Δ CI high"] - table[delta]],
                fmt="o", color="k", capsize=3)  # fmt: skip
    ax.axvline(0, color="gray", lw=1)
    ax.set_yticks(y, table["rule"], fontsize=7)
    ax.set_xlabel(f"acceptance {delta}\n(95% bootstrap CI over utterances)")
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def run_acceptance_seeds_study(experiment: Experiment) -> StudyResult:
    spec = experiment.cfg.reproduce.acceptance_seeds
    rules = [OmegaConf.to_container(r, resolve=True) for r in spec.rules]
    utterances, seeds = int(spec.utterances), int(spec.seeds)
    labels = [rule_label(r) for r in rules]
    parts = []
    for index, (rule, label) in enumerate(zip(rules, labels)):
        cfg = compose("sweep", [f"experiment={experiment.name}", *experiment.world, *as_overrides(rule)])
        torch.set_num_threads(int(cfg.eval.get("num_threads") or 1))
        run_dir = experiment.runs / "acceptance_seeds" / f"{index}_{label.replace(' ', ',')}"
        parts.append(
            decode_counts(cfg, run_dir, utterances, seeds, label, progress=bool(cfg.get("progress")))
        )
    counts = pd.concat(parts, ignore_index=True)
    columns = ["rule", "utt", "seed", "accepted", "proposed", "tokens"]
    write_atomic(experiment.out_dir / RESULTS, counts[columns].to_csv(index=False))
    table = compare(counts, labels, int(experiment.cfg.eval.get("bootstrap_resamples", 1000)),
                    int(experiment.cfg.seed))  # fmt: skip
    shown = table.map(lambda v: f"{v:.4f}" if isinstance(v, float) else v)
    write_atomic(experiment.out_dir / TABLE, to_markdown(shown) + "\n")
    _figure(table, experiment.out_dir / FIGURE)
    section = (
        f"## Acceptance over many seeds ({utterances} test utterances x {seeds} seeds per rule, decoding only)\n\n"
        "One decode per utterance leaves a few points of sample-path noise in each acceptance rate above; "
        "here every rule decodes each utterance under the same many seeds, and the difference "
        f"from `{labels[0]}` has a bootstrap CI over utterances ('resolved': the CI excludes 0).\n\n"
        + to_markdown(shown) + "\n"
    )  # fmt: skip
    return StudyResult(sections=[section], figures=[TABLE, RESULTS, FIGURE])
