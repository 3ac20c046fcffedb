"""The acceptance-over-seeds study (ssd.experiments.acceptance_seeds): rules compared on the same
utterances over many seeds, with a bootstrap CI over utterances that resolves a real gap and not a null."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from fixtures_eval import sweep_overrides

from ssd.config import compose
from ssd.experiments.acceptance_seeds import compare, decode_counts
from ssd.experiments.driver import load_experiment


def _counts(rates: dict[str, float], utterances=20, seeds=10, proposed=60, seed=0) -> pd.DataFrame:
    """Binomial accept counts; each utterance has its own difficulty, shared by every rule (as texts do)."""
    rng = np.random.default_rng(seed)
    shift = rng.normal(0, 0.05, utterances)
    rows = []
    for rule, rate in rates.items():
        for u in range(utterances):
            p = float(np.clip(rate + shift[u], 0.01, 0.99))
            rows += [{"rule": rule, "utt": f"u{u}", "seed": s, "accepted": rng.binomial(proposed, p),
                      "proposed": proposed} for s in range(seeds)]  # fmt: skip
    return pd.DataFrame(rows)


def test_compare_resolves_a_real_gap_and_not_a_null():
    table = compare(
        _counts({"exact": 0.85, "same law": 0.85, "better": 0.88}), ["exact", "same law", "better"]
    )
    rows = table.set_index("rule")
    assert rows.loc["exact", "Δ vs exact"] == 0 and not rows.loc["exact", "resolved"]
    # negative control: the same law is not called different
    assert not rows.loc["same law", "resolved"]
    assert rows.loc["same law", "Δ CI low"] < 0 < rows.loc["same law", "Δ CI high"]
    assert rows.loc["better", "resolved"] and abs(rows.loc["better", "Δ vs exact"] - 0.03) < 0.01
    assert rows.loc["better", "decodes"] == 200 and rows.loc["better", "draft tokens"] == 200 * 60


def test_pcg_table1_compares_every_group_size_with_exact_and_a_size_1_control():
    spec = load_experiment("pcg_table1_main").reproduce
    assert spec.study == "acceptance_seeds" and int(spec.acceptance_seeds.seeds) > 1
    rules = [dict(r) for r in spec.acceptance_seeds.rules]
    assert rules[0] == {"acceptance": "exact"}  # the reference
    assert {"acceptance": "pcg", "acceptance.group_size": 1} in rules  # exact in law: Δ must be ~ 0


def test_decode_counts_seed_0_is_the_sweeps_decode_seeds_differ_and_a_rerun_resumes(micro_world, tmp_path):
    """Seed s = 0 is the runner's own per-utterance seed (the sweep's decode); other seeds give other paths.
    The run dir resumes (nothing decoded twice) and refuses another configuration."""
    from ssd.evaluation.batch import decode_items
    from ssd.evaluation.items import build_test_list, prepare_item
    from ssd.evaluation.models import load_models
    from ssd.evaluation.settings import RunSettings

    overrides = [o for o in sweep_overrides(micro_world, n_utts=2, max_len=20)] + [
        "draft.checkpoint=null",
        "mos=none",
    ]
    cfg = compose("sweep", overrides)
    cfg.output_dir = str(tmp_path / "direct")  # what a Hydra run sets (the loggers write under it)
    run_dir = tmp_path / "exact"
    counts = decode_counts(cfg, run_dir, utterances=2, seeds=4, label="exact")
    assert len(counts) == 8 and set(counts["seed"]) == {0, 1, 2, 3}
    settings = RunSettings.from_config(cfg)
    models = load_models(settings)
    pair = next(build_test_list(settings.eval).itertuples(index=False))
    result, _, _ = decode_items(settings, models, [prepare_item(models, settings.seed, 0, pair, None, {})])
    first = counts[(counts["utt"] == pair.utt) & (counts["seed"] == 0)].iloc[0]
    assert (
        first["accepted"] == sum(result.rows[0]["accepted"]) and first["tokens"] == result.rows[0]["tokens"]
    )
    mine = counts[counts["utt"] == pair.utt]
    assert mine[["accepted", "tokens"]].drop_duplicates().shape[0] > 1
    lines = (run_dir / "utterances.jsonl").read_text()
    again = decode_counts(cfg, run_dir, utterances=2, seeds=4, label="exact")
    assert (run_dir / "utterances.jsonl").read_text() == lines  # resumed: nothing decoded again
    assert (
        again.sort_values(["utt", "seed"])
        .reset_index(drop=True)
        .equals(counts.sort_values(["utt", "seed"]).reset_index(drop=True))
    )
    with pytest.raises(ValueError, match="different configuration"):
        decode_counts(
            compose("sweep", [*overrides, "draft_len=2"]), run_dir, utterances=2, seeds=4, label="exact"
        )
