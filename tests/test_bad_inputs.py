"""Faults a user meets, each with the behaviour they rely on: the error names the key or file and the fix,
nothing is lost, nothing is counted twice, and a diverged or mixed-up run never looks like a result.

Config faults fail before any model loads; file faults name the file; run-dir faults (duplicates, kills,
swapped models, concurrent writers) keep n equal to the test list; training faults exit non-zero and
export nothing; the toy-world builder deletes only what it made. A planted file never runs its code (the
marker never appears), a planted link is never written through (the outside file is untouched), a kill or
a full disk leaves the old file whole, one kind of run never writes into another's dir, and a typo, a
changed input or an unfinished job is named instead of giving another result.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import soundfile as sf
import torch
from hydra.errors import ConfigCompositionException
from omegaconf import open_dict

from ssd.config import compose
from ssd.evaluation import models as models_module
from ssd.evaluation.run_dir import (
    CONFIG_FILE,
    METRICS_FILE,
    QUARANTINE_FILE,
    RESULTS_FILE,
    TEST_LIST_FILE,
    read_records,
)
from ssd.evaluation.runner import evaluate
from ssd.files import LinkRefused, RunDirLock, write_atomic
from tests.fixtures_eval import REPO, compose_sweep_config, run_sweep, sweep_overrides, write_micro_config
from tests.test_training import _RunsCodeWhenUnpickled, compose_train_config

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
        ValueError, match=r"computed with other input files: target.model.model_dir \(llm.pt changed\)"
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


# --- nothing in a file runs code -----------------------------------------------------------------------

USER_TEXT = "a user's own file\n"


def _plant_link(link: Path, tmp_path: Path) -> Path:
    """`link` made a symbolic link to a user's file outside the run (returned; it holds USER_TEXT)."""
    outside = tmp_path / "outside" / link.name
    outside.parent.mkdir(parents=True, exist_ok=True)
    outside.write_text(USER_TEXT)
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(outside)
    return outside


def _plant_code(path: Path, marker: Path, payload: dict | None = None) -> Path:
    """`path` a torch file whose unpickling would create `marker` (beside the tensors of `payload`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({**(payload or {}), "payload": _RunsCodeWhenUnpickled(marker)}, path)
    return path


@pytest.mark.parametrize(
    "planted", ["draft.checkpoint", "target llm.pt", "codec decoder.pt", "codec codec.npz"]
)
def test_no_file_an_evaluation_reads_runs_its_code(micro_world, tmp_path, planted):
    marker = tmp_path / "code_ran"
    if planted == "draft.checkpoint":
        override, name = f"draft.checkpoint={_plant_code(tmp_path / 'draft.pt', marker)}", "draft.pt"
    elif planted == "target llm.pt":
        target = _copy_target(micro_world, tmp_path)
        _plant_code(target / "llm.pt", marker, torch.load(target / "llm.pt", weights_only=True))
        override, name = f"target.model.model_dir={target}", "llm.pt"
    else:
        codec = tmp_path / "codec"
        shutil.copytree(micro_world.toy / "codec", codec)
        if planted == "codec decoder.pt":
            _plant_code(codec / "decoder.pt", marker, torch.load(codec / "decoder.pt", weights_only=True))
        else:
            arrays = dict(np.load(codec / "codec.npz"))
            arrays["pca_mean"] = np.array([_RunsCodeWhenUnpickled(marker)], dtype=object)
            np.savez(codec / "codec.npz", **arrays)
        override, name = f"speech_tokenizer.path={codec}", planted.split()[1]
    with pytest.raises(
        Exception, match=rf"{name} (was not loaded: .* would run code|is not a readable .*Object arr)"
    ):
        evaluate(
            _cfg(micro_world, override, f"vocoder.codec_dir={micro_world.toy / 'codec'}"), tmp_path / "run"
        )
    assert not marker.exists()


def test_a_training_never_runs_the_code_of_a_ckpt_path_outside_its_run(training_world, tmp_path):
    from ssd.training.train import train

    marker = tmp_path / "code_ran"
    planted = _plant_code(tmp_path / "downloads" / "last.ckpt", marker, {"state_dict": {}})
    with pytest.raises(
        ValueError, match=r"not resuming: .*downloads/last.ckpt was not loaded: .*would run code"
    ):
        train(compose_train_config(training_world, tmp_path / "run", "max_steps=2", f"ckpt_path={planted}"))
    assert not marker.exists()


def test_a_truncated_last_ckpt_names_the_file_and_the_fix(training_world, tmp_path):
    from ssd.training.train import train

    run = tmp_path / "run"
    last = run / "checkpoints" / "last.ckpt"
    last.parent.mkdir(parents=True)
    torch.save({"state_dict": {"w": torch.zeros(1000)}}, last)
    last.write_bytes(last.read_bytes()[:1000])  # a rerun after a copy that stopped half-way
    with pytest.raises(
        ValueError,
        match=r"not resuming: .*last.ckpt \(1000 bytes\) is not a readable Lightning checkpoint.*delete it",
    ):
        train(compose_train_config(training_world, run, "max_steps=2"))


# --- nothing is written through a link -----------------------------------------------------------------


@pytest.mark.parametrize("entry", ["evaluation", "training", "toy world"])
def test_a_lock_linked_to_a_users_file_is_refused_and_the_file_stays_as_it_was(entry, request, tmp_path):
    run = tmp_path / "run"
    outside = _plant_link(run / ".lock", tmp_path)
    if entry == "evaluation":
        world = request.getfixturevalue("micro_world")
        start = lambda: evaluate(_cfg(world), run)  # noqa: E731
    elif entry == "training":
        from ssd.training.train import train

        world = request.getfixturevalue("training_world")
        start = lambda: train(compose_train_config(world, run, "max_steps=2"))  # noqa: E731
    else:
        from ssd.toy_world import STAGES, build_toy_world

        world = compose("build_toy_world", ["toy_world=micro", f"paths.data_dir={tmp_path}"]).toy_world
        start = lambda: build_toy_world(world, run, progress=False, stages=STAGES[:1])  # noqa: E731
    with pytest.raises(
        LinkRefused, match=rf"{re.escape(str(run / '.lock'))} is a symbolic link .*Remove the link"
    ):
        start()
    assert outside.read_text() == USER_TEXT


def test_a_run_writes_nothing_through_a_planted_temp_name_or_link(micro_world, tmp_path):
    run = tmp_path / "run"
    # The temp names an older ssd used: a run never writes there (its temp files are unique, made with O_EXCL).
    planted = [
        _plant_link(run / f".tmp.{name}", tmp_path) for name in (TEST_LIST_FILE, METRICS_FILE, CONFIG_FILE)
    ]
    evaluate(_cfg(micro_world), run)
    assert [p.read_text() for p in planted] == [USER_TEXT] * 3
    assert json.loads((run / METRICS_FILE).read_text())["num_utterances"] == 3
    # A finished run's metrics.json replaced by a link: the rerun refuses to write through it.
    (run / METRICS_FILE).unlink()
    outside = _plant_link(run / METRICS_FILE, tmp_path)
    with pytest.raises(LinkRefused, match=r"metrics.json is a symbolic link"):
        evaluate(_cfg(micro_world), run)
    assert outside.read_text() == USER_TEXT


# --- nothing is lost to a kill or a full disk ----------------------------------------------------------


def test_a_kill_while_saving_the_best_draft_leaves_the_old_one_whole(training_world, tmp_path, monkeypatch):
    from ssd.drafters.layers import build_draft
    from ssd.models.cosyvoice2 import CosyVoice2LM
    from ssd.training.train import export_model

    draft = build_draft(CosyVoice2LM.from_dir(training_world["target"]), [0, -1], ["head"])
    best = tmp_path / "checkpoints" / "draft-best.pt"
    export_model(draft, best, draft=True)  # what ExportCheckpoint writes at each better dev alpha
    before = best.read_bytes()

    def killed(obj, f, *args, **kwargs):
        f.write(before[:8192])  # the first bytes of the new file, then the process dies
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        export_model(draft, best, draft=True)
    assert best.read_bytes() == before and [p.name for p in best.parent.iterdir()] == [best.name]


@pytest.fixture
def finished_sweep(micro_world, tmp_path):
    """A sweep dir with an AR run and a speculative run of the micro world (3 utterances each)."""
    sweep = tmp_path / "sweep"
    evaluate(_cfg(micro_world, "decoding=ar"), sweep / "ar")
    evaluate(_cfg(micro_world), sweep / "speculative")
    return sweep


def test_make_tables_on_a_full_disk_leaves_the_old_tables_and_figures_whole(finished_sweep, monkeypatch):
    from ssd.evaluation.report import aggregate

    aggregate(finished_sweep)
    written = {
        p.name: p.read_bytes() for p in finished_sweep.iterdir() if p.is_file() and p.name != ".ssd_kind"
    }
    assert {"table.md", "table.tex", "table.csv"} <= set(written) and any(n.endswith(".png") for n in written)
    shutil.copytree(finished_sweep / "ar", finished_sweep / "again")  # the next table differs

    def disk_full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space left on device"):
        aggregate(finished_sweep)
    monkeypatch.undo()
    assert {name: (finished_sweep / name).read_bytes() for name in written} == written
    assert not [p.name for p in finished_sweep.iterdir() if p.name.endswith(".tmp")]


def test_tables_that_fail_to_render_leave_md_tex_and_csv_as_they_were(finished_sweep, monkeypatch):
    from ssd.evaluation.report import aggregate

    aggregate(finished_sweep, figures=False)
    before = {s: (finished_sweep / f"table.{s}").read_text() for s in ("md", "tex", "csv")}
    shutil.copytree(finished_sweep / "ar", finished_sweep / "again")

    def broken(*args, **kwargs):
        raise RuntimeError("LaTeX rendering failed")

    monkeypatch.setattr(pd.DataFrame, "to_latex", broken)
    with pytest.raises(RuntimeError, match="LaTeX rendering failed"):
        aggregate(finished_sweep, figures=False)
    assert {s: (finished_sweep / f"table.{s}").read_text() for s in ("md", "tex", "csv")} == before


# --- a run dir holds one kind of run -------------------------------------------------------------------


def test_an_evaluation_never_writes_into_a_training_dir_nor_a_training_into_an_evaluation(
    micro_world, training_world, finished_sweep
):
    from ssd.training.train import train

    evaluated = finished_sweep / "ar"
    trained = finished_sweep.parent / "trained"
    with RunDirLock(trained, "training run"):  # what a training holds while it runs
        write_atomic(trained / METRICS_FILE, '{"dev/alpha": 0.8}')
    before = {d: (d / METRICS_FILE).read_bytes() for d in (evaluated, trained)}
    with pytest.raises(
        FileExistsError, match=rf"{trained} is a training run dir .*an evaluation run must not"
    ):
        evaluate(_cfg(micro_world), trained)
    with pytest.raises(
        FileExistsError,
        match=rf"{re.escape(str(evaluated))} is an evaluation run dir .*a training run must not",
    ):
        train(compose_train_config(training_world, evaluated, "max_steps=2"))
    with pytest.raises(
        FileExistsError, match=rf"{micro_world.toy} is a toy world dir .*a training run must not"
    ):
        train(compose_train_config(training_world, micro_world.toy, "max_steps=2"))
    assert {d: (d / METRICS_FILE).read_bytes() for d in (evaluated, trained)} == before


def test_a_sweep_into_an_evaluation_run_dir_is_refused(finished_sweep):
    from ssd.evaluation.callbacks import AggregateOnMultirunEnd

    evaluated = finished_sweep / "ar"
    cfg = compose_sweep_config([f"hydra.sweep.dir={evaluated}"], with_hydra=True)
    with pytest.raises(
        SystemExit, match=rf"{re.escape(str(evaluated))} is an evaluation run dir .*a sweep must not"
    ):
        AggregateOnMultirunEnd().on_multirun_start(cfg)


# --- everything that determines a result is fingerprinted ------------------------------------------------


def _keep_first_record(run_dir: Path) -> bytes:
    """As if the run was killed after its first utterance; returns what utterances.jsonl then holds."""
    first = (run_dir / RESULTS_FILE).read_text().splitlines()[0]
    write_atomic(run_dir / RESULTS_FILE, first + "\n")
    return (run_dir / RESULTS_FILE).read_bytes()


def test_resume_refuses_a_replaced_draft_named_by_a_relative_path(micro_world, tmp_path, monkeypatch):
    from ssd.drafters.layers import build_draft, save_draft
    from ssd.models.cosyvoice2 import CosyVoice2LM

    draft = build_draft(CosyVoice2LM.from_dir(micro_world.toy / "target"), [0], ["layers", "head"])
    monkeypatch.chdir(tmp_path)
    save_draft("mydraft.pt", draft)
    run = tmp_path / "run"
    evaluate(_cfg(micro_world, "draft.checkpoint=mydraft.pt"), run)
    before = _keep_first_record(run)
    with torch.no_grad():
        draft.model.llm_decoder.bias += 1.0  # another draft under the same relative name
    save_draft("mydraft.pt", draft)
    with pytest.raises(ValueError, match=r"computed with other input files: draft.checkpoint \(.*changed\)"):
        evaluate(_cfg(micro_world, "draft.checkpoint=mydraft.pt"), run)
    assert (run / RESULTS_FILE).read_bytes() == before


def _corpus_copy(micro_world, tmp_path) -> Path:
    corpus = tmp_path / "corpus"
    shutil.copytree(micro_world.toy / "corpus", corpus)
    return corpus


def test_resume_refuses_a_test_list_whose_text_changed(micro_world, tmp_path):
    from ssd.data.libritts import load_table

    corpus = _corpus_copy(micro_world, tmp_path)
    run = tmp_path / "run"
    evaluate(_cfg(micro_world, f"eval.corpus_root={corpus}"), run)
    before = _keep_first_record(run)
    pairs = load_table(run / TEST_LIST_FILE)
    utt = pairs["utt"].iloc[1]
    edited = next(t for t in pairs["text"] if t != pairs["text"].iloc[1])  # words the target knows
    next(corpus.rglob(f"{utt}.normalized.txt")).write_text(edited + "\n")
    with pytest.raises(
        ValueError, match=rf"utterance {utt}: text '.*' then, '{edited}' now.*restore the corpus"
    ):
        evaluate(_cfg(micro_world, f"eval.corpus_root={corpus}"), run)
    assert (run / RESULTS_FILE).read_bytes() == before


def test_resume_refuses_a_prompt_wav_replaced_under_its_name(micro_world, tmp_path):
    from ssd.data.libritts import load_table

    corpus = _corpus_copy(micro_world, tmp_path)
    run = tmp_path / "run"
    evaluate(_cfg(micro_world, f"eval.corpus_root={corpus}"), run)
    before = _keep_first_record(run)
    prompt = Path(load_table(run / TEST_LIST_FILE)["prompt_wav"].iloc[0])
    wav, rate = sf.read(prompt)
    sf.write(prompt, wav[::-1].copy(), rate)  # same name, same length, other audio
    with pytest.raises(ValueError, match=r"utterance .*: prompt_audio .* then, .* now"):
        evaluate(_cfg(micro_world, f"eval.corpus_root={corpus}"), run)
    assert (run / RESULTS_FILE).read_bytes() == before


def test_a_multirun_over_a_path_key_gives_each_job_its_own_dir(micro_world, tmp_path):
    from ssd.drafters.layers import build_draft, save_draft
    from ssd.models.cosyvoice2 import CosyVoice2LM

    draft = build_draft(CosyVoice2LM.from_dir(micro_world.toy / "target"), [0], ["layers", "head"])
    save_draft(tmp_path / "a" / "draft.pt", draft)
    with torch.no_grad():
        draft.model.llm_decoder.bias += 1.0
    save_draft(tmp_path / "b" / "draft.pt", draft)
    config_dir = write_micro_config(micro_world, tmp_path / "conf", n_utts=2, max_len=10)
    sweep = tmp_path / "sweep"
    out = run_sweep(["--config-dir", str(config_dir), "--config-name", "micro_sweep", "-m", "logger=none",
                     f"draft.checkpoint={tmp_path / 'a' / 'draft.pt'},{tmp_path / 'b' / 'draft.pt'}",
                     f"hydra.sweep.dir={sweep}"])  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    jobs = sorted(p.parent for p in sweep.glob(f"*/{METRICS_FILE}"))
    assert len(jobs) == 2 and all(j.name.startswith("draft.checkpoint=") for j in jobs), jobs
    checkpoints = [json.loads((j / METRICS_FILE).read_text()) for j in jobs]
    assert all(m["num_utterances"] == 2 for m in checkpoints)
    table = pd.read_csv(sweep / "table.csv")
    assert set(table["status"]) == {"ok"} and {j.name for j in jobs} <= set(table["run"])


# --- composition refuses what does not exist ----------------------------------------------------------


@pytest.mark.parametrize(
    "override, message",
    [
        ("+drafr_len=5", r"Key 'drafr_len' not in 'SweepConfig'. Did you mean 'draft_len'\? .*without '\+'"),
        ("+eval.n_uts=3", r"Key 'n_uts' not in 'EvalConfig'. Did you mean 'eval.n_utts'\?"),
        ("asr=whispr", r"asr=whispr: no such option \(no configs/asr/whispr.yaml\); choose one of \[.*'toy'"),
    ],
)
def test_an_added_key_or_option_that_does_not_exist_is_named(micro_world, override, message, nothing_loaded):
    from ssd.evaluation.settings import RunSettings

    with pytest.raises(ValueError, match=message):
        RunSettings.from_config(_cfg(micro_world, override))


@pytest.mark.parametrize("name", ["nope", "table1_mian"])
def test_an_experiment_that_does_not_exist_is_named_with_the_valid_ones(name):
    with pytest.raises(Exception, match=rf"Could not find 'experiment/{name}'(.|\n)*table1_main"):
        compose("sweep", [f"experiment={name}"])


# --- tables say what they hold ------------------------------------------------------------------------


def test_make_tables_lists_running_killed_and_failed_jobs_under_the_table(finished_sweep):
    from ssd.evaluation.report import aggregate

    done = finished_sweep / "ar"
    killed, running, failed = (finished_sweep / name for name in ("killed", "running", "failed"))
    for copy in (killed, running):
        shutil.copytree(done, copy)
        (copy / METRICS_FILE).unlink()
    _keep_first_record(killed)
    failed.mkdir()
    write_atomic(failed / "error.json", json.dumps({"error": "ValueError: eval.n_utts=0 must be >= 1"}))
    with RunDirLock(running, "evaluation run"):
        table = aggregate(finished_sweep, figures=False)
    assert set(table["run"]) == {"ar", "speculative", "killed", "running", "failed"}
    md, tex = (finished_sweep / "table.md").read_text(), (finished_sweep / "table.tex").read_text()
    for text in (md, tex):
        assert f"- running: running now (pid {os.getpid()}" in text and "3 of 3 utterances" in text
        assert "- killed: stopped before its metrics (killed?): 1 of 3 utterances; rerun to resume" in text
        assert "- failed: ValueError: eval.n_utts=0 must be >= 1" in text


def test_an_oversubscribed_run_warns_and_says_so_in_its_metrics_and_table(micro_world, tmp_path, caplog):
    from ssd.evaluation.report import aggregate

    jobs = (os.cpu_count() or 1) + 1  # more jobs than cores, one thread each
    with caplog.at_level("WARNING"):
        metrics = evaluate(_cfg(micro_world, "decoding=ar"), tmp_path / "sweep" / "ar", parallel_jobs=jobs)
    assert metrics["oversubscribed"] and metrics["parallel_jobs"] == jobs
    assert "oversubscribed, speed columns unreliable" in caplog.text
    aggregate(tmp_path / "sweep", figures=False)
    assert (
        "Timed with more threads than cores (speed columns unreliable)"
        in (tmp_path / "sweep" / "table.md").read_text()
    )


def test_the_joblib_launcher_runs_only_as_many_jobs_as_the_cores_hold():
    from ssd.evaluation.baselines import parallel_jobs

    cores = os.cpu_count() or 1
    for threads, jobs in (("1", cores), ("null", 1), (str(cores + 1), 1)):
        cfg = compose("sweep", ["hydra/launcher=joblib", f"eval.num_threads={threads}"], with_hydra=True)
        assert cfg.hydra.launcher.n_jobs == jobs and parallel_jobs(cfg.hydra.launcher) == jobs


# --- the decoding API and text --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "stop, message",
    [
        ((), r"stop_tokens is empty"),
        ((7,), r"stop_tokens \[7\] lie outside the model's head of 5 entries"),
        ((-1,), r"stop_tokens \[-1\] lie outside"),
    ],  # fmt: skip
)
def test_the_decoding_api_refuses_stop_tokens_that_could_never_stop_a_row(stop, message):
    from engine_models import autoregressive, speculative, trigram_pair

    from ssd.decoding.acceptance import ExactRule
    from ssd.decoding.sampling import SamplingConfig

    target, draft = trigram_pair(5, seed=3)
    law, prompt = SamplingConfig(stop_tokens=stop), torch.tensor([[1, 3]])
    fix = r"SamplingConfig\(\.\.\., stop_tokens=target.stop_tokens\)"
    with pytest.raises(ValueError, match=rf"{message}.*{fix}"):
        autoregressive(target, prompt, law, 10)
    with pytest.raises(ValueError, match=rf"{message}.*{fix}"):
        speculative(target, draft, prompt, law, ExactRule(), 2, 10)


def test_a_word_the_target_does_not_know_is_named_not_read_as_unknown(micro_world, tmp_path):
    from omegaconf import OmegaConf

    from ssd.data.grid_language import GridLanguage

    language = GridLanguage(OmegaConf.load(REPO / "configs" / "toy_world" / "micro.yaml").corpus.language)
    assert language.normalize("Café, déjà-vu!") == ["café", "déjà", "vu"]
    corpus = _corpus_copy(micro_world, tmp_path)
    for transcript in (corpus / "test-clean").rglob("*.normalized.txt"):
        transcript.write_text("café " + transcript.read_text())
    with pytest.raises(
        ValueError, match=r"does not know the word\(s\) \['café'\] of utterance\(s\).*target="
    ):
        evaluate(_cfg(micro_world, f"eval.corpus_root={corpus}"), tmp_path / "run")


def test_a_transcript_with_no_speakable_word_is_refused(micro_world, tmp_path):
    from ssd.evaluation.wer import utterance_wer

    corpus = _corpus_copy(micro_world, tmp_path)
    transcript = sorted((corpus / "test-clean").rglob("*.normalized.txt"))[0]
    transcript.write_text("... !? —\n")
    with pytest.raises(ValueError, match=rf"{transcript.name}: transcript '... !\? —' has no speakable word"):
        evaluate(_cfg(micro_world, f"eval.corpus_root={corpus}"), tmp_path / "run")
    with pytest.raises(ValueError, match=r"reference '... !\? —' has no word after normalisation"):
        utterance_wer("... !? —", "set red")


def test_a_draft_made_from_another_target_says_what_differs(micro_world, tmp_path):
    from ssd.drafters.layers import build_draft, save_draft
    from ssd.models.checkpoints import write_cosyvoice2_dir
    from ssd.models.cosyvoice2 import CosyVoice2LM
    from tests.fixtures_eval import TINY_TARGET

    other = write_cosyvoice2_dir(tmp_path / "other", TINY_TARGET, micro_world.codebook,
                                 micro_world.data_dir / "words", seed=1)  # fmt: skip
    path = save_draft(tmp_path / "draft.pt", build_draft(CosyVoice2LM.from_dir(other), [0], ["head"]))
    with pytest.raises(
        ValueError, match=r"made from another target .*: same structure \(\w+\) but other weights"
    ):
        build_draft(CosyVoice2LM.from_dir(micro_world.toy / "target"), [0], ["head"], checkpoint=path)


@pytest.mark.parametrize("script", ["bench_decoding.py", "bench_backbone.py", "gpu_check.py"])
def test_a_benchmark_imports_the_checkout_it_is_run_from(script, tmp_path):
    installed = tmp_path / "site" / "ssd"  # another ssd ahead on the path, as an installed one would be
    installed.mkdir(parents=True)
    marker = tmp_path / "installed_ssd_imported"
    (installed / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    out = subprocess.run([sys.executable, str(REPO / "scripts" / script), "--help"], cwd=tmp_path,
                         env={**ENV, "PYTHONPATH": str(installed.parent)}, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert not marker.exists()


# --- more faults of the same families --------------------------------------------------------------------


def test_a_run_dir_that_is_a_link_is_refused(micro_world, tmp_path, nothing_loaded):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "run").symlink_to(elsewhere)
    with pytest.raises(LinkRefused, match=r"run is a symbolic link"):
        evaluate(_cfg(micro_world), tmp_path / "run")
    assert list(elsewhere.iterdir()) == []


@pytest.mark.parametrize("planted", ["audio", RESULTS_FILE])
def test_a_linked_audio_dir_or_records_file_is_never_written_through(micro_world, tmp_path, planted):
    run = tmp_path / "run"
    if planted == "audio":
        outside = tmp_path / "outside_dir"
        outside.mkdir()
        run.mkdir()
        (run / "audio").symlink_to(outside)
    else:
        outside = _plant_link(run / planted, tmp_path)
    with pytest.raises(LinkRefused, match=rf"{planted} is a symbolic link"):
        evaluate(_cfg(micro_world), run)
    assert (list(outside.iterdir()) == []) if outside.is_dir() else outside.read_text() == USER_TEXT


@pytest.mark.parametrize(
    "entry, bad", [("sweep.py", "eval.n_utts=0"), ("train_draft.py", "optim.schedule=nope")]
)
def test_hydras_own_files_are_never_written_through_a_link(entry, bad, tmp_path):
    """Hydra writes .hydra/*.yaml before any ssd code runs; a linked .hydra stops the run first."""
    run, outside = tmp_path / "run", tmp_path / "outside"
    outside.mkdir()
    run.mkdir()
    (run / ".hydra").symlink_to(outside)
    out = subprocess.run([sys.executable, str(REPO / entry), "toy_world=micro", f"paths.data_dir={tmp_path / 'data'}",
                          "logger=none", bad, f"hydra.run.dir={run}"], cwd=REPO, env=ENV, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert out.returncode != 0 and f"{run / '.hydra'} is a symbolic link" in out.stdout + out.stderr
    assert list(outside.iterdir()) == [] and not (tmp_path / "data").exists()
