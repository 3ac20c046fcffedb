"""The exactness study (`reproduce.study: exactness`): does beta = 0 reproduce the AR target?

After the experiment's AR and speculative beta = 0 sweeps it computes, in process:
  1. the paired (same utterance, same seed) bootstrap CIs of speculative - AR for WER and SIM;
  2. a chi-square homogeneity test on the joint law of the first generated tokens of one test prompt,
     decoded many times by AR and by each speculative arm (EXACTNESS_ARMS: beta = 0 must be accepted,
     beta = 0.4 and a verifier without RAS must be rejected);
  3. the exact per-step TV(output law, target law) per draft position as beta grows, and its figure.
Files: chi_square.{csv,md}, tv_drift.{csv,md}, paired_differences.csv, fig_tv_drift_vs_beta.png.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import torch
from omegaconf import DictConfig

from ssd.evaluation.metrics import chi_square_homogeneity, paired_differences, repeat_rate
from ssd.evaluation.run_dir import RESULTS_FILE, read_records
from ssd.evaluation.sweep_runs import load_runs
from ssd.evaluation.tables import to_markdown
from ssd.experiments import StudyResult
from ssd.files import save_figure, write_atomic

if TYPE_CHECKING:
    from ssd.experiments.driver import Experiment

TV_FIGURE = "fig_tv_drift_vs_beta.png"


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


def ar_decoder(target, sampling, tokens: int) -> Callable[[Any, torch.Generator], Any]:
    """decode(prompt, generator) -> the target's own AR decode of exactly `tokens` tokens."""
    from ssd.decoding.generate import Request, decode_ar

    def decode(prompt, generator):
        return decode_ar(target, Request(prompt, tokens, tokens, generator), sampling)

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
    from ssd.decoding.acceptance import ToleranceRule
    from ssd.decoding.generate import Request, decode_speculative

    reference = sample_early_tokens(
        ar_decoder(target, sampling, tokens), make_prompt, samples, batch, tokens, seed
    )
    rows = []
    for i, arm in enumerate(arms):
        beta = beta_broken if arm.beta > 0 else 0.0
        verifier_law = sampling if arm.ras_in_verifier else replace(sampling, ras_window=0)
        rule = ToleranceRule(beta=beta)

        def spec(prompt, generator, law=verifier_law, rule=rule):
            return decode_speculative(
                target, draft, Request(prompt, tokens, tokens, generator), law, rule, draft_len
            )

        drawn = sample_early_tokens(spec, make_prompt, samples, batch, tokens, seed + 1 + i)
        joint = chi_square_homogeneity(reference, drawn, min_cell)
        later = chi_square_homogeneity([s[1:] for s in reference], [s[1:] for s in drawn], min_cell)
        name = arm.name.replace("0.4", f"{beta:g}") if arm.beta > 0 else arm.name
        smaller_p = min(joint["p_value"], later["p_value"])  # equality must hold for both token ranges
        rows.append({
            "arm": name, "samples": samples, f"chi2 tokens 1-{tokens}": joint["statistic"],
            f"dof 1-{tokens}": joint["dof"], f"p tokens 1-{tokens}": joint["p_value"],
            f"chi2 tokens 2-{tokens}": later["statistic"], f"dof 2-{tokens}": later["dof"],
            f"p tokens 2-{tokens}": later["p_value"], "p smaller": smaller_p,
            "equal law accepted": bool(smaller_p >= alpha),
            "expected": "equal" if arm.expect_equal else "different",
        })  # fmt: skip
    return pd.DataFrame(rows)


def tv_drift(target, draft, sampling, prompt, min_len, max_len, betas, draft_len, seed=0) -> pd.DataFrame:
    """Mean per-step TV(output law of the tolerance rule, target law q) per draft position, per beta:
    exact (no sampling noise in the TV itself), along real speculative decodes of `prompt`."""
    from ssd.decoding.acceptance import ToleranceRule
    from ssd.decoding.generate import Request, decode_speculative
    from ssd.decoding.observe import Instruments

    rows = []
    for beta in betas:
        request = Request(prompt, max_len, min_len, torch.Generator().manual_seed(seed))
        with torch.inference_mode():
            result = decode_speculative(target, draft, request, sampling, ToleranceRule(beta=float(beta)), draft_len,
                                        Instruments(track_tv=True))  # fmt: skip
        stats = result.stats
        row = {"beta": float(beta), "mean TV": sum(stats.tv_sum) / max(1, sum(stats.proposed)),
               "acceptance": stats.acceptance_rate, "positions": sum(stats.proposed)}  # fmt: skip
        row.update({f"TV pos {i + 1}": v for i, v in enumerate(stats.tv_per_position)})
        rows.append(row)
    return pd.DataFrame(rows)


def _exactness_models(cfg: DictConfig):
    """The runner's models for the experiment's config (speculative: target, draft, sampling law, speech
    tokenizer) and every test item's (text, prompt text, prompt speech tokens)."""
    from ssd.audio.features import load_audio
    from ssd.config import compose
    from ssd.evaluation.items import build_test_list
    from ssd.evaluation.models import load_models
    from ssd.evaluation.settings import RunSettings

    cfg = copy.deepcopy(cfg)
    cfg.decoding = compose(
        "sweep", ["decoding=speculative"]
    ).decoding  # the study decodes with target and draft
    settings = RunSettings.from_config(cfg)
    models = load_models(settings)
    items = []
    for pair in build_test_list(settings.eval).itertuples(index=False):
        wav, sr = load_audio(pair.prompt_wav, None)
        items.append(
            (pair.text, pair.prompt_text, np.asarray(models.speech_tokenizer.encode(wav, sr)).tolist())
        )
    return models, items


def _chi_square(cfg: DictConfig, models, items) -> tuple[pd.DataFrame, int, list[float]]:
    """The chi-square table on the prompt (of the first candidates) whose AR decodes repeat a token most
    often: the negative control without RAS needs prompts where RAS acts to have any power. Returns the
    table, the chosen item and the repeat rate of each candidate."""
    chi, target = cfg.reproduce.chi_square, models.target

    def prompt_of(item):
        text, prompt_text, prompt_tokens = item
        prompt_tokens = prompt_tokens[: int(chi.prompt_speech_tokens)]
        return lambda rows: target.make_prompt([text] * rows, [prompt_text] * rows, [prompt_tokens] * rows)

    candidates = items[: max(1, int(chi.get("prompt_candidates", 1)))]
    probe = ar_decoder(target, models.sampling, int(chi.tokens))
    rates = [
        repeat_rate(sample_early_tokens(probe, prompt_of(item), int(chi.get("probe_samples", 1000)),
                                        int(chi.batch), int(chi.tokens), int(cfg.seed)))
        for item in candidates
    ] if len(candidates) > 1 else [float("nan")]  # fmt: skip
    chosen = int(np.nanargmax(rates)) if len(candidates) > 1 else 0
    table = exactness_chi_square(
        target, models.draft, models.sampling, prompt_of(candidates[chosen]), samples=int(chi.samples),
        batch=int(chi.batch), tokens=int(chi.tokens), draft_len=int(chi.draft_len), min_cell=int(chi.min_cell),
        alpha=float(chi.alpha), beta_broken=float(chi.beta_broken), seed=int(cfg.seed),
    )  # fmt: skip
    table["AR repeat rate (prompt probe)"] = rates[chosen]
    return table, chosen, rates


def _tv_drift(cfg: DictConfig, models, items) -> pd.DataFrame:
    """tv_drift on the first `reproduce.tv_drift.prompts` test items, decoded as one batch per beta."""
    drift, target = cfg.reproduce.tv_drift, models.target
    chosen = items[: int(drift.prompts)]
    prompt = target.make_prompt([i[0] for i in chosen], [i[1] for i in chosen], [i[2] for i in chosen])
    min_len, max_len = target.length_limits(prompt)
    if cfg.eval.get("max_len") is not None:
        max_len = max_len.clamp(max=int(cfg.eval.max_len))
        min_len = torch.minimum(min_len, max_len)
    return tv_drift(target, models.draft, models.sampling, prompt, min_len, max_len, list(drift.betas),
                    int(cfg.draft_len), int(cfg.seed))  # fmt: skip


def _paired(cfg: DictConfig, sweep_dir: Path, out_dir: Path) -> str:
    """Paired differences of the sweep's first AR and speculative runs (paired_differences.csv)."""
    runs = load_runs(sweep_dir)
    ok = runs[runs["status"] == "ok"]
    ar, spec = ok[ok["reference"].astype(bool)], ok[ok["acceptance"].notna()]
    if ar.empty or spec.empty:
        return "The AR and speculative runs are missing: no paired comparison.\n"
    paired = pd.DataFrame(paired_differences(
        read_records(sweep_dir / ar["run"].iloc[0] / RESULTS_FILE),
        read_records(sweep_dir / spec["run"].iloc[0] / RESULTS_FILE),
        int(cfg.eval.get("bootstrap_resamples", 1000)), int(cfg.seed),
    ))  # fmt: skip
    write_atomic(out_dir / "paired_differences.csv", paired.to_csv(index=False))
    return to_markdown(paired.map(lambda v: f"{v:.4f}" if isinstance(v, float) else v))


def run_exactness_study(experiment: Experiment) -> StudyResult:
    """The in-process parts of `exactness` (module docstring); one summary section."""
    cfg, out_dir = experiment.cfg, experiment.out_dir
    chi, drift = cfg.reproduce.chi_square, cfg.reproduce.tv_drift
    torch.set_num_threads(int(cfg.eval.get("num_threads") or 1))
    models, items = _exactness_models(cfg)

    chi_table, chosen_item, rates = _chi_square(cfg, models, items)
    write_atomic(out_dir / "chi_square.csv", chi_table.to_csv(index=False))
    shown_chi = chi_table.copy()
    for column in shown_chi.columns:
        if column.startswith("chi2"):
            shown_chi[column] = shown_chi[column].map(lambda v: f"{v:.1f}")
        elif column.startswith("p "):
            shown_chi[column] = shown_chi[column].map(lambda v: f"{v:.3g}")
    write_atomic(out_dir / "chi_square.md", to_markdown(shown_chi))

    drift_table = _tv_drift(cfg, models, items)
    write_atomic(out_dir / "tv_drift.csv", drift_table.to_csv(index=False))
    drift_md = to_markdown(drift_table.map(lambda v: f"{v:.4f}" if isinstance(v, float) else v))
    write_atomic(out_dir / "tv_drift.md", drift_md)
    _tv_figure(drift_table, out_dir / TV_FIGURE)

    paired_text = _paired(cfg, experiment.runs / "test", out_dir)
    verdicts = "".join(
        f"- {r['arm']}: equality {'accepted' if r['equal law accepted'] else 'rejected'} at the {chi.alpha} level "
        f"(smaller p {r['p smaller']:.3g}) "
        f"(expected: {r['expected']}){'' if r['equal law accepted'] == (r['expected'] == 'equal') else ' **UNEXPECTED**'}\n"
        for _, r in chi_table.iterrows()
    )  # fmt: skip
    prompts = min(len(items), int(drift.prompts))
    section = (
        "## beta = 0 vs AR on the same utterances and seeds (paired bootstrap)\n\n" + paired_text +
        f"\n## Chi-square on the first {chi.tokens} generated tokens ({chi.samples} decodes of one test "
        f"prompt per arm, L_d = {chi.draft_len}, cells under {chi.min_cell} counts pooled; token 1 comes from "
        "the target's prefill in both decoders, so tokens 2.. are tested alone too)\n\n"
        f"The prompt is test item {chosen_item} of the first {len(rates)}: the one whose AR decodes "
        "repeat a token most often (RAS acts only on a repeat, so only there can a verifier without RAS be "
        "told from the target); repeat rate per candidate: "
        + ", ".join(f"{r:.3f}" for r in rates) + ".\n\n"
        + to_markdown(shown_chi) + "\n" + verdicts +
        f"\n## Per-step TV(output law, target law) as beta grows ({prompts} test prompts, L_d = "
        f"{cfg.draft_len})\n\n" + drift_md
    )  # fmt: skip
    return StudyResult(sections=[section], figures=[TV_FIGURE])


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
    save_figure(fig, path)
    plt.close(fig)
