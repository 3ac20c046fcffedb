"""LLaSA's sampling law as upstream runs it, and speculative decoding's exactness under each law option.

Upstream calls HF generate(do_sample=True, temperature=0.8, top_p=1) (+ repetition_penalty=1.2 in the LoRA
example), which leaves transformers' default top_k=50 on, over the full vocabulary. `distribution` must equal
HF's logits processors in HF's order; and speculative decoding with the exact rule must reproduce the law
(chi-square of the first tokens' joint law, p > 1e-3, with negative controls that must give p < 1e-3) for
each option: speech-only head, full head, full head + repetition penalty (a law of the WHOLE context:
position i of a verify block must see prompt + generated + x_<i).
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import fields, replace

import pytest
import torch
from engine_models import StaleWindowLaw, TrigramLM, autoregressive, chi_square_fit, speculative, trigram_pair
from transformers.generation.logits_process import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from ssd.decoding.acceptance import ExactRule
from ssd.decoding.sampling import SamplingConfig, distribution

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)

P_REJECT = 1e-3
N_SEQ = 20_000
UPSTREAM = SamplingConfig(temperature=0.8, top_k=50, nucleus="hf")  # generate(temperature=0.8, top_p=1)
UPSTREAM_LORA = SamplingConfig(temperature=0.8, top_k=50, nucleus="hf", repetition_penalty=1.2)


def hf_law(cfg: SamplingConfig, logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """The law HF generate samples from: its processors in the order _get_logits_processor builds them."""
    processors = LogitsProcessorList()
    if cfg.repetition_penalty is not None:
        processors.append(RepetitionPenaltyLogitsProcessor(cfg.repetition_penalty))
    if cfg.temperature != 1.0:
        processors.append(TemperatureLogitsWarper(cfg.temperature))
    if cfg.top_k is not None:
        processors.append(TopKLogitsWarper(cfg.top_k))
    if cfg.top_p is not None and cfg.top_p < 1.0:
        processors.append(TopPLogitsWarper(cfg.top_p))
    return processors(input_ids, logits.clone()).softmax(-1)


@pytest.mark.parametrize(
    "cfg",
    [
        UPSTREAM,
        UPSTREAM_LORA,
        SamplingConfig(temperature=0.7, top_k=5, top_p=0.9, nucleus="hf", repetition_penalty=1.5),
        SamplingConfig(repetition_penalty=0.8),  # < 1 rewards repeats: the same formula
    ],
    ids=["upstream", "upstream_lora", "all_processors", "penalty_below_1"],
)
def test_distribution_equals_hf_logits_processors(cfg):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 120, generator=g, dtype=torch.float64) * 3
    input_ids = torch.randint(0, 120, (16, 30), generator=g)  # repeats included: each id counts once
    # the engine's window holds -1 where there is no token; HF's input_ids have none
    window = torch.cat([torch.full((16, 7), -1), input_ids], 1)
    got = distribution(cfg, logits, window)
    torch.testing.assert_close(got, hf_law(cfg, logits, input_ids), atol=1e-6, rtol=0)
    if cfg.repetition_penalty is not None:  # the context matters: without it the law is another one
        assert (distribution(cfg, logits, window[:, :7]) - got).abs().max() > 1e-3


def test_repetition_penalty_is_applied_before_temperature_and_top_k():
    """HF order: penalty on the raw logits, then temperature, then top-k (penalised ids can drop out)."""
    logits = torch.tensor([[3.0, 2.9, -1.0, 0.5]], dtype=torch.float64)
    cfg = SamplingConfig(temperature=0.5, top_k=2, nucleus="hf", repetition_penalty=2.0)
    law = distribution(cfg, logits, torch.tensor([[0, 2]]))
    penalised = torch.tensor([[1.5, 2.9, -2.0, 0.5]], dtype=torch.float64)
    expected = torch.zeros_like(law)
    expected[0, :2] = (penalised[0, :2] / 0.5).softmax(-1)
    torch.testing.assert_close(law, expected)


# ---- certificates: speculative decoding reproduces each law option ---------------------------------

VOCAB, EOS = 6, 5
PROMPT = torch.tensor([[1, 3, 3]])  # the prompt's ids are part of the penalised context
OPTIONS = {
    # head=speech: the model's law over codes + end only, tempered, no top-k (it is the restricted head)
    "speech_head": SamplingConfig(temperature=0.8, stop_tokens=(EOS,)),
    # head=full: upstream's HF top-k (here 3 of 6 ids) at T=0.8
    "full_head": SamplingConfig(temperature=0.8, top_k=3, nucleus="hf", stop_tokens=(EOS,)),
    "full_head_penalty": SamplingConfig(
        temperature=0.8, top_k=3, nucleus="hf", repetition_penalty=1.2, stop_tokens=(EOS,)
    ),
    # the same law with a penalty strong enough for the negative controls to have power
    "full_head_penalty_2": SamplingConfig(
        temperature=0.8, top_k=3, nucleus="hf", repetition_penalty=2.0, stop_tokens=(EOS,)
    ),
}


class PromptedTrigramLM(TrigramLM):
    """A trigram model whose prompt ids are its context_ids (head ids = vocabulary ids, as the full head)."""

    def context_ids(self, prompt):
        return list(prompt)


def trigram_models():
    target, draft = trigram_pair(VOCAB, seed=4, draft_noise=1.5, scale=2.0)
    return PromptedTrigramLM(target.table), PromptedTrigramLM(draft.table)


def joint_law(model, prompt, cfg, length, eos, min_len=0, context=()) -> dict[tuple, float]:
    """P(first `length` tokens) under AR sampling from `cfg` (a sequence may end early at a stop token); the
    history is context ++ the tokens so far for a whole-context law, the last cfg.window tokens for RAS.
    A sequence ended by any stop token is recorded as ending with `eos` (decoded tokens omit the stop token)."""
    law = {}

    def walk(prefix: tuple, prob: float):
        if len(prefix) == length or (prefix and prefix[-1] in cfg.stop_tokens):
            key = prefix[:-1] + (eos,) if prefix and prefix[-1] in cfg.stop_tokens else prefix
            law[key] = law.get(key, 0.0) + prob
            return
        cache, logits = model.prefill(prompt, length + 1)
        for t in prefix:
            logits = model.extend(cache, torch.tensor([[t]]))[:, -1]
        window = None
        if cfg.whole_context:
            window = torch.tensor([list(context) + list(prefix)])
        elif cfg.window:
            window = torch.tensor([([-1] * cfg.window + list(prefix))[-cfg.window :]])
        q = distribution(cfg, logits.double(), window, len(prefix), min_len)[0]
        for t in q.nonzero().flatten().tolist():
            walk(prefix + (t,), prob * float(q[t]))

    walk((), 1.0)
    return law


def p_value(samples: list[list[int]], law: dict[tuple, float], length: int, eos: int) -> float:
    """Chi-square goodness of fit of the samples' first tokens; cells expected < 5 pooled."""

    def outcome(tokens):
        head = tuple(tokens[:length])
        return head if len(head) == length else head + (eos,)

    return chi_square_fit(Counter(map(outcome, samples)), law)[2]


def spec_samples(cfg, draft_len=3, seed=0, min_len=0):
    target, draft = trigram_models()
    g = torch.Generator().manual_seed(seed)
    return speculative(
        target, draft, PROMPT.expand(N_SEQ, -1), cfg, ExactRule(), draft_len, 3, min_len, g
    ).tokens


@pytest.fixture(scope="module")
def laws():
    target, _ = trigram_models()
    return {
        name: joint_law(target, PROMPT, cfg, 3, EOS, context=PROMPT[0].tolist())
        for name, cfg in OPTIONS.items()
    }


@pytest.mark.parametrize("name", list(OPTIONS))
def test_ar_sampler_matches_the_enumerated_law(laws, name):
    target, _ = trigram_models()
    g = torch.Generator().manual_seed(1)
    tokens = autoregressive(target, PROMPT.expand(N_SEQ, -1), OPTIONS[name], 3, 0, g).tokens
    assert p_value(tokens, laws[name], 3, EOS) > P_REJECT


@pytest.mark.parametrize("draft_len", [1, 3])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_speculative_reproduces_each_law_option(laws, name, draft_len):
    assert p_value(spec_samples(OPTIONS[name], draft_len), laws[name], 3, EOS) > P_REJECT


def test_penalty_verified_without_the_draft_extended_history_is_rejected(laws):
    """Negative control: position i of a verify block penalising only prompt + generated (not x_<i)."""
    cfg = OPTIONS["full_head_penalty_2"]
    stale = StaleWindowLaw(**{f.name: getattr(cfg, f.name) for f in fields(cfg)})
    assert p_value(spec_samples(stale), laws["full_head_penalty_2"], 3, EOS) < P_REJECT


def test_penalty_without_the_prompt_ids_is_rejected(laws):
    """Negative control: a penalty over the generated tokens only (HF's input_ids include the prompt)."""

    class NoContext(PromptedTrigramLM):
        def context_ids(self, prompt):
            return [row[:0] for row in prompt]

    target, draft = trigram_models()
    g = torch.Generator().manual_seed(0)
    tokens = speculative(NoContext(target.table), draft, PROMPT.expand(N_SEQ, -1), OPTIONS["full_head_penalty_2"],
                         ExactRule(), 3, 3, 0, g).tokens  # fmt: skip
    assert p_value(tokens, laws["full_head_penalty_2"], 3, EOS) < P_REJECT


def test_the_law_options_differ(laws):
    """The certificates tell the options apart: each option's samples fail the others' laws."""
    samples = spec_samples(OPTIONS["full_head_penalty_2"])
    assert p_value(samples, laws["full_head"], 3, EOS) < P_REJECT
    assert p_value(spec_samples(OPTIONS["full_head"]), laws["speech_head"], 3, EOS) < P_REJECT


def test_a_law_of_the_whole_context_needs_the_models_context_ids():
    target, _ = trigram_pair(VOCAB, seed=4)
    with pytest.raises(TypeError, match="context_ids.*repetition_penalty=null"):
        autoregressive(target, PROMPT, OPTIONS["full_head_penalty"], 2)


def test_penalty_and_ras_cannot_be_combined():
    with pytest.raises(ValueError, match="repetition_penalty and sampling.ras_window"):
        SamplingConfig(repetition_penalty=1.2, ras_window=10)
    with pytest.raises(ValueError, match="repetition_penalty must be > 0"):
        SamplingConfig(repetition_penalty=0)


# ---- the real adapter: LlasaLM's full head, text tokens and all -------------------------------------


@pytest.fixture(scope="module")
def llasa(tiny_llasa_dir):
    from ssd.drafters.layers import build_draft
    from ssd.models.llasa import LlasaLM

    target = LlasaLM.from_dir(tiny_llasa_dir)
    return target, build_draft(target, layers=[0]).model


@pytest.mark.parametrize("cfg", [UPSTREAM, UPSTREAM_LORA], ids=["upstream", "upstream_lora"])
def test_llasa_speculative_reproduces_upstreams_law(llasa, cfg):
    """The tiny LLaSA (86-id full head, top_k=50): first two tokens, speculative vs the enumerated law."""
    target, draft = llasa
    cfg = replace(cfg, stop_tokens=target.stop_tokens)
    prompt = target.make_prompt(["bin blue"], ["lay green"], [[1, 2]])
    law = joint_law(target, prompt, cfg, 2, target.eos_token, context=target.context_ids(prompt)[0].tolist())
    assert sum(p for seq, p in law.items() if any(t > target.eos_token for t in seq)) > 0.05  # text tokens
    g = torch.Generator().manual_seed(0)
    batch = type(prompt)(prompt.input_ids * (N_SEQ // 2))
    result = speculative(target, draft, batch, cfg, ExactRule(), 2, 2, 0, g)
    assert p_value(result.tokens, law, 2, target.eos_token) > P_REJECT
    emitted = [t for row in result.tokens for t in row]
    assert any(t > target.eos_token for t in emitted)  # text tokens were sampled and stayed in the context
    assert all(t < target.eos_token for row in result.tokens for t in target.codec_tokens(row))


def test_verify_block_laws_equal_hf_generates_own_scores(llasa, tiny_llasa_dir):
    """HF generate(do_sample, temperature=0.8, repetition_penalty=1.2) on the same checkpoint gives its
    processed scores at each step; the engine's verify-block laws (prompt ids via context_ids, the block's
    earlier tokens via the verification windows) equal them on every head id."""
    from transformers import LlamaForCausalLM

    from ssd.decoding.generate import Request
    from ssd.decoding.sequences import Sequences

    target, _ = llasa
    cfg = replace(UPSTREAM_LORA, stop_tokens=target.stop_tokens)
    hf = LlamaForCausalLM.from_pretrained(str(tiny_llasa_dir), local_files_only=True).eval()
    prompt = target.make_prompt(["bin blue"], ["lay green"], [[1, 2, 2]])
    torch.manual_seed(3)
    out = hf.generate(
        prompt.input_ids[0][None], do_sample=True, temperature=0.8, top_p=1.0, repetition_penalty=1.2,
        max_new_tokens=6, eos_token_id=target.speech_end_id, pad_token_id=target.speech_end_id,
        output_scores=True, return_dict_in_generate=True,
    )  # fmt: skip
    hf_laws = (
        torch.cat(out.scores).double().softmax(-1)[:, target.to_global_ids(torch.arange(target.vocab_size))]
    )
    to_head = target._maps(torch.device("cpu"))[1]
    block = to_head[out.sequences[0, prompt.input_ids[0].numel() :]][None]  # generated tokens, head ids
    k = block.shape[1] - 1
    cache, first = target.prefill(prompt, k + 2)
    logits = torch.cat([first[:, None], target.extend(cache, block[:, :k])], 1)[0].double()
    history = Sequences(Request(prompt, k + 1), cfg, target, first, slack=k + 1)
    windows = cfg.windows(history.last_window(), block[:, :k])[0]
    torch.testing.assert_close(distribution(cfg, logits, windows), hf_laws, atol=1e-5, rtol=0)
    # the same block with the un-extended history is another law
    stale = history.last_window().expand(k + 1, -1)
    assert (distribution(cfg, logits, stale) - hf_laws).abs().max() > 1e-3
