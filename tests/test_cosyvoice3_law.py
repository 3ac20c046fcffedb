"""CosyVoice 3's sampling law as upstream runs it, and speculative decoding's exactness on it (β = 0).

A tiny random-weight CosyVoice 3 in the real format (llm.pt, CosyVoice-BlankEN/; 5 codes + upstream's 200
special rows, all of which end a sequence) is decoded through CosyVoice3LM with a layer-subset draft. The
joint law of the first three tokens under AR sampling is enumerated (float64, RAS window and the min_len
rule included) and the samples of 20,000 sequences must fit it (chi-square, p > 1e-3), for both laws
upstream has run for CosyVoice 3:

- release: RAS "classic" + redraw on any special row before min_len (upstream 2025-12-09 to 2026-02-03;
  what target=cosyvoice3 uses);
- head: RAS "exclude_repeated" + id S's logit set to -inf before min_len (upstream since 2026-02-11). S is
  CosyVoice 3's sos row: EOS (S+1) may end a sequence before min_len, as upstream's code lets it.

Negative controls, which must fail (p < 1e-3, on 5,000 sequences): a verifier whose RAS window misses the
draft tokens, a verifier without RAS, an adapter reading task_id from the wrong special row, each law's
samples against the other law, and the head law with EOS (instead of S) refused before min_len.
Draft length 1 and the exact rule (β = 0's twin) run with the slow tests.
"""

from __future__ import annotations

import os
from dataclasses import fields, replace

import pytest
import torch
from engine_models import StaleWindowLaw, autoregressive, speculative
from test_llasa_law import joint_law, p_value

from ssd.decoding.acceptance import ExactRule, ToleranceRule
from ssd.decoding.sampling import SamplingConfig
from ssd.drafters.layers import build_draft
from ssd.models.cosyvoice3 import CosyVoice3LM, CosyVoice3Prompt
from tests.fixtures_models import make_tiny_cosyvoice3_dir

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)

P_REJECT = 1e-3
N_SEQ = 20_000
N_CONTROL = (
    5_000  # the negative controls are rejected with p ~ 0 at 20,000 (p < 1e-300); 5,000 keep them fast
)
S = 5  # codes 0..4; special rows 5..204: sos 5, EOS 6, task_id 7, fill 8
LENGTH, MIN_LEN = 3, 1  # the first token may not stop; the second and third may
RELEASE = SamplingConfig(top_k=25, top_p=0.8, nucleus="cosyvoice", ras_window=10, ras_tau=0.1,
                         ras_variant="classic", eos_mode="resample")  # fmt: skip
HEAD = replace(RELEASE, ras_variant="exclude_repeated", eos_mode="mask_eos")


def _shaped_dir(root):
    """The tiny dir with a head shaped like a trained one: codes likely, sos and EOS plausible, the other 198
    special rows almost never (random weights put ~97% of the mass on those 198, where the laws show
    nothing). Coordinate 0 of every input embedding is set to 1 and no layer writes to it, so the final
    hidden state's coordinate 0 is positive everywhere and llm_decoder's column 0 works as a per-row bias.
    Loaded and saved back through CosyVoice3LM, so llm.pt and CosyVoice-BlankEN/ stay one real-format model."""
    model = CosyVoice3LM.from_dir(make_tiny_cosyvoice3_dir(root / "random", speech_token_size=S))
    with torch.no_grad():
        for embedding in (model.backbone.embed_tokens, model.speech_embedding):
            embedding.weight[:, 0] = 1.0
        for layer in model.backbone.layers:
            layer.self_attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
        prompt = model.make_prompt(["bin blue"], ["lay"], [[1, 2]])
        embeds, lengths = model.embed_prompt(prompt)
        feature = float(model.backbone(embeds, lengths=lengths)[0, :, 0].mean())
        bias = torch.full((S + 200,), -8.0)
        bias[:S], bias[S], bias[S + 1], bias[S + 2 : S + 4] = 0.0, -1.0, 0.3, -4.0
        model.llm_decoder.weight[:, 0] = bias / feature
    return model.save_dir(root / "shaped")


class TaskIdFromTheEosRow(CosyVoice3LM):
    """A wrong adapter: task_id read from row S+1 (EOS) instead of S+2."""

    def sos_task_id_embeds(self):
        rows = self.speech_embedding.weight
        return rows[S : S + 1], rows[S + 1 : S + 2]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    model_dir = _shaped_dir(tmp_path_factory.mktemp("cosyvoice3_law"))
    target = CosyVoice3LM.from_dir(model_dir)
    prompt = target.make_prompt(["bin blue"], ["lay"], [[1, 2]])
    laws = {
        name: joint_law(target, prompt, cfg(target), LENGTH, target.eos_token, min_len=MIN_LEN)
        for name, cfg in CONFIGS.items()
    }
    return {"dir": model_dir, "target": target, "prompt": prompt, "laws": laws}


def _release(target):
    return replace(RELEASE, stop_tokens=target.stop_tokens)


def _head(target):
    return replace(HEAD, stop_tokens=target.stop_tokens)


CONFIGS = {"release": _release, "head": _head}


def _batch(prompt: CosyVoice3Prompt, n: int = N_SEQ) -> CosyVoice3Prompt:
    return CosyVoice3Prompt(prompt.text_ids * n, prompt.speech_ids * n, prompt.target_text_lens.repeat(n))


def _p(world, tokens, law_name) -> float:
    return p_value(tokens, world["laws"][law_name], LENGTH, world["target"].eos_token)


def _spec(world, cfg, rule=None, draft_len=3, seed=0, n=N_SEQ):
    target = world["target"]
    draft = build_draft(target, layers=[0, -1])
    g = torch.Generator().manual_seed(seed)
    return speculative(target, None, _batch(world["prompt"], n), cfg, rule or ToleranceRule(0.0), draft_len,
                       LENGTH, MIN_LEN, g, drafter=draft).tokens  # fmt: skip


def test_the_laws_use_cosyvoice3s_special_rows(world):
    """The certificate has power where CosyVoice 3 differs: stops after min_len, EOS and other special rows
    among them, RAS repeats, and the two upstream laws far apart."""
    target, laws = world["target"], world["laws"]
    assert target.stop_tokens == tuple(range(S, S + 200))
    for law in laws.values():
        assert sum(law.values()) == pytest.approx(1.0, abs=1e-9)
        assert all(t < S for seq in law for t in seq[:-1])  # codes only before the end
        assert 0.2 < sum(p for seq, p in law.items() if seq[-1] == target.eos_token) < 0.8
        assert sum(p for seq, p in law.items() if len(set(seq)) < len(seq)) > 0.05  # repeats: RAS at work
    release, head = laws["release"], laws["head"]
    assert sum(abs(release.get(k, 0.0) - head.get(k, 0.0)) for k in release.keys() | head.keys()) > 0.3
    assert (
        head.get((target.eos_token,), 0.0) > 0.01 and (target.eos_token,) not in release
    )  # EOS before min_len


@pytest.mark.parametrize("name", list(CONFIGS))
def test_ar_sampler_matches_the_enumerated_law(world, name):
    target = world["target"]
    g = torch.Generator().manual_seed(1)
    cfg = CONFIGS[name](target)
    tokens = autoregressive(target, _batch(world["prompt"]), cfg, LENGTH, MIN_LEN, g).tokens
    assert _p(world, tokens, name) > P_REJECT


@pytest.mark.parametrize("draft_len", [pytest.param(1, marks=pytest.mark.slow), 3])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_speculative_at_beta_zero_reproduces_the_law(world, name, draft_len):
    assert _p(world, _spec(world, CONFIGS[name](world["target"]), draft_len=draft_len), name) > P_REJECT


@pytest.mark.slow
def test_exact_rule_reproduces_the_release_law(world):
    assert _p(world, _spec(world, _release(world["target"]), rule=ExactRule(), seed=2), "release") > P_REJECT


# ---- negative controls: each must be rejected ----------------------------------------------------------


def test_ras_window_without_the_draft_tokens_is_rejected(world):
    law = _release(world["target"])
    stale = StaleWindowLaw(**{f.name: getattr(law, f.name) for f in fields(law)})
    tokens = _spec(world, stale, n=N_CONTROL)
    assert _p(world, tokens, "release") < P_REJECT


def test_a_verifier_without_ras_is_rejected(world):
    no_ras = replace(_release(world["target"]), ras_window=0)
    assert _p(world, _spec(world, no_ras, n=N_CONTROL), "release") < P_REJECT


def test_task_id_from_the_wrong_special_row_is_rejected(world):
    wrong = TaskIdFromTheEosRow.from_dir(world["dir"])
    g = torch.Generator().manual_seed(3)
    tokens = autoregressive(
        wrong, _batch(world["prompt"], N_CONTROL), _release(wrong), LENGTH, MIN_LEN, g
    ).tokens
    assert _p(world, tokens, "release") < P_REJECT


def test_the_two_upstream_laws_reject_each_others_samples(world):
    target = world["target"]
    assert _p(world, _spec(world, _release(target), seed=4, n=N_CONTROL), "head") < P_REJECT
    assert _p(world, _spec(world, _head(target), seed=5, n=N_CONTROL), "release") < P_REJECT


def test_head_law_refusing_eos_instead_of_s_is_rejected(world):
    """Upstream's min_len rule names id S (CosyVoice 3's sos row); refusing EOS (S+1) is another law."""
    target = world["target"]
    eos_first = replace(HEAD, stop_tokens=(S + 1, S, *range(S + 2, S + 200)))
    assert eos_first.forbidden_before_min_len == (target.eos_token,)
    assert _p(world, _spec(world, eos_first, seed=6, n=N_CONTROL), "head") < P_REJECT
