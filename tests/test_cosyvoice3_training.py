"""CosyVoice 3's layer-subset draft trains on small real-format files: the cosyvoice3_8layer recipe on a tiny
24-layer CosyVoice 3 dir and the micro token shards, in process and through `python train_draft.py`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ssd.drafters.layers import build_draft, load_draft
from ssd.models.cosyvoice3 import CosyVoice3LM
from ssd.training.module import SpeechLMTrainingModule
from ssd.training.schema import OptimConfig
from tests.fixtures_models import make_tiny_cosyvoice3_dir
from tests.test_train_cli import _run
from tests.test_training import _all_batches, _fit

DEEP = dict(
    num_hidden_layers=24, hidden_size=16, intermediate_size=16, num_attention_heads=2, num_key_value_heads=1
)
RECIPE_LAYERS = (0, 1, 18, 19, 20, 21, 22, 23)  # configs/draft/cosyvoice3_8layer.yaml (via ssd_8layer)


@pytest.fixture(scope="module")
def cosyvoice3_world(training_world, tmp_path_factory):
    """The micro shards (speech tokens < 61) with a 24-layer CosyVoice 3 of 61 codes + 200 special rows."""
    target = make_tiny_cosyvoice3_dir(tmp_path_factory.mktemp("cv3_training") / "target", **DEEP)
    return {"target": target, "shards": training_world["shards"]}


def test_the_8layer_draft_learns_the_micro_data(cosyvoice3_world):
    target = CosyVoice3LM.from_dir(cosyvoice3_world["target"])
    draft = build_draft(target, RECIPE_LAYERS, ["layers.0", "layers.1", "head"])
    trained = {k for k, p in draft.model.named_parameters() if p.requires_grad}
    assert trained == {
        k
        for k in dict(draft.model.named_parameters())
        if k.startswith(("backbone.layers.0.", "backbone.layers.1."))
    } | {"llm_decoder.weight"}  # CosyVoice 3's head has no bias
    module = SpeechLMTrainingModule(draft, target, optim=OptimConfig(lr=1e-2, warmup_steps=5), max_steps=40)
    batches = _all_batches(cosyvoice3_world)

    def mean_ce():
        with torch.no_grad():
            return float(np.mean([module.compute(b, with_teacher=False)["ce"].item() for b in batches]))

    before = mean_ce()
    _fit(module, cosyvoice3_world, steps=40)
    after = mean_ce()
    assert after < before - 0.5, (before, after)
    # the targets it learns end with CosyVoice 3's EOS (S+1), after the instruction-carrying prefix
    _, targets = target.training_logits(
        batches[0]["text_ids"],
        batches[0]["text_lens"],
        batches[0]["speech_tokens"],
        batches[0]["speech_lens"],
    )
    assert set(targets[targets >= target.speech_token_size].tolist()) == {target.eos_token}


def test_train_draft_cli_trains_the_cosyvoice3_draft(cosyvoice3_world, tmp_path):
    run_dir = tmp_path / "run"
    result = _run(
        [
            "target=cosyvoice3",
            f"target.model.model_dir={cosyvoice3_world['target']}",
            "draft=cosyvoice3_8layer",
            f"data.shard_dirs={cosyvoice3_world['shards']}",
            "data.max_tokens=200",
            "max_steps=6",
            "val_every_steps=3",
            "logger=csv",
            f"hydra.run.dir={run_dir}",
        ],
        tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout + result.stderr
    assert "draft dev alpha (sum min(p,q), softmax):" in out and "(before training:" in out
    assert "CosyVoice3LM draft" in out  # describe(draft)
    draft = load_draft(run_dir / "draft.pt", CosyVoice3LM.from_dir(cosyvoice3_world["target"]))
    assert draft.recipe.layers == RECIPE_LAYERS and draft.recipe.trainable == ("layers.0", "layers.1", "head")
