"""Every target/draft config composes, instantiates against a self-built tiny dir and decodes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import InstantiationException
from hydra.utils import instantiate

from ssd.drafters.layers import save_draft

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from ssd.contracts import SpeechLM  # noqa: E402

CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "configs")
torch.set_num_threads(1)


def compose_target_draft(target: str, draft: str, *overrides: str):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return compose(
            config_name=None,
            overrides=[
                f"+target={target}",
                f"+draft={draft}",
                "+paths=default",
                "+toy_world=default",
                *overrides,
            ],
        )


def decode_a_few_tokens(model: SpeechLM, prompt, steps: int = 3) -> torch.Tensor:
    cache, logits = model.prefill(prompt, steps)
    tokens = []
    for _ in range(steps):
        token = logits.argmax(-1, keepdim=True)
        tokens.append(token)
        logits = model.extend(cache, token)[:, -1]
    return torch.cat(tokens, dim=1)


def test_toy_target_and_draft_from_data_dir(tiny_cosyvoice2_dir, monkeypatch):
    data_dir = tiny_cosyvoice2_dir.parent
    (data_dir / "toy").mkdir(exist_ok=True)
    link = data_dir / "toy" / "target"
    if not link.exists():
        link.symlink_to(tiny_cosyvoice2_dir)
    monkeypatch.setenv("SSD_DATA_DIR", str(data_dir))
    cfg = compose_target_draft("toy", "toy")
    assert cfg.target.model.model_dir == str(link)
    target = instantiate(cfg.target.model)
    # The toy world writes the trained draft beside the target; the config loads it from there.
    assert cfg.draft.checkpoint == str(data_dir / "toy" / "draft" / "draft.pt")
    trained = instantiate(cfg.draft, target=target, checkpoint=None)
    with torch.no_grad():
        trained.model.llm_decoder.bias.add_(1.0)
    save_draft(data_dir / "toy" / "draft" / "draft.pt", trained)
    draft = instantiate(cfg.draft, target=target)
    assert draft.recipe.layers == (0, 1, 3) and draft.name == "toy"
    torch.testing.assert_close(draft.model.llm_decoder.bias, trained.model.llm_decoder.bias)
    prompt = target.make_prompt(["bin blue at zero now"], ["lay green"], [[1, 2]])
    assert decode_a_few_tokens(target, prompt).shape == (1, 3)
    assert decode_a_few_tokens(draft.model, prompt).shape == (1, 3)


def test_no_target_config_copies_the_models_stop_tokens():
    """The sampling law's stop tokens come from the loaded model (runner and trainer pass them)."""
    for name in ("cosyvoice2", "cosyvoice3", "llasa", "toy"):
        assert "stop_tokens" not in compose_target_draft(name, "toy").target.sampling


@pytest.mark.parametrize("draft_name", ["ssd_8layer", "pcg_3layer"])
def test_cosyvoice2_target_with_paper_drafts(tiny_cosyvoice2_dir, draft_name):
    cfg = compose_target_draft("cosyvoice2", draft_name, f"target.model.model_dir={tiny_cosyvoice2_dir}")
    target = instantiate(cfg.target.model)
    sampling = instantiate(cfg.target.sampling, stop_tokens=list(target.stop_tokens))
    s = target.speech_token_size
    assert sampling.stop_tokens == target.stop_tokens == (s, s + 1, s + 2)
    if draft_name == "ssd_8layer":  # the recipe names 24 target layers; the tiny target has 4
        with pytest.raises(InstantiationException, match=r"in \[0, 4\)"):
            instantiate(cfg.draft, target=target)
        return
    draft = instantiate(cfg.draft, target=target)
    assert draft.recipe.layers == (0, 1, 3)
    prompt = target.make_prompt(["set red"])
    assert decode_a_few_tokens(draft.model, prompt).shape == (1, 3)


def test_ssd_8layer_on_a_24_layer_target(tmp_path):
    from tests.fixtures_models import make_tiny_cosyvoice2_dir

    model_dir = make_tiny_cosyvoice2_dir(tmp_path / "deep", num_hidden_layers=24, hidden_size=16,
                                         intermediate_size=16, num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    cfg = compose_target_draft("cosyvoice2", "ssd_8layer", f"target.model.model_dir={model_dir}")
    target = instantiate(cfg.target.model)
    draft = instantiate(cfg.draft, target=target)
    assert draft.recipe.layers == (0, 1, 18, 19, 20, 21, 22, 23)
    trainable = {
        n.split(".")[0] + "." + n.split(".")[1] for n, p in draft.model.named_parameters() if p.requires_grad
    }
    assert trainable == {"backbone.layers", "llm_decoder.weight", "llm_decoder.bias"}
    assert decode_a_few_tokens(draft.model, target.make_prompt(["set red"])).shape == (1, 3)


def test_llasa_target(tiny_llasa_dir):
    cfg = compose_target_draft(
        "llasa", "pcg_3layer", f"target.model.model_dir={tiny_llasa_dir}", "target.speech_token_size=40"
    )
    target = instantiate(cfg.target.model)
    assert target.num_speech_tokens == 40
    draft = instantiate(cfg.draft, target=target)
    prompt = target.make_prompt(["bin blue"], ["lay green"], [[3, 4]])
    assert decode_a_few_tokens(draft.model, prompt).shape == (1, 3)


def test_sampling_configs_instantiate():
    for name in ("cosyvoice2", "cosyvoice3", "llasa", "toy"):
        cfg = compose_target_draft(name, "toy")
        sampling = instantiate(cfg.target.sampling, stop_tokens=[7, 8])
        assert sampling.stop_tokens == (7, 8)


@pytest.mark.parametrize("target", ["cosyvoice2", "cosyvoice3", "llasa"])
def test_unset_model_dir_says_what_to_set(target, monkeypatch):
    for env_var in ("COSYVOICE2_DIR", "COSYVOICE3_DIR", "LLASA_DIR"):
        monkeypatch.delenv(env_var, raising=False)
    cfg = compose_target_draft(target, "toy")
    with pytest.raises(InstantiationException, match="target.model.model_dir="):
        instantiate(cfg.target.model)
