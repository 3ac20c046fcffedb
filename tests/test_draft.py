"""Layer-inheritance drafts: exact copies, right flags, the interface, checkpoints bound to their target."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from ssd.contracts import Drafter, SpeechLM  # noqa: E402
from ssd.drafters.layers import Draft, build_draft, describe, load_draft, save_draft  # noqa: E402
from ssd.models.cosyvoice2 import CosyVoice2LM  # noqa: E402
from tests.fixtures_models import make_tiny_cosyvoice2_dir  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def target(tiny_cosyvoice2_dir):
    return CosyVoice2LM.from_dir(tiny_cosyvoice2_dir)


def test_frozen_tensors_equal_source_layers_and_flags_are_right(target):
    draft = build_draft(target, layers=[0, 3], trainable=["layers.0", "head"], share_embeddings=True)
    assert (
        isinstance(draft, Draft)
        and type(draft.model) is CosyVoice2LM
        and len(draft.model.backbone.layers) == 2
    )
    for j, i in enumerate([0, 3]):
        for (name, p), (_, q) in zip(
            draft.model.backbone.layers[j].named_parameters(), target.backbone.layers[i].named_parameters()
        ):
            assert torch.equal(p, q), name
            assert p.data_ptr() != q.data_ptr()  # layers are copies
            assert p.requires_grad == (j == 0)
    # frozen embeddings are the target's own tensors; the trainable head is a copy
    assert draft.model.speech_embedding.weight.data_ptr() == target.speech_embedding.weight.data_ptr()
    assert (
        draft.model.backbone.embed_tokens.weight.data_ptr() == target.backbone.embed_tokens.weight.data_ptr()
    )
    assert not draft.model.speech_embedding.weight.requires_grad
    assert draft.model.llm_decoder.weight.requires_grad and draft.model.llm_decoder.bias.requires_grad
    assert draft.model.llm_decoder.weight.data_ptr() != target.llm_decoder.weight.data_ptr()
    assert torch.equal(draft.model.llm_decoder.weight, target.llm_decoder.weight)
    copied = build_draft(target, layers=[1], trainable=[], share_embeddings=False)
    assert copied.model.speech_embedding.weight.data_ptr() != target.speech_embedding.weight.data_ptr()
    assert not any(p.requires_grad for p in copied.parameters())


def test_layers_names_every_draft_layer_whatever_the_depth(target, tmp_path):
    for layers in ([0], [0, 1, -1]):
        draft = build_draft(target, layers=layers, trainable=["layers", "head"])
        explicit = [f"layers.{j}" for j in range(len(layers))] + ["head"]
        assert list(draft.recipe.trainable) == explicit  # stored expanded: checkpoints say what they hold
        assert all(p.requires_grad for p in draft.model.backbone.layers.parameters())
        save_draft(tmp_path / "d.pt", draft)
        again = build_draft(target, layers=layers, trainable=["layers", "head"], checkpoint=tmp_path / "d.pt")
        assert again.recipe == draft.recipe
    only_first = build_draft(target, layers=[0, 1], trainable=["layers.0"])  # the control: one layer named
    assert not any(p.requires_grad for p in only_first.model.backbone.layers[1].parameters())


def test_training_the_draft_leaves_the_target_unchanged(target):
    before = target.llm_decoder.weight.detach().clone()
    draft = build_draft(target, layers=[0], trainable=["head"])
    logits, targets = draft.training_logits(
        torch.tensor([[3, 4]]), torch.tensor([2]), torch.tensor([[1, 2]]), torch.tensor([2])
    )
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    with torch.no_grad():
        for p in draft.parameters():
            if p.grad is not None:
                p -= 0.1 * p.grad
    assert torch.equal(target.llm_decoder.weight, before)
    assert not torch.equal(draft.model.llm_decoder.weight, before)
    assert target.speech_embedding.weight.grad is None


def test_all_layer_draft_reproduces_target_and_speaks_the_interface(target):
    draft = build_draft(target, layers=range(4), trainable=["layers.1"])
    assert isinstance(draft, Drafter) and isinstance(draft.model, SpeechLM)
    prompt = target.make_prompt(["bin blue at zero", "set red"], ["lay green", ""], [[1, 2], []])
    t_cache, t_logits = target.prefill(prompt, 6)
    d_cache, d_logits = draft.model.prefill(prompt, 6)
    assert torch.equal(t_logits, d_logits)
    tokens = torch.tensor([[4, 5, 6], [7, 8, 9]])
    assert torch.equal(target.extend(t_cache, tokens), draft.model.extend(d_cache, tokens))


def test_bad_recipes_are_clear_errors(target):
    with pytest.raises(ValueError, match=r"in \[0, 4\)"):
        build_draft(target, layers=[0, 4])
    with pytest.raises(ValueError, match="unknown.*valid names"):
        build_draft(target, layers=[0], trainable=["layers.1"])


def test_describe_lists_trainable_and_frozen_counts(target):
    draft = build_draft(target, layers=[0, 3], trainable=["layers.0", "head"])
    text = repr(draft)
    assert text == describe(draft)
    head = target.llm_decoder.weight.numel() + target.llm_decoder.bias.numel()
    layer = sum(p.numel() for p in target.backbone.layers[0].parameters())
    line = next(row for row in text.splitlines() if " head " in row)
    assert f"{head:,}" in line and "copy" in line
    line = next(row for row in text.splitlines() if "layers.1" in row)
    assert f"{layer:,}" in line and "target layers.3" in line
    total = next(row for row in text.splitlines() if "total" in row)
    assert f"{head + layer:,}" in total


def test_checkpoint_round_trip_and_wrong_target(target, tmp_path):
    draft = build_draft(target, layers=[0, 3], trainable=["layers.0", "head"])
    with torch.no_grad():
        draft.model.llm_decoder.bias.add_(1.0)
        draft.model.backbone.layers[0].mlp.up_proj.weight.mul_(1.5)
    path = save_draft(tmp_path / "draft.pt", draft)
    saved = torch.load(path, weights_only=True)["trained"]
    assert all(k.startswith(("backbone.layers.0.", "llm_decoder.")) for k in saved)
    again = load_draft(path, target)
    for (k, p), (_, q) in zip(draft.model.state_dict().items(), again.model.state_dict().items()):
        assert torch.equal(p, q), k
    assert [p.requires_grad for p in again.parameters()] == [p.requires_grad for p in draft.parameters()]
    same_shape_other = CosyVoice2LM.from_dir(make_tiny_cosyvoice2_dir(tmp_path / "other", seed=1))
    with pytest.raises(ValueError, match="another target"):
        load_draft(path, same_shape_other)
    with pytest.raises(ValueError, match="recipe"):
        build_draft(target, layers=[0, 2], trainable=["layers.0", "head"], checkpoint=path)
