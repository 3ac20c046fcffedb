"""target=cosyvoice3 through the evaluation runner, unchanged: a tiny real-format CosyVoice 3 whose codes are
the micro toy world's codec, decoded at β = 0 with a layer-subset draft, vocoded and judged by the toy parts."""

from __future__ import annotations

import pytest

from ssd.evaluation import runner
from ssd.evaluation.models import load_models
from ssd.evaluation.run_dir import RESULTS_FILE, read_records
from ssd.evaluation.settings import RunSettings
from ssd.models.checkpoints import write_cosyvoice3_dir
from ssd.models.cosyvoice3 import CosyVoice3LM, CosyVoice3Prompt
from tests.fixtures_eval import TINY_TARGET, compose_sweep_config, sweep_overrides


@pytest.fixture(scope="module")
def cosyvoice3_overrides(micro_world, tmp_path_factory):
    model_dir = write_cosyvoice3_dir(
        tmp_path_factory.mktemp("cv3_eval") / "target", TINY_TARGET, micro_world.codebook,
        micro_world.data_dir / "words", seed=0,
    )  # fmt: skip
    return [
        *sweep_overrides(micro_world, n_utts=2, max_len=20),
        "target=cosyvoice3",
        f"target.model.model_dir={model_dir}",
        # the toy world's codec, vocoder and judges: they speak its codes
        "speech_tokenizer=toy", "vocoder=toy", "asr=toy", "sim=toy", "mos=none",
        "acceptance=exact", "logger=none",
    ]  # fmt: skip


def test_the_runner_takes_cosyvoice3s_stop_tokens_and_prompts(micro_world, cosyvoice3_overrides):
    models = load_models(RunSettings.from_config(compose_sweep_config(cosyvoice3_overrides)))
    target = models.target
    assert isinstance(target, CosyVoice3LM) and target.speech_token_size == micro_world.codebook
    s = micro_world.codebook
    assert models.sampling.stop_tokens == target.stop_tokens == tuple(range(s, s + 200))
    assert (models.sampling.ras_variant, models.sampling.eos_mode) == ("classic", "resample")
    prompt = target.make_prompt(["one"], ["two"], [[1, 2]])
    assert isinstance(prompt, CosyVoice3Prompt) and target.end_of_prompt_id in prompt.text_ids[0].tolist()


def test_sweep_decodes_cosyvoice3_end_to_end(micro_world, cosyvoice3_overrides, tmp_path):
    metrics = runner.evaluate(compose_sweep_config(cosyvoice3_overrides), tmp_path / "run")
    assert metrics["num_utterances"] == 2 and metrics["decoding"] == "speculative"
    assert 0 < metrics["acceptance_rate"] <= 1
    for record in read_records(tmp_path / "run" / RESULTS_FILE):
        assert record["finish_reason"] in ("stop", "max_len") and record["n_tokens"] <= 20
        assert all(0 <= t < micro_world.codebook for t in record["tokens"])  # codes only: stops excluded
        assert record["min_len"] >= 2  # 2 x the target text's tokens, the instruction not counted
