"""The paper-table experiments: every config composes into the grid its table needs, the driver writes a
results dir end to end on the micro world, and the exactness chi-square tells an exact engine from broken ones."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from ssd.config_files import group_options, merge_overrides, override_value
from ssd.evaluation.metrics import chi_square_homogeneity, repeat_rate
from ssd.experiments.driver import load_experiment
from ssd.experiments.exactness import exactness_chi_square
from tests.fixtures_eval import sweep_overrides

PAPER_EXPERIMENTS = {
    "table1_main",
    "table3_beta",
    "fig3_draft_len",
    "pcg_table1_main",
    "pcg_table2_swap",
    "pcg_table3_groups",
    "pcg_fig4_lookahead",
    "exactness",
    "draft_training",
}

TOLERANCE = "ssd.decoding.acceptance.ToleranceRule"


def _grid(cfg) -> dict[str, list[str]]:
    return {k: str(v).split(",") for k, v in cfg.hydra.sweeper.params.items()}


# --- configs ---------------------------------------------------------------------------------------


def test_every_paper_experiment_has_a_config():
    assert PAPER_EXPERIMENTS <= set(group_options("experiment"))


@pytest.mark.parametrize("name", sorted(PAPER_EXPERIMENTS))
def test_experiment_composes_with_the_sweep_config_and_documents_the_paper(name):
    cfg = load_experiment(name)
    assert cfg.reproduce.title and cfg.reproduce.paper, "each experiment quotes the paper's numbers"
    # Toy sizes: the test splits hold 200 (test) and 50 (dev) utterances; see experiments/README.md for the time.
    assert 5 <= cfg.eval.n_utts <= 100, "toy budget: make reproduce-toy must fit in about an hour"
    for grid in cfg.reproduce.get("extra_grids") or []:
        assert {key.split(".")[0] for key in grid} <= set(cfg) | {"acceptance", "decoding"}, grid


def test_table1_compares_ar_draft_alone_and_ssd_at_the_papers_setting():
    cfg = load_experiment("table1_main")
    assert _grid(cfg) == {"decoding": ["ar", "draft_only", "speculative"]}
    assert (cfg.acceptance._target_, cfg.acceptance.beta, cfg.decoding.draft_len) == (TOLERANCE, 0.4, 3)


def test_table3_sweeps_beta_at_draft_len_3_with_ar_and_a_dev_split():
    cfg = load_experiment("table3_beta")
    assert [float(b) for b in _grid(cfg)["beta"]] == [0, 0.1, 0.2, 0.3, 0.4]
    assert cfg.draft_len == 3 and cfg.reproduce.baseline
    assert "eval=toy_dev" in cfg.reproduce.dev  # beta chosen on held-out data


def test_fig3_sweeps_draft_len_1_to_6_at_beta_04():
    cfg = load_experiment("fig3_draft_len")
    assert [int(d) for d in _grid(cfg)["draft_len"]] == [1, 2, 3, 4, 5, 6]
    assert cfg.acceptance.beta == 0.4 and cfg.reproduce.baseline and cfg.reproduce.dev


def test_pcg_table1_sweeps_group_sizes_with_exact_ssd_the_papers_theta_and_a_dev_split():
    cfg = load_experiment("pcg_table1_main")
    grid = _grid(cfg)
    assert grid["acceptance"] == ["pcg"] and len(grid["acceptance.group_size"]) >= 3
    extra = [dict(g) for g in cfg.reproduce.extra_grids]
    assert {"acceptance": "exact"} in extra and {
        "acceptance": "pcg",
        "theta": 0.4,
    } in extra  # the paper's theta
    assert any(g["acceptance"] == "tolerance" and "0.4" in str(g["beta"]).split(",") for g in extra)
    assert "eval=toy_dev" in cfg.reproduce.dev and cfg.reproduce.match.by == "acceptance_rate"


def test_pcg_table2_swaps_ar_tokens_within_groups_with_a_random_group_control():
    cfg = load_experiment("pcg_table2_swap")
    assert cfg.decoding._target_.endswith("Autoregressive") and cfg.perturb._target_.endswith("GroupSwap")
    assert len(_grid(cfg)["perturb.groups.group_size"]) >= 3 and cfg.reproduce.baseline
    assert any(g.get("groups") == "random" for g in cfg.reproduce.extra_grids)


def test_pcg_table3_compares_group_sources_at_one_size_and_fig4_sweeps_lookahead_for_exact_and_pcg():
    groups = load_experiment("pcg_table3_groups")
    assert _grid(groups)["groups"] == ["embedding", "mel", "codec", "random"]
    assert groups.acceptance._target_.endswith("PCGRule") and groups.acceptance.source == groups.groups
    assert {"acceptance.group_size": 1} in [dict(g) for g in groups.reproduce.extra_grids]  # = exact SD
    fig4 = load_experiment("pcg_fig4_lookahead")
    assert [int(d) for d in _grid(fig4)["draft_len"]] == [1, 2, 3, 4, 5, 6]
    assert [dict(g) for g in fig4.reproduce.extra_grids] == [
        {"acceptance": "exact", "draft_len": "1,2,3,4,5,6"}
    ]


def test_table3_beta_audits_what_beta_admits():
    cfg = load_experiment("table3_beta")
    assert cfg.reproduce.study == "beta_audit" and cfg.acceptance.audit_groups._target_.endswith("PCGRule")


def test_beta_audit_table_splits_beta_only_from_ratio_kept_tokens():
    from ssd.experiments.beta_audit import audit_tokens, summarize_audit

    record = {"beta_audit": {"beta_only": [1.0, 0.0, 0.0, 1.0], "q": [0.01, 0.5, 0.3, 0.02],
                             "q_over_max": [0.02, 1.0, 0.6, 0.04], "is_argmax": [0.0, 1.0, 0.0, 0.0],
                             "in_argmax_group": [1.0, 1.0, 0.0, 0.0], "group_q_mass": [0.6, 0.7, 0.3, 0.1]}}  # fmt: skip
    beta_only, ratio = summarize_audit(audit_tokens([record, {"utt": "no audit"}]))
    assert beta_only["n"] == 2 and beta_only["% of kept draft tokens"] == 50
    assert beta_only["% in argmax's PCG group"] == 50 and beta_only["% with q(x)/max q < 0.1"] == 100
    assert ratio["% = argmax q"] == 50 and ratio["% P(y ~ q shares x's group)"] == pytest.approx(50)


def test_exactness_runs_ar_against_beta_0():
    cfg = load_experiment("exactness")
    assert _grid(cfg) == {"decoding": ["ar", "speculative"]}
    assert cfg.acceptance._target_ == TOLERANCE and cfg.acceptance.beta == 0
    assert cfg.reproduce.study == "exactness" and cfg.reproduce.chi_square.samples >= 10000


def test_draft_training_trains_the_papers_draft_kd_and_more_layers_and_evaluates_on_dev():
    cfg = load_experiment("draft_training")
    assert cfg.eval.split == "dev"
    variants = cfg.reproduce.train.variants
    paper = variants.paper_ce_2layers
    assert list(paper["draft.trainable"]) == ["layers.0", "layers.1", "head"] and paper.kd_weight == 0
    assert any(v.kd_weight > 0 for v in variants.values())
    assert max(len(v["draft.trainable"]) for v in variants.values()) > len(paper["draft.trainable"])


def test_drafters_long_trains_its_families_where_the_drafters_study_does_not():
    """Each longer-trained family has its own checkpoint file (so the 300-step study's drafters are neither
    reused nor overwritten), and the study's sweep loads that file."""
    from ssd.config import compose

    cfg = load_experiment("drafters_long")
    families = cfg.reproduce.drafters.train.families
    assert set(families) == {"eagle", "mtp"} and cfg.reproduce.drafters.train.common.max_steps > 300
    for name, settings in families.items():
        study_file = compose("sweep", [f"draft={name}"]).draft.checkpoint
        assert settings["draft.checkpoint"] != study_file
        swept = compose("sweep", ["experiment=drafters_long", f"draft={name}",
                                  f"draft.checkpoint={settings['draft.checkpoint']}"]).draft  # fmt: skip
        assert swept.checkpoint == settings["draft.checkpoint"] and swept.name == name


def test_unknown_experiment_names_the_choices():
    with pytest.raises(ValueError, match="table1_main"):
        load_experiment("table_9")


def test_override_helpers():
    assert override_value(["layers.0", "head"]) == "[layers.0,head]" and override_value(None) == "null"
    assert merge_overrides(["eval.n_utts=10", "eval=toy_dev"], ["eval.n_utts=2"]) == [
        "eval=toy_dev",
        "eval.n_utts=2",
    ]


# --- the chi-square ----------------------------------------------------------------------------------


def test_chi_square_pools_rare_cells_and_separates_laws():
    gen = torch.Generator().manual_seed(0)
    a = torch.multinomial(torch.tensor([0.5, 0.3, 0.2, 0.0001]), 4000, True, generator=gen).tolist()
    b = torch.multinomial(torch.tensor([0.5, 0.3, 0.2, 0.0001]), 4000, True, generator=gen).tolist()
    c = torch.multinomial(torch.tensor([0.4, 0.4, 0.2, 0.0001]), 4000, True, generator=gen).tolist()
    same, different = chi_square_homogeneity(a, b), chi_square_homogeneity(a, c)
    assert same["p_value"] > 0.001 and different["p_value"] < 1e-6
    assert same["cells"] <= 4


def test_exactness_chi_square_accepts_beta_0_and_rejects_beta_04_and_the_no_ras_verifier(tmp_path):
    """Statistical test, fixed seeds: 6000 decodes per arm of the first 3 tokens on a tiny random target
    with RAS; equality is rejected at p < 0.001."""
    from ssd.decoding.sampling import SamplingConfig
    from ssd.drafters.layers import build_draft
    from ssd.models.cosyvoice2 import CosyVoice2LM
    from tests.fixtures_models import TINY_SPEECH_TOKENS, make_tiny_cosyvoice2_dir

    torch.set_num_threads(1)
    target = CosyVoice2LM.from_dir(make_tiny_cosyvoice2_dir(tmp_path / "target"))
    draft = build_draft(target, [0])
    stops = (TINY_SPEECH_TOKENS, TINY_SPEECH_TOKENS + 1, TINY_SPEECH_TOKENS + 2)
    sampling = SamplingConfig(top_k=25, top_p=0.8, nucleus="cosyvoice", ras_window=10, stop_tokens=stops,
                              eos_mode="resample")  # fmt: skip

    def make_prompt(rows):
        return target.make_prompt(
            ["set blue at zero now"] * rows, ["bin red"] * rows, [[1, 2, 3, 1, 2]] * rows
        )

    table = exactness_chi_square(target, draft, sampling, make_prompt, samples=6000, batch=3000, alpha=0.001)
    accepted = dict(zip(table["arm"], table["equal law accepted"]))
    assert accepted == {
        "speculative beta = 0 (RAS law in the verifier)": True,
        "speculative beta = 0.4": False,
        "speculative beta = 0, verifier without RAS (plain top-k/top-p)": False,
    }


# --- the driver, end to end on the micro world ---------------------------------------------------------


def test_repeat_rate_counts_sequences_with_a_repeated_token():
    assert repeat_rate([(1, 2, 3), (1, 1, 2), (4, 5, 4), (7, 8, 9)]) == 0.5
    assert repeat_rate([]) == 0.0


@pytest.mark.slow
def test_reproduce_writes_tables_figures_and_provenance_then_resumes(micro_world, tmp_path):
    from ssd.experiments.driver import reproduce

    overrides = [
        o for o in sweep_overrides(micro_world, n_utts=2, max_len=20) if not o.startswith("eval.n_speakers")
    ]
    overrides += ["eval.n_speakers=1", "draft.checkpoint=null", "reproduce.chi_square.samples=600", "reproduce.chi_square.batch=600",
                  "reproduce.tv_drift.prompts=2", "reproduce.chi_square.probe_samples=200"]  # fmt: skip
    out = reproduce("exactness", tmp_path, overrides)
    for name in ("table.md", "table.csv", "table.tex", "summary.md", "command.txt", "git_commit.txt",
                 "machine.txt", "chi_square.csv", "tv_drift.csv", "paired_differences.csv",
                 "fig_tv_drift_vs_beta.png", "fig_alpha_per_position.png"):  # fmt: skip
        assert (out / name).is_file(), name
    assert {p.name for p in (out / "runs" / "test").iterdir() if p.is_dir()} == {
        "decoding=ar",
        "decoding=speculative",
    }
    rows = list(csv.DictReader((out / "table.csv").open()))
    assert sorted(r["decoding"] for r in rows) == ["ar", "speculative"]
    commands = (out / "command.txt").read_text()
    assert "sweep.py -m experiment=exactness" in commands and "paths.data_dir=" in commands
    assert "cores:" in (out / "machine.txt").read_text() and "torch:" in (out / "machine.txt").read_text()
    summary = (out / "summary.md").read_text()
    assert "6.34" in summary and "Chi-square" in summary and "paired" in summary
    assert "repeat rate per candidate" in summary  # the chi-square prompt is chosen where RAS can act
    chi = list(csv.DictReader((out / "chi_square.csv").open()))
    assert len(chi) == 3 and 0.0 <= float(chi[0]["AR repeat rate (prompt probe)"]) <= 1.0
    tv = list(csv.DictReader((out / "tv_drift.csv").open()))
    assert float(tv[0]["mean TV"]) < 1e-6 < float(tv[-1]["mean TV"])  # beta = 0 exact, beta = 0.4 drifts

    before = {p: p.read_bytes() for p in (out / "runs" / "test").rglob("utterances.jsonl")}
    reproduce("exactness", tmp_path, overrides)  # rerun: every utterance is already done
    assert {p: p.read_bytes() for p in before} == before
    assert "2 already done, 0 to go" in (out / "runs" / "logs" / "sweep.log").read_text()


def test_results_dir_layout_is_documented():
    readme = Path(__file__).resolve().parents[1] / "experiments" / "README.md"
    text = readme.read_text()
    for name in PAPER_EXPERIMENTS:
        assert f"results/{name}/summary.md" in text, name


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pcg_table2_swap", "table3_beta"])
def test_the_pcg_stress_test_and_the_beta_audit_write_their_tables(micro_world, tmp_path, name):
    from ssd.experiments.driver import reproduce

    overrides = [
        o for o in sweep_overrides(micro_world, n_utts=2, max_len=20) if not o.startswith("eval.n_speakers")
    ]
    overrides += ["eval.n_speakers=1", "draft.checkpoint=null"]
    if name == "table3_beta":
        overrides += ["hydra.sweeper.params.beta='0,0.4'", "reproduce.dev=['eval=toy_dev','eval.n_utts=2']"]
    out = reproduce(name, tmp_path, overrides)
    summary = (out / "summary.md").read_text()
    assert "Where and why this run differs from the paper" in summary
    rows = list(csv.DictReader((out / "table.csv").open()))
    if name == "pcg_table2_swap":
        swapped = [r for r in rows if r.get("swap_fraction")]
        assert len(swapped) == 6  # group sizes 2, 4, 8, 16 and the random control at 4 and 16
        assert all(0 < float(r["swap_fraction"]) <= 1 and r["wer_delta_vs_ar"] != "" for r in swapped)
        assert "91.4" in summary and "swapped %" in summary
    else:
        audit = list(csv.DictReader((out / "beta_audit.csv").open()))
        assert [r["tokens"] for r in audit] == ["kept only because of β", "kept by the exact ratio"]
        assert "β audit" in summary and (out / "fig_beta_audit_q_over_max.png").is_file()
