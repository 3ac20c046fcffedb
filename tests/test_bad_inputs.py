"""Faults a user meets, each with the behaviour they rely on: the error names the key or file and the fix,
nothing is lost, nothing is counted twice, and a diverged or mixed-up run never looks like a result.

Config faults fail before any model loads; file faults name the file; run-dir faults (duplicates, kills,
swapped models, concurrent writers) keep n equal to the test list; training faults exit non-zero and
export nothing; the toy-world builder deletes only what it made.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import soundfile as sf
import torch
from hydra.errors import ConfigCompositionException
from omegaconf import open_dict

from ssd.config import compose
from ssd.evaluation import models as models_module
from ssd.evaluation.run_dir import CONFIG_FILE, METRICS_FILE, QUARANTINE_FILE, RESULTS_FILE, read_records
from ssd.evaluation.runner import evaluate
from ssd.files import RunDirLock, write_atomic
from tests.fixtures_eval import REPO, compose_sweep_config, sweep_overrides, write_micro_config
from tests.test_training import compose_train_config

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}


def _cfg(world, *extra: str, n_utts: int = 3, max_len: int = 15):
    return compose_sweep_config([*sweep_overrides(world, n_utts, max_len), "logger=none", *extra])


@pytest.fixture
def nothing_loaded():
    """The models loaded by earlier tests are dropped; a fail-fast check leaves the cache empty."""
    models_module._LOADED.clear()
    yield
    assert not models_module._LOADED, "a model was loaded before the configuration error was found"


# --- configuration: at compose time, or before any model loads ------------------------------------


@pytest.mark.parametrize(
    "override, key",
    [
        ("draft_len=abc", "draft_len"),
        ("eval.n_uts=3", "n_uts"),
        ("eval.max_len=x", "max_len"),
        ("seed=1.5", "seed"),
    ],
)
def test_a_typo_or_a_wrong_type_fails_when_the_config_is_composed(override, key):
    with pytest.raises(ConfigCompositionException, match=key):
        compose("sweep", [override])


@pytest.mark.parametrize(
    "overrides, message",
    [
        ("draft_len=0", "draft_len=0 must be >= 1"),
        ("eval.max_len=0", "eval.max_len=0 must be >= 1 or null"),
        ("eval.max_len=-5", "eval.max_len=-5 must be >= 1 or null"),
        (
            "decoding.adaptive.enabled=true decoding.adaptive.min_len=6 decoding.adaptive.max_len=2",
            r"min_len \(6\) <= start \(3\) <= max_len \(2\)",
        ),
        ("decoding.adaptive.enabled=true decoding.adaptive.min_len=x", "min_len='x' must be an integer"),
        ("beta=-1", "beta=-1.0 must be >= 0"),
        ("theta=1.2", r"theta=1.2 must lie in \(-1, 1\)"),
        ("eval.prompt_sec=[4.0,1.0]", r"eval.prompt_sec=\[4.0, 1.0\] must be \[min, max\]"),
    ],
)
def test_an_out_of_range_value_is_named_before_any_model_loads(
    micro_world, tmp_path, nothing_loaded, overrides, message
):
    with pytest.raises(ValueError, match=message):
        evaluate(_cfg(micro_world, *overrides.split()), tmp_path / "run")
    assert not (tmp_path / "run" / RESULTS_FILE).exists()


def test_a_rule_key_its_class_does_not_take_is_named(micro_world, tmp_path, nothing_loaded):
    cfg = _cfg(micro_world)
    with open_dict(cfg):
        cfg.acceptance.betta = 0.3  # a typo in a user's acceptance YAML
    with pytest.raises(
        ValueError,
        match=r"config acceptance: unknown key\(s\) \['betta'\].*valid keys: \['beta', 'audit_groups'\]",
    ):
        evaluate(cfg, tmp_path / "run")


def test_a_rule_class_that_does_not_exist_is_named_before_any_model_loads(
    micro_world, tmp_path, nothing_loaded
):
    with pytest.raises(Exception, match="my_rules.Missing"):
        evaluate(_cfg(micro_world, "acceptance._target_=my_rules.Missing"), tmp_path / "run")


def test_a_missing_baseline_is_named_before_decoding(micro_world, tmp_path, nothing_loaded):
    with pytest.raises(
        FileNotFoundError, match=r"baseline_dir=.*no_ar has no metrics.json: run the baseline first"
    ):
        evaluate(_cfg(micro_world, f"baseline_dir={tmp_path / 'no_ar'}"), tmp_path / "run")


# --- files: each error names the file --------------------------------------------------------------


def _copy_target(micro_world, tmp_path):
    target = tmp_path / "target"
    shutil.copytree(micro_world.data_dir / "toy" / "target", target)
    return target


def test_a_truncated_checkpoint_names_the_file(micro_world, tmp_path):
    target = _copy_target(micro_world, tmp_path)
    data = (target / "llm.pt").read_bytes()
    (target / "llm.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(
        ValueError, match=r"llm.pt \(\d+ bytes\) is not a readable CosyVoice 2 llm.pt.*copied completely"
    ):
        evaluate(_cfg(micro_world, f"target.model.model_dir={target}"), tmp_path / "run")


def test_a_checkpoint_with_a_wrong_key_layout_names_the_keys(micro_world, tmp_path):
    target = _copy_target(micro_world, tmp_path)
    state = torch.load(target / "llm.pt", weights_only=True)
    state["llm.decoder.weight"] = state.pop("llm_decoder.weight")  # an export with another prefix
    torch.save(state, target / "llm.pt")
    with pytest.raises(
        ValueError,
        match=r"llm.pt does not match its config: missing keys: llm_decoder.weight; unexpected keys: llm.decoder.weight",
    ):
        evaluate(_cfg(micro_world, f"target.model.model_dir={target}"), tmp_path / "run")


def test_a_file_that_is_not_a_draft_checkpoint_is_named(micro_world, tmp_path):
    bogus = tmp_path / "draft.pt"
    torch.save({"weights": torch.zeros(2)}, bogus)
    with pytest.raises(Exception, match=r"draft.pt is not an ssd draft checkpoint \(format ssd-draft-v1\)"):
        evaluate(_cfg(micro_world, f"draft.checkpoint={bogus}"), tmp_path / "run")


def test_a_missing_speech_tokenizer_names_the_key(micro_world, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"speech_tokenizer.path=.*no_codec"):
        evaluate(_cfg(micro_world, f"speech_tokenizer.path={tmp_path / 'no_codec'}"), tmp_path / "run")


def _corpus_with_a_bad_prompt(micro_world, tmp_path, damage):
    """A copy of the micro corpus whose every test-clean wav is damaged by `damage(path)`."""
    corpus = tmp_path / "corpus"
    shutil.copytree(micro_world.data_dir / "toy" / "corpus", corpus)
    for wav in sorted((corpus / "test-clean").rglob("*.wav")):
        damage(wav)
    return corpus


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda p: sf.write(p, np.zeros(16000, np.float32), 16000), "silent"),
        (
            lambda p: sf.write(p, np.full(16000, np.nan, np.float32), 16000, subtype="FLOAT"),
            "NaN or inf samples",
        ),
    ],
    ids=["silent", "nan"],
)
def test_an_unusable_prompt_wav_is_named_and_nothing_is_lost(micro_world, tmp_path, damage, message):
    corpus = _corpus_with_a_bad_prompt(micro_world, tmp_path, damage)
    with pytest.raises(
        ValueError,
        match=rf"prompt audio .*\.wav \(utterance .*\) cannot be used: .*{message}.*a rerun resumes",
    ):
        evaluate(_cfg(micro_world, f"eval.corpus_root={corpus}"), tmp_path / "run")


def test_a_corrupt_wav_in_the_corpus_is_named(micro_world, tmp_path):
    corpus = _corpus_with_a_bad_prompt(
        micro_world, tmp_path, lambda p: p.write_bytes(b"RIFF not really a wav")
    )
    with pytest.raises(ValueError, match=r"\.wav"):
        evaluate(_cfg(micro_world, f"eval.corpus_root={corpus}"), tmp_path / "run")


def test_an_empty_transcript_is_named(micro_world, tmp_path):
    corpus = tmp_path / "corpus"
    shutil.copytree(micro_world.data_dir / "toy" / "corpus", corpus)
    transcript = sorted((corpus / "test-clean").rglob("*.normalized.txt"))[0]
    transcript.write_text("")
    with pytest.raises(ValueError, match=rf"{transcript.name}: transcript is empty"):
        evaluate(_cfg(micro_world, f"eval.corpus_root={corpus}"), tmp_path / "run")


def test_a_draft_of_another_vocabulary_is_refused_at_load(micro_world, tmp_path):
    from ssd.models.checkpoints import write_cosyvoice2_dir
    from tests.fixtures_eval import TINY_TARGET

    other = write_cosyvoice2_dir(tmp_path / "other", TINY_TARGET, micro_world.codebook + 5,
                                 micro_world.data_dir / "words", seed=1)  # fmt: skip
    models = _models(micro_world)
    from ssd.drafters.layers import build_draft
    from ssd.models.cosyvoice2 import CosyVoice2LM

    draft = build_draft(CosyVoice2LM.from_dir(other), [0])
    from ssd.decoding.generate import Request, decode_speculative

    prompt = models.target.make_prompt(["set red"])
    with pytest.raises(ValueError, match=r"different vocabularies \(\d+ vs \d+ head entries\)"):
        decode_speculative(models.target, draft, Request(prompt, 5), models.sampling, _exact(), 2)


def _exact():
    from ssd.decoding.acceptance import ExactRule

    return ExactRule()


def _models(micro_world):
    from ssd.evaluation.models import load_models
    from ssd.evaluation.settings import RunSettings

    return load_models(RunSettings.from_config(_cfg(micro_world, "decoding=ar")))


@pytest.mark.parametrize("broken", ["target", "draft"])
def test_non_finite_logits_name_the_model_and_the_step(micro_world, broken):
    from ssd.decoding.generate import Request, decode_speculative

    models = _models(micro_world)
    from ssd.drafters.layers import build_draft

    target = models.target
    draft = build_draft(target, [0], trainable=["head"])
    with torch.no_grad():
        model = draft.model if broken == "draft" else target
        saved = model.llm_decoder.bias.clone()
        model.llm_decoder.bias.fill_(float("nan"))
    try:
        prompt = target.make_prompt(["set red"])
        with pytest.raises(
            FloatingPointError, match=rf"the {broken}'s logits are NaN/inf at generated token \d+"
        ):
            decode_speculative(target, draft, Request(prompt, 8), models.sampling, _exact(), 2)
    finally:
        with torch.no_grad():
            model.llm_decoder.bias.copy_(saved)


# --- the run dir: nothing lost, nothing counted twice, no two models in one table ---------------------


def test_a_broken_line_in_the_middle_keeps_every_complete_record(tmp_path):
    path = tmp_path / RESULTS_FILE
    lines = [
        json.dumps({"utt": "a"}),
        '{"utt": "b", "wer": 0.',
        json.dumps({"utt": "c"}),
        "[1, 2]",
        json.dumps({"utt": "d"}),
    ]
    path.write_text("\n".join(lines) + "\n")
    assert [r["utt"] for r in read_records(path)] == ["a", "c", "d"]
    quarantined = [json.loads(line) for line in (tmp_path / QUARANTINE_FILE).read_text().splitlines()]
    assert [q["line"] for q in quarantined] == [2, 4] and quarantined[0]["text"] == lines[1]
    assert [r["utt"] for r in read_records(path)] == ["a", "c", "d"]  # the repaired file reads the same


def test_duplicate_records_are_counted_once(micro_world, tmp_path):
    run_dir = tmp_path / "run"
    evaluate(_cfg(micro_world), run_dir)
    records = (run_dir / RESULTS_FILE).read_text().splitlines()
    (run_dir / RESULTS_FILE).write_text(
        "\n".join(records + records[:2]) + "\n"
    )  # e.g. two writers before locks
    metrics = evaluate(_cfg(micro_world), run_dir)
    assert metrics["num_utterances"] == 3 == len(read_records(run_dir / RESULTS_FILE))
    assert len((run_dir / QUARANTINE_FILE).read_text().splitlines()) == 2


def test_a_second_writer_of_a_run_dir_fails_at_once_and_names_the_first(
    micro_world, tmp_path, nothing_loaded
):
    run_dir = tmp_path / "run"
    with RunDirLock(run_dir, "evaluation run"):
        with pytest.raises(RuntimeError, match=rf"{run_dir} is in use by pid {os.getpid()}"):
            evaluate(_cfg(micro_world), run_dir)
    assert not (run_dir / RESULTS_FILE).exists()


def test_resume_refuses_a_replaced_model_file(micro_world, tmp_path):
    target = _copy_target(micro_world, tmp_path)
    run_dir = tmp_path / "run"
    evaluate(_cfg(micro_world, f"target.model.model_dir={target}"), run_dir)
    first = (run_dir / RESULTS_FILE).read_text().splitlines()[0]
    (run_dir / RESULTS_FILE).write_text(first + "\n")  # as if killed after one utterance
    state = torch.load(target / "llm.pt", weights_only=True)
    state["llm_decoder.bias"] += 1.0  # another model at the same path
    torch.save(state, target / "llm.pt")
    before = (run_dir / RESULTS_FILE).read_bytes()
    with pytest.raises(
        ValueError, match=r"computed with other model files: target.model.model_dir \(llm.pt changed\)"
    ):
        evaluate(_cfg(micro_world, f"target.model.model_dir={target}"), run_dir)
    assert (run_dir / RESULTS_FILE).read_bytes() == before


def test_an_atomic_write_that_fails_leaves_the_old_file_whole(tmp_path, monkeypatch):
    path = tmp_path / CONFIG_FILE
    write_atomic(path, "old: 1\n")

    def killed(fd):
        raise KeyboardInterrupt  # the process dies mid-write

    monkeypatch.setattr(os, "fsync", killed)
    with pytest.raises(KeyboardInterrupt):
        write_atomic(path, "new: 2\n" * 1000)
    assert path.read_text() == "old: 1\n" and [p.name for p in tmp_path.iterdir()] == [CONFIG_FILE]


def test_two_sweeps_into_one_dir_at_once_never_double_records(micro_world, tmp_path):
    """Two `python sweep.py` processes into one run dir: one runs, the other is refused naming the first;
    rerunning completes the list with n equal to the test list."""
    config_dir = write_micro_config(micro_world, tmp_path / "conf", n_utts=4, max_len=20)
    run_dir = tmp_path / "run"
    cmd = [sys.executable, str(REPO / "sweep.py"), "--config-dir", str(config_dir), "--config-name", "micro_sweep",
           "logger=none", "progress=false", f"hydra.run.dir={run_dir}"]  # fmt: skip
    procs = [subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]  # fmt: skip
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes[0] == 0, outputs
    if codes[1] != 0:  # the usual case: they overlapped
        assert any("is in use by pid" in out for out in outputs), outputs
    utts = [r["utt"] for r in read_records(run_dir / RESULTS_FILE)]
    assert len(utts) == len(set(utts)) == 4
    assert json.loads((run_dir / METRICS_FILE).read_text())["num_utterances"] == 4


# --- training ------------------------------------------------------------------------------------------


def test_a_diverging_training_stops_and_exports_nothing(training_world, tmp_path):
    from ssd.training.train import train

    run = tmp_path / "run"
    with pytest.raises(FloatingPointError, match=r"training diverged: loss nan at step \d+.*lower optim.lr"):
        train(compose_train_config(training_world, run, "max_steps=20", "val_every_steps=5", "optim.lr=1e6",
                                   "optim.warmup_steps=0"))  # fmt: skip
    assert not (run / "draft.pt").exists() and not (run / "checkpoints" / "draft-best.pt").exists()
    assert not (run / "metrics.json").exists()


def test_a_nan_model_is_never_exported(training_world, tmp_path):
    from ssd.drafters.layers import build_draft
    from ssd.models.cosyvoice2 import CosyVoice2LM
    from ssd.training.train import export_model

    draft = build_draft(CosyVoice2LM.from_dir(training_world["target"]), [0, -1], ["head"])
    with torch.no_grad():
        draft.model.llm_decoder.bias[0] = float("nan")
    with pytest.raises(
        FloatingPointError, match=r"not exporting .*draft.pt: trained tensors \['model.llm_decoder.bias'\]"
    ):
        export_model(draft, tmp_path / "draft.pt", draft=True)
    assert not (tmp_path / "draft.pt").exists()


def test_resuming_a_training_with_another_draft_recipe_is_refused(training_world, tmp_path):
    from ssd.training.train import train

    run = tmp_path / "run"
    train(
        compose_train_config(training_world, run, "max_steps=4", "val_every_steps=2", "draft.layers=[0,1,-1]")
    )
    with pytest.raises(ValueError, match=r"holds a training of another model \(draft_recipe:"):
        train(
            compose_train_config(
                training_world, run, "max_steps=6", "val_every_steps=2", "draft.layers=[0,-1]"
            )
        )


def test_resuming_a_training_against_a_replaced_target_is_refused(training_world, tmp_path):
    from ssd.training.train import train

    target = tmp_path / "target"
    shutil.copytree(training_world["target"], target)
    world = {**training_world, "target": target}
    run = tmp_path / "run"
    train(compose_train_config(world, run, "max_steps=4", "val_every_steps=2"))
    state = torch.load(target / "llm.pt", weights_only=True)
    state["llm_decoder.bias"] += 1.0
    torch.save(state, target / "llm.pt")
    with pytest.raises(ValueError, match=r"target model files changed: target \(llm.pt changed\)"):
        train(compose_train_config(world, run, "max_steps=6", "val_every_steps=2"))


def test_two_trainings_into_one_dir_are_refused(training_world, tmp_path):
    from ssd.training.train import train

    run = tmp_path / "run"
    with RunDirLock(run, "training run"):
        with pytest.raises(RuntimeError, match=rf"{run} is in use by pid {os.getpid()}"):
            train(compose_train_config(training_world, run, "max_steps=2"))


# --- the toy world builder ----------------------------------------------------------------------------


def test_the_builder_refuses_a_dir_it_did_not_make_and_deletes_nothing(tmp_path):
    from ssd.toy_world import STAGES, build_toy_world

    mine = tmp_path / "toy" / "corpus"
    mine.mkdir(parents=True)
    (mine / "my_notes.txt").write_text("a user's own file")
    world = compose("build_toy_world", ["toy_world=micro", f"paths.data_dir={tmp_path}"]).toy_world
    with pytest.raises(
        FileExistsError, match=r"corpus exists but was not made by the toy-world builder.*nothing was deleted"
    ):
        build_toy_world(world, tmp_path / "toy", progress=False, stages=STAGES[:1])
    assert (mine / "my_notes.txt").read_text() == "a user's own file"


def test_the_sweep_builds_a_missing_toy_world_first_and_says_so(tmp_path, capsys):
    from ssd.toy_world import ensure_built

    cfg = compose("sweep", ["toy_world=micro", f"paths.data_dir={tmp_path}"])
    ensure_built(cfg, progress=False)
    said = capsys.readouterr().out
    assert "The toy world 'micro' is not built yet" in said and "about 0.3 min" in said
    assert (tmp_path / "toy_micro" / "summary" / "DONE.json").is_file()
    ensure_built(cfg, progress=False)  # built: nothing to do, nothing said
    assert "not built yet" not in capsys.readouterr().out


def test_a_corrupt_token_shard_names_the_file_and_the_fix(training_world, tmp_path):
    from ssd.training.data import TokenShardDataModule

    shards = tmp_path / "shards"
    shutil.copytree(training_world["shards"], shards)
    broken = sorted(shards.glob("shard-*.parquet"))[0]
    broken.write_bytes(broken.read_bytes()[:100])  # a copy that stopped half-way
    module = TokenShardDataModule(shards, max_tokens=200, dev_subsets=["dev-clean"])
    with pytest.raises(
        ValueError, match=rf"shard .*{broken.name} is not a readable parquet file.*prepare_libritts.py tokens"
    ):
        module.setup()


def test_a_truncated_toy_codec_names_the_file(micro_world, tmp_path):
    from ssd.toy_world.codec import ToyCodec

    codec = tmp_path / "codec"
    shutil.copytree(micro_world.data_dir / "toy" / "codec", codec)
    (codec / "decoder.pt").write_bytes((codec / "decoder.pt").read_bytes()[:64])
    with pytest.raises(ValueError, match=r"decoder.pt \(64 bytes\) is not a readable toy codec decoder"):
        ToyCodec.load(codec)
