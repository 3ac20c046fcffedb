"""Every shipped config composes, and every `_target_` in it names a callable that takes its keys.

Composing sweep.yaml / train_draft.yaml with each option of each group goes through the typed schemas
(ssd/evaluation/schema.py, ssd/training/schema.py), so a typo'd key in any shipped YAML fails here.
The parts that need no files (acceptance rules, sampling laws) are also built.
"""

from __future__ import annotations

import pytest
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from ssd.config import compose
from ssd.config_files import group_options
from ssd.evaluation.schema import validate_sweep_config
from ssd.training.schema import check_target_kwargs, validate_train_config

SWEEP_GROUPS = ("target", "draft", "acceptance", "decoding", "eval", "speech_tokenizer", "vocoder", "asr", "sim",
                "mos", "logger", "experiment")  # fmt: skip
TRAIN_GROUPS = ("target", "draft", "data", "trainer", "logger")
# LLaSA's X-codec 2 tokenizer and vocoder are not shipped yet: a LLaSA sweep names its own and is told so.
# What the runner / trainer pass beside a node's own keys.
SUPPLIED = {"draft": ("target",), "asr": ("closed_vocabulary",), "sampling": ("stop_tokens",)}


def _targets(node, path=""):
    """(path, node) of every `_target_` node below `node`."""
    if isinstance(node, DictConfig):
        if "_target_" in node:
            yield path, node
        for key in node:
            if key != "hydra":
                yield from _targets(node._get_node(key), f"{path}.{key}" if path else str(key))


def _check_targets(cfg: DictConfig) -> int:
    checked = 0
    for path, node in _targets(cfg):
        check_target_kwargs(node, path, supplied=SUPPLIED.get(path.split(".")[-1], ()))
        checked += 1
    return checked


@pytest.mark.parametrize("group", SWEEP_GROUPS)
def test_every_sweep_option_composes_and_its_targets_take_their_keys(group, tmp_path):
    for option in group_options(group):
        cfg = compose("sweep", [f"{group}={option}", f"paths.data_dir={tmp_path}"])
        cfg.output_dir = str(tmp_path)  # Hydra's run dir, unset outside a run
        OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves
        assert _check_targets(cfg) >= 4, option  # the target, a rule or draft, the judges at least
        if (
            cfg.eval.language is None
        ):  # LibriTTS beside the toy target: its grammar judge needs the toy language
            with pytest.raises(
                ValueError, match=r"asr.vocabulary_mode=grammar needs the language's words.*null"
            ):
                validate_sweep_config(cfg)
            cfg.asr.vocabulary_mode = None
        validate_sweep_config(cfg)  # every target brings its codec and judges


@pytest.mark.parametrize("group", TRAIN_GROUPS)
def test_every_train_option_composes_and_validates(group, tmp_path):
    for option in group_options(group):
        cfg = compose(
            "train_draft", [f"{group}={option}", f"paths.data_dir={tmp_path}", f"output_dir={tmp_path}"]
        )
        validate_train_config(cfg)
        _check_targets(cfg)


def test_every_rule_and_sampling_law_builds():
    for option in group_options("acceptance"):
        rule = instantiate(compose("sweep", [f"acceptance={option}"]).acceptance)
        assert hasattr(rule, "verify") and isinstance(rule.labels(), dict)
    for option in group_options("target"):
        sampling = instantiate(compose("sweep", [f"target={option}"]).target.sampling, stop_tokens=[0])
        assert sampling.stop_tokens == (0,)


def test_the_target_brings_its_codec_and_judges_and_one_override_changes_each():
    real = compose("sweep", ["target=cosyvoice2", "target.model.model_dir=/models/cv2"])
    assert real.speech_tokenizer.path == "/models/cv2/speech_tokenizer_v2.onnx"
    assert real.vocoder._target_.endswith("CosyVoice2Vocoder") and real.vocoder.model_dir == "/models/cv2"
    assert (
        real.asr._target_.endswith("OpenAIWhisperASR") and real.sim.onnx_path == "/models/cv2/campplus.onnx"
    )
    toy = compose("sweep", [])
    assert toy.speech_tokenizer._target_.endswith("ToyCodec.load") and toy.asr.vocabulary_mode == "grammar"
    mixed = compose("sweep", ["target=cosyvoice2", "asr=whisper_base_toy", "sim=resemblyzer"])
    assert mixed.asr._target_.endswith("FasterWhisperASR") and mixed.sim._target_.endswith(
        "ResemblyzerSpeaker"
    )
    assert mixed.vocoder._target_.endswith("CosyVoice2Vocoder")


@pytest.mark.parametrize(
    "override, message",
    [
        (["draft_len=abc"], "draft_len"),
        (["eval.n_uts=3"], "n_uts"),
        (["eval.max_len=x"], "max_len"),
    ],
)
def test_typos_and_wrong_types_fail_when_the_config_is_composed(override, message):
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match=message):
        compose("sweep", override)
