"""The static decode path and compile_decoding: same logits and tokens as the eager path, no graph break,
no recompile per step, exact rollback, ragged rows, and clear errors where a static cache cannot go."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from torch._dynamo.testing import CompileCounter  # noqa: E402

from ssd.decoding.generate import Request, decode_ar  # noqa: E402
from ssd.decoding.sampling import SamplingConfig  # noqa: E402
from ssd.drafters.layers import build_draft  # noqa: E402
from ssd.models.cosyvoice2 import CosyVoice2LM  # noqa: E402
from ssd.models.llasa import LlasaLM  # noqa: E402

torch.set_num_threads(1)

TEXTS = ["bin blue at zero now", "set red"]  # two rows of different prompt lengths
PROMPT_TEXTS = ["lay green", ""]
PROMPT_SPEECH = [[1, 2, 3], []]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def load(kind: str, model_dir):
    cls = CosyVoice2LM if kind == "cosyvoice2" else LlasaLM
    return cls.from_dir(model_dir)


def model_dir(kind, request):
    return request.getfixturevalue("tiny_cosyvoice2_dir" if kind == "cosyvoice2" else "tiny_llasa_dir")


def run_script(model, prompt, steps):
    """Drive prefill / extend / rollback as the speculative loop does; every call's logits, in order."""
    cache, logits = model.prefill(prompt, 24)
    out = [logits]
    for op, arg in steps:
        if op == "extend":
            out.append(model.extend(cache, arg))
        else:
            model.rollback(cache, arg)
    return out, cache


# Decode(1), verify(4) with per-row rejection, then a draft's pending pair and more decode(1).
SCRIPT = [
    ("extend", torch.tensor([[5], [7]])),
    ("extend", torch.tensor([[1, 9, 4, 2], [3, 3, 8, 0]])),
    ("rollback", torch.tensor([3, 1])),
    ("extend", torch.tensor([[6, 2], [4, 5]])),
    ("extend", torch.tensor([[8], [1]])),
    ("extend", torch.tensor([[2], [9]])),
]


@pytest.mark.parametrize("kind", ["cosyvoice2", "llasa"])
def test_static_path_compiles_whole_and_matches_eager(kind, request):
    """fullgraph=True raises on any graph break; the counter shows one graph per block length, i.e. the
    step's shapes do not change from step to step (what CUDA-graph capture needs)."""
    directory = model_dir(kind, request)
    eager = load(kind, directory)
    static = load(kind, directory)
    counter = CompileCounter()
    static.compile_decoding(backend=counter)
    prompt = eager.make_prompt(TEXTS, PROMPT_TEXTS, PROMPT_SPEECH)
    want, cache_e = run_script(eager, prompt, SCRIPT)
    got, cache_s = run_script(static, prompt, SCRIPT)
    assert cache_s.static and not cache_e.static
    assert counter.frame_count == 3  # block lengths 1, 4 and 2; the three decode(1) calls share one graph
    assert torch.equal(cache_s.lengths, cache_e.lengths)
    for step, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape and a.dtype == torch.float32
        assert torch.allclose(a, b, atol=1e-5, rtol=0), f"call {step}: {(a - b).abs().max():.2e}"


def test_draft_compiles_by_delegation_and_many_block_lengths_stay_compiled(tiny_cosyvoice2_dir):
    """A target and its draft compiled together: the draft's steps match its eager twin, and the 11 graphs
    of both (more than dynamo's default limit of 8 per code object, which they share) all get compiled
    rather than falling back to eager."""
    eager_draft = build_draft(CosyVoice2LM.from_dir(tiny_cosyvoice2_dir), layers=[0, -1])
    target = CosyVoice2LM.from_dir(tiny_cosyvoice2_dir)
    draft = build_draft(target, layers=[0, -1])
    counter = CompileCounter()
    assert draft.compile_decoding(backend=counter) is draft
    target.compile_decoding(backend=counter)
    prompt = target.make_prompt(TEXTS, PROMPT_TEXTS, PROMPT_SPEECH)
    want, _ = run_script(eager_draft.model, prompt, SCRIPT)
    got, cache = run_script(draft.model, prompt, SCRIPT)
    assert cache.static and counter.frame_count == 3
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-5, rtol=0)
    verify_every_k = [
        step
        for k in range(1, 9)
        for step in (("extend", torch.ones(2, k + 1, dtype=torch.long)), ("rollback", k))
    ]
    run_script(target, prompt, verify_every_k)
    assert counter.frame_count == 3 + 8


@pytest.mark.slow  # inductor compiles for about a minute on 2 cores
def test_inductor_compiled_greedy_decode_equals_eager(tiny_cosyvoice2_dir):
    """The real compiler (inductor) on decode(1): logits within 1e-5 and identical greedy tokens."""
    eager = CosyVoice2LM.from_dir(tiny_cosyvoice2_dir)
    compiled = CosyVoice2LM.from_dir(tiny_cosyvoice2_dir).compile_decoding()
    prompt = eager.make_prompt(TEXTS, PROMPT_TEXTS, PROMPT_SPEECH)
    greedy = SamplingConfig(temperature=0.0, stop_tokens=eager.stop_tokens)
    results = [decode_ar(m, Request(prompt, 12), greedy) for m in (eager, compiled)]
    assert results[0].tokens == results[1].tokens
    assert sum(len(t) for t in results[0].tokens) > 2 * 3  # a real decode, not a stop at once
    script = [("extend", torch.tensor([[5], [7]])), ("extend", torch.tensor([[8], [1]]))]
    for a, b in zip(run_script(compiled, prompt, script)[0], run_script(eager, prompt, script)[0]):
        assert torch.allclose(a, b, atol=1e-5, rtol=0)


def test_static_rollback_is_exact(tiny_cosyvoice2_dir):
    """Extend k, roll back n, extend again == extending only the kept tokens (stale cache entries are
    masked, never read)."""
    model = CosyVoice2LM.from_dir(tiny_cosyvoice2_dir)
    model.backbone.static_step = True  # static, not compiled
    prompt = model.make_prompt(TEXTS, PROMPT_TEXTS, PROMPT_SPEECH)
    block = torch.tensor([[1, 9, 4, 2], [3, 3, 8, 0]])
    rolled, _ = run_script(
        model, prompt, [("extend", block), ("rollback", 3), ("extend", torch.tensor([[6], [5]]))]
    )
    straight, _ = run_script(model, prompt, [("extend", block[:, :1]), ("extend", torch.tensor([[6], [5]]))])
    assert torch.allclose(rolled[-1], straight[-1], atol=1e-5, rtol=0)
    # Negative control: rolling back one position too few keeps a rejected token, and the logits move.
    kept_one_more, _ = run_script(
        model, prompt, [("extend", block), ("rollback", 2), ("extend", torch.tensor([[6], [5]]))]
    )
    assert not torch.allclose(kept_one_more[-1], straight[-1], atol=1e-3)


def test_ragged_static_batch_equals_each_row_alone_eager(tiny_cosyvoice2_dir):
    static = CosyVoice2LM.from_dir(tiny_cosyvoice2_dir)
    static.backbone.static_step = True
    eager = CosyVoice2LM.from_dir(tiny_cosyvoice2_dir)
    batch = static.make_prompt(TEXTS, PROMPT_TEXTS, PROMPT_SPEECH)
    got, cache = run_script(static, batch, SCRIPT)
    assert cache.lengths[0] != cache.lengths[1]
    for row in range(2):
        alone = eager.make_prompt(
            TEXTS[row : row + 1], PROMPT_TEXTS[row : row + 1], PROMPT_SPEECH[row : row + 1]
        )
        script = [(op, arg[row : row + 1] if op == "extend" else arg[row]) for op, arg in SCRIPT]
        want, _ = run_script(eager, alone, script)
        for a, b in zip(got, want):
            assert torch.allclose(a[row : row + 1], b, atol=1e-5, rtol=0)


def test_static_cache_errors_name_the_fix(tiny_cosyvoice2_dir):
    model = CosyVoice2LM.from_dir(tiny_cosyvoice2_dir)
    model.backbone.static_step = True
    prompt = model.make_prompt(TEXTS[:1])
    cache, _ = model.prefill(prompt, 4)
    assert cache.capacity == 256  # rounded up: few distinct shapes for the compiled step
    with pytest.raises(RuntimeError, match="rollback would cut into the prompt"):
        model.rollback(cache, 1)
    with pytest.raises(RuntimeError, match="overflow.*max_new_tokens"):
        model.extend(cache, torch.zeros(1, cache.capacity, dtype=torch.long))
    with pytest.raises(ValueError, match="cannot grow"):
        cache.ensure_capacity(cache.capacity + 1)
    model.prefill(prompt, 4)  # same shape: reuses the buffers of `cache`
    with pytest.raises(RuntimeError, match="superseded"):
        model.extend(cache, torch.zeros(1, 1, dtype=torch.long))


@pytest.mark.gpu
def test_cuda_graph_decode_equals_eager(tiny_cosyvoice2_dir):
    """mode="reduce-overhead" on CUDA: the step replays as a CUDA graph; outputs handed out stay valid."""
    eager = CosyVoice2LM.from_dir(tiny_cosyvoice2_dir, device="cuda")
    compiled = CosyVoice2LM.from_dir(tiny_cosyvoice2_dir, device="cuda").compile_decoding()
    prompt = eager.make_prompt(TEXTS, PROMPT_TEXTS, PROMPT_SPEECH)
    script = [(op, arg.cuda()) for op, arg in SCRIPT]
    want, _ = run_script(eager, prompt, script)
    got, _ = run_script(compiled, prompt, script)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-4, rtol=0)
    greedy = SamplingConfig(temperature=0.0, stop_tokens=eager.stop_tokens)
    assert (
        decode_ar(eager, Request(prompt, 16), greedy).tokens
        == decode_ar(compiled, Request(prompt, 16), greedy).tokens
    )


@pytest.mark.slow  # two inductor compiles
def test_inductor_writes_the_static_cache_in_place():
    """A step must write its k new entries, not copy the layer cache (a copy per step and layer would
    dominate a GPU step at long contexts). Detected in inductor's generated code: no loop spans a whole
    layer buffer. Control: a scatter into a slice of one stacked buffer, which inductor does copy."""
    from torch._inductor.utils import run_and_get_code

    from ssd.models.backbone_config import BackboneConfig
    from ssd.models.transformer import Backbone

    config = BackboneConfig("qwen2", 50, 32, 48, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)
    model = Backbone(config).eval()
    model.static_step = True
    with torch.no_grad():
        cache = model.new_cache(2, 1000)
        layer_numel = cache.k[0].numel()  # 2 x 2 x 1024 x 8
        step = torch.compile(model.static_forward, fullgraph=True, dynamic=False)
        _, code = run_and_get_code(step, torch.randn(2, 1, 32), cache.k, cache.v, cache.lengths)
        code = "\n".join(code)
        assert "def call(" in code and f"{layer_numel}L" not in code

        def stacked_scatter(buffer, positions, value):
            index = positions[:, None, :, None].expand(2, 2, 1, 8)
            buffer[0].scatter_(2, index, value)
            return value * 2

        stacked = torch.zeros(2, *cache.k[0].shape)
        _, control = run_and_get_code(
            torch.compile(stacked_scatter, fullgraph=True, dynamic=False),
            stacked, torch.tensor([[3], [5]]), torch.ones(2, 2, 1, 8),
        )  # fmt: skip
        assert f"{layer_numel}L" in "\n".join(control)


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_a_speculative_round_reads_the_device_once_on_either_cache_path(tiny_cosyvoice2_dir, static):
    """Host reads anywhere in the engine and the models (tolist/item/bool/int/float/index, counted by the
    benchmark's torch-function counter), ragged rows: a decode with more rounds costs exactly one more
    read per extra round. The eager cache follows its lengths as host ints (the round's sync hands it the
    accepted counts), so it slices without reading the device."""
    from test_bench_scripts import load_script

    from ssd.decoding.acceptance import ExactRule
    from ssd.decoding.generate import decode_speculative
    from ssd.decoding.observe import Instruments
    from ssd.decoding.rng import RowRandom

    counter_type = load_script("bench_decoding").HostSyncCounter
    target = CosyVoice2LM.from_dir(tiny_cosyvoice2_dir)
    draft = build_draft(target, layers=[0, -1])
    target.backbone.static_step = static
    prompt = target.make_prompt(TEXTS, PROMPT_TEXTS, PROMPT_SPEECH)
    law = SamplingConfig(top_k=10, top_p=0.9, ras_window=4, ras_tau=0.1, stop_tokens=())

    def reads_and_rounds(n):
        with counter_type() as counter:
            result = decode_speculative(target, draft, Request(prompt, n, n, RowRandom([3, 4])), law, ExactRule(), 3,
                                        Instruments(diagnostics=False))  # fmt: skip
        return counter.total, result.stats.rounds, counter.calls

    (short, short_rounds, _), (long, long_rounds, calls) = reads_and_rounds(12), reads_and_rounds(36)
    assert long_rounds > short_rounds + 5
    assert long - short == long_rounds - short_rounds, calls
