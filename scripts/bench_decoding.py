"""Decoding benchmark: this engine vs HF `generate` and HF assisted generation on the same weights,
AR vs speculative per rule and draft length, in one run (docs/benchmarks.md explains every column).

Per shape (random weights; `--shape toy` is configs/target/toy.yaml's architecture, `cosyvoice2` is
CosyVoice 2's LM, `tiny` is for smoke tests):
  * per-call costs: target decode(1), verify(k+1), draft decode(1); c and v_k;
  * per-step sampler cost (distribution + sample) at the shape's V for B and B·(L_d+1) rows;
  * host syncs per round of a decode (TorchFunctionMode counter), on both cache paths;
  * AR: this engine vs HF `generate` (Qwen2ForCausalLM holding the same tensors);
  * speculative: this engine (exact rule) vs HF assisted generation (assistant = the draft's layers)
    at each L_d, then this engine under SYNTHETIC α (fixed acceptance; random weights make real α
    meaningless), each with the speedup predicted from α, c and v measured in this run;
  * batch 1/4/8 throughput of the engine (AR and speculative) next to HF `generate`.

Every compared system generates exactly --tokens tokens per row (no stop tokens; HF gets
min_new_tokens = max_new_tokens) under the same law (top-k 25, then top-p 0.8, HF's rule).

    python scripts/bench_decoding.py --shape both --out experiments/results/bench_decoding
    python scripts/bench_decoding.py --shape cosyvoice2 --device cuda --dtype bfloat16 --out /tmp/b
    python scripts/bench_decoding.py --shape tiny --quick --out /tmp/smoke
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1])
)  # the checkout this script is in, not an installed ssd
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

from ssd.decoding.acceptance import ExactRule, SyntheticRule  # noqa: E402
from ssd.decoding.generate import PaddedVerify, Request, decode_ar, decode_speculative  # noqa: E402
from ssd.decoding.observe import Instruments  # noqa: E402
from ssd.decoding.rng import RowRandom  # noqa: E402
from ssd.decoding.sampling import SamplingConfig, distribution, sample  # noqa: E402
from ssd.drafters.block import BlockDrafter  # noqa: E402
from ssd.drafters.eagle import FeatureDrafter  # noqa: E402
from ssd.drafters.heads import HeadsDrafter  # noqa: E402
from ssd.drafters.layers import build_draft  # noqa: E402
from ssd.evaluation.metrics import paired_speedup, paired_speedup_ci  # noqa: E402
from ssd.evaluation.tables import expected_tokens_per_round  # noqa: E402
from ssd.files import save_figure, write_atomic  # noqa: E402
from ssd.models.backbone_config import BackboneConfig  # noqa: E402
from ssd.models.cosyvoice2 import CosyVoice2LM, CosyVoice2Prompt  # noqa: E402
from ssd.models.export import hf_causal_lm  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PARTS = ("syncs", "sampler", "speculative", "drafters", "batch")  # the optional sections, in run order


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    speech_tokens: int  # codec tokens; the head has 3 more (CosyVoice 2's stop ids)
    draft_layers: tuple[int, ...]
    text_vocab: int = 1000


def toy_shape() -> Shape:
    """configs/target/toy.yaml's architecture with configs/draft/toy.yaml's layers (read, so they stay in step)."""
    from ssd.config import compose

    cfg = compose("train_draft", ["target=toy", "draft=toy"])
    a, layers = cfg.target.architecture, int(cfg.target.architecture.num_hidden_layers)
    draft = tuple(i % layers for i in cfg.draft.layers)
    return Shape(a.hidden_size, layers, a.num_attention_heads, a.num_key_value_heads, a.intermediate_size,
                 int(cfg.target.speech_token_size), draft)  # fmt: skip


SHAPES = {
    "toy": toy_shape(),
    # CosyVoice 2's LM (docs/targets.md §2.1) with the SSD paper's 8-layer draft (configs/draft/ssd_8layer.yaml).
    "cosyvoice2": Shape(896, 24, 14, 2, 4864, 6561, (0, 1, 18, 19, 20, 21, 22, 23)),
    # LLaSA-1B (Llama 3.2 1B) with its full head, V = 193,800 (the acceptance-step benchmark's largest shape).
    "llasa": Shape(2048, 16, 32, 8, 8192, 193797, (0,)),
    # For smoke tests only: seconds on one CPU core.
    "tiny": Shape(64, 2, 4, 2, 128, 61, (0,), text_vocab=50),
}

# The one law every compared system samples from: HF's top-k then top-p (what `generate` does with
# top_k=25, top_p=0.8), no stop tokens, so every run emits exactly the requested number of tokens.
LAW = SamplingConfig(top_k=25, top_p=0.8, nucleus="hf")
# CosyVoice 2's own law (RAS): its sampler cost is reported next to LAW's.
COSYVOICE_LAW = SamplingConfig(top_k=25, top_p=0.8, nucleus="cosyvoice", ras_window=10, ras_tau=0.1)


# --- models ------------------------------------------------------------------------------------
def build_models(shape: Shape, device: str, dtype: torch.dtype, seed: int = 0, head_std: float = 0.02):
    """A random CosyVoice 2-layout target and its layer-inheritance draft.

    The speech head's bias is zero so that a bias-free HF lm_head holds exactly the same function."""
    config = BackboneConfig(
        model_type="qwen2", vocab_size=shape.text_vocab, hidden_size=shape.hidden,
        intermediate_size=shape.intermediate, num_layers=shape.layers, num_heads=shape.heads,
        num_kv_heads=shape.kv_heads, head_dim=shape.hidden // shape.heads,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=True,
    )  # fmt: skip
    target = CosyVoice2LM(config, shape.speech_tokens)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        target.backbone.reset_parameters(generator, 0.02)
        target.llm_embedding.weight.normal_(0.0, 0.02, generator=generator)
        target.speech_embedding.weight.normal_(0.0, 0.02, generator=generator)
        target.llm_decoder.weight.normal_(0.0, head_std, generator=generator)
        target.llm_decoder.bias.zero_()
    target = target.to(device=device, dtype=dtype).eval()
    target.backbone.init_rope(device=device)
    return target, build_draft(target, shape.draft_layers)


def make_prompt(shape: Shape, context: int, batch: int = 1, seed: int = 1) -> CosyVoice2Prompt:
    """A prompt of `context` positions (sos + text + task_id + prompt speech), the same for every row."""
    g = torch.Generator().manual_seed(seed)
    n_text = max(1, min(40, context // 5))
    text = torch.randint(0, shape.text_vocab, (n_text,), generator=g)
    speech = torch.randint(0, shape.speech_tokens, (context - n_text - 2,), generator=g)
    return CosyVoice2Prompt([text] * batch, [speech] * batch, [n_text] * batch)


def hf_logits_match(target: CosyVoice2LM, hf, prompt) -> float:
    """Max |logit difference| between this engine's prefill and HF's forward on the same input embeddings
    (evidence that the two hold the same weights; ~1e-5 in float32)."""
    with torch.no_grad():
        embeds, _ = target.embed_prompt(prompt)
        ours = target.prefill(prompt, 1)[1]
        theirs = hf(inputs_embeds=embeds).logits[:, -1].float()
    return float((ours - theirs).abs().max())


# --- measuring ---------------------------------------------------------------------------------
def synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def median_seconds(fn, device, repeats: int) -> float:
    """Median wall time of fn() over `repeats` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


class HostSyncCounter(TorchFunctionMode):
    """Counts the torch calls that make the host wait for the device: reading a value (item, tolist,
    bool/int/float/index of a tensor, cpu, numpy) or an op whose output shape depends on the data
    (nonzero, one-argument where, masked_select, unique, indexing with a boolean mask).

    It sees what Python calls through torch's API (torch function overrides), so it counts the same
    on CPU and GPU; syncs inside a single C++ kernel launch are not visible to it."""

    READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"}
    DATA_SHAPED = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive"}

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.calls.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in self.READS or name in self.DATA_SHAPED:
            self.calls[name] += 1
        elif name == "where" and len(args) + len(kwargs) == 1:
            self.calls["where(cond)"] += 1
        elif name in ("__getitem__", "__setitem__") and _has_bool_index(args[1] if len(args) > 1 else None):
            self.calls[f"{name}[bool mask]"] += 1
        return func(*args, **kwargs)


class OpCounter(TorchFunctionMode):
    """Counts the torch calls Python makes (ops and tensor methods; reads of shape, dtype, device not counted).
    On a CPU at small shapes each costs microseconds whatever its size, so a round's count is much of its cost;
    the count is the same on any machine and under any load."""

    READS = {"__get__", "dim", "size", "numel", "__len__", "device"}

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") not in self.READS:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _has_bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


@contextmanager
def static_cache_path(*models):
    """Caches made inside are static (Backbone.static_step: fixed capacity, no host reads per step)."""
    backbones = [getattr(m, "model", m).backbone for m in models]
    before = [b.static_step for b in backbones]
    for b in backbones:
        b.static_step = True
    try:
        yield
    finally:
        for b, flag in zip(backbones, before):
            b.static_step = flag


def syncs_per_round(target, draft, prompt, tokens: int, draft_len: int) -> dict:
    """Host syncs of AR and speculative (exact rule) decoding, split into a cost per round and a fixed cost per
    decode: two decodes of exactly `tokens` and 2·`tokens` tokens give the slope and the intercept. AR's round
    is one token. No observer: the decode as a deployment runs it."""
    out = {}
    for mode in ("ar", "speculative"):
        counts = []
        for n in (tokens, 2 * tokens):
            request = Request(prompt, n, n, _generator("cpu"))
            with HostSyncCounter() as counter:
                if mode == "ar":
                    decode_ar(target, request, LAW)
                    rounds = n
                else:
                    rounds = decode_speculative(target, draft, request, LAW, ExactRule(), draft_len,
                                                Instruments(diagnostics=False)).stats.rounds  # fmt: skip
            counts.append((rounds, counter.total, dict(counter.calls.most_common())))
        (r1, s1, _), (r2, s2, by_call) = counts
        per_round = (s2 - s1) / max(1, r2 - r1)
        out[mode] = {"per_round": per_round, "per_decode": s2 - per_round * r2, "rounds": r2, "syncs": s2,
                     "by_call": by_call}  # fmt: skip
    return out


def _generator(device, seed: int = 0) -> torch.Generator:
    """The seed of a decode's per-row random streams (the engine draws them on `device` from it)."""
    return torch.Generator().manual_seed(seed)


def decode_seconds(fn):
    """A decoding call timed by the engine's own clock: fn() returns a DecodeResult (decoded with an Instruments
    observer without diagnostics); returns (seconds, result)."""

    def timed():
        result = fn()
        return result.stats.time_total, result

    return timed


def paired(baseline, candidate, repeats: int) -> dict:
    """Time candidate() beside baseline() `repeats` times after one warm-up of each, alternating which runs
    first; both return (seconds, anything). Speedup = Σ baseline / Σ candidate seconds with its 95 % CI
    (`ssd.evaluation.metrics.paired_speedup_ci`, as the evaluation runner computes it)."""
    baseline(), candidate()
    pairs, last = [], None
    for i in range(repeats):
        first, second = (baseline, candidate) if i % 2 == 0 else (candidate, baseline)
        a, b = first(), second()
        (base_s, _), (own_s, last) = (a, b) if first is baseline else (b, a)
        pairs.append({"baseline_lm_time": base_s, "lm_time": own_s})
    own = sorted(p["lm_time"] for p in pairs)
    base = sorted(p["baseline_lm_time"] for p in pairs)
    return {"speedup": paired_speedup(pairs), "speedup_ci": paired_speedup_ci(pairs), "n": repeats,
            "seconds": own[len(own) // 2], "baseline_seconds": base[len(base) // 2], "last": last}  # fmt: skip


def decode_room(tokens: int, max_draft_len: int, verify_rows: int | None = None) -> int:
    """Cache positions a speculative decode of `tokens` tokens reserves after the prompt (as
    decode_speculative computes it). Timing extend() with this room gives the cache the decodes' capacity,
    so a compiled step times the graphs the decodes replay."""
    return 2 * tokens + max(max_draft_len + 1, verify_rows or 0) + 1


def step_costs(model, prompt, blocks, device, repeats, room: int | None = None) -> dict[int, float]:
    """Seconds per extend() of each block size (then rolled back), at the prompt's context length.
    room: cache positions reserved after the prompt (a compiled step has one graph per cache capacity:
    pass the decodes' room to time the graphs they replay)."""
    cache, _ = model.prefill(prompt, room or max(blocks) + 8)
    costs = {}
    for k in blocks:
        tokens = torch.zeros(prompt.batch_size, k, dtype=torch.long, device=device)

        def call(tokens=tokens, k=k):
            model.extend(cache, tokens)
            model.rollback(cache, k)

        costs[k] = median_seconds(call, device, repeats)
    return costs


def sampler_costs(vocab: int, rows: list[int], device, repeats: int) -> list[dict]:
    """Seconds per distribution() + sample() over `rows` rows of random logits, for both laws."""
    g = torch.Generator().manual_seed(0)
    out = []
    for law_name, law in (("top-k/top-p", LAW), ("cosyvoice RAS", COSYVOICE_LAW)):
        for n in rows:
            logits = torch.randn(n, vocab, generator=g).to(device)
            window = torch.randint(0, vocab, (n, law.window), generator=g).to(device)
            step = torch.full((n,), 5, device=device)
            streams = RowRandom(range(n), device)  # made once per decode by the engine, not per step

            def call(logits=logits, window=window, step=step, law=law, streams=streams):
                sample(distribution(law, logits, window, step, 0), streams)

            out.append({"law": law_name, "rows": n, "ms": 1e3 * median_seconds(call, device, repeats)})
    return out


def hf_generate(hf, input_ids, tokens: int, device, assistant=None):
    """A call of HF generate for exactly `tokens` new tokens, returning (seconds, target forward calls)."""
    kwargs = dict(
        input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=tokens,
        min_new_tokens=tokens, do_sample=True, top_k=LAW.top_k, top_p=LAW.top_p, temperature=1.0,
        pad_token_id=0, eos_token_id=None, assistant_model=assistant,
    )  # fmt: skip

    def call():
        calls = [0]
        hook = hf.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        try:
            with torch.no_grad():
                synchronize(device)
                start = time.perf_counter()
                out = hf.generate(**kwargs)
                synchronize(device)
                seconds = time.perf_counter() - start
        finally:
            hook.remove()
        if out.shape[1] - input_ids.shape[1] != tokens:
            raise RuntimeError(
                f"HF generate emitted {out.shape[1] - input_ids.shape[1]} tokens, not {tokens}"
            )
        return seconds, calls[0]

    return call


def median_run(call, repeats: int):
    """(median seconds, the last run's second value) of call() -> (seconds, x) over `repeats` runs after a
    warm-up."""
    call()
    runs = [call() for _ in range(repeats)]
    return sorted(r[0] for r in runs)[len(runs) // 2], runs[-1][1]


def pin_assistant(assistant, draft_len: int | None) -> None:
    """HF's draft length: transformers 5.x defaults to up to 20 tokens per round, stopping early once the
    assistant's probability of its own token falls below assistant_confidence_threshold (0.4, re-tuned
    each round when scikit-learn is installed). draft_len pins it to exactly draft_len tokens a round;
    None restores those defaults."""
    config = assistant.generation_config
    if draft_len is None:
        config.num_assistant_tokens, config.num_assistant_tokens_schedule = 20, "constant"
        config.assistant_confidence_threshold = 0.4
    else:
        config.num_assistant_tokens, config.num_assistant_tokens_schedule = draft_len, "constant"
        config.assistant_confidence_threshold = 0.0


# --- one shape ---------------------------------------------------------------------------------
def bench_shape(name: str, args, log=print) -> dict:
    shape = SHAPES[name]
    device, dtype, tokens, repeats = args.device, getattr(torch, args.dtype), args.tokens, args.repeats
    draft_lens = [int(k) for k in args.draft_lens.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    alphas = [float(a) for a in args.alphas.split(",")]
    target, draft = build_models(shape, device, dtype)
    prompt = make_prompt(shape, args.context)
    res: dict = {"shape": name, "architecture": vars(shape) | {"vocab": target.vocab_size}, "context": args.context,
                 "tokens": tokens, "device": device, "dtype": args.dtype}  # fmt: skip

    parts = args.parts
    if "syncs" in parts:
        log(f"[{name}] host syncs per round")
        res["syncs"] = {"eager cache path": syncs_per_round(target, draft, prompt, min(tokens, 24), 3)}
        with static_cache_path(target, draft):  # the cache path a compiled step uses, here without compiling
            res["syncs"]["static cache path"] = syncs_per_round(target, draft, prompt, min(tokens, 24), 3)

    if args.compile:  # after the sync count: a function mode over a compiled step would recompile it
        log(f"[{name}] compiling the decode steps (mode {args.compile_mode})")
        target.compile_decoding(mode=args.compile_mode)
        draft.compile_decoding(mode=args.compile_mode)
    res["engine"] = f"compiled ({args.compile_mode})" if args.compile else "eager"

    log(f"[{name}] per-call costs")
    blocks = sorted({1, args.drafter_len + 1, *(k + 1 for k in draft_lens),
                     *([args.verify_rows] if args.verify_rows else [])})  # fmt: skip
    room = decode_room(tokens, max(draft_lens), args.verify_rows)
    t_cost = step_costs(target, prompt, blocks, device, max(3, 3 * repeats), room)
    d_cost = step_costs(draft.model, prompt, [1], device, max(3, 3 * repeats), room)
    c = d_cost[1] / t_cost[1]
    res["costs"] = {"target_ms": {k: 1e3 * v for k, v in t_cost.items()}, "draft_decode_ms": 1e3 * d_cost[1],
                    "c": c, "v": {k - 1: t_cost[k] / t_cost[1] for k in blocks if k > 1}}  # fmt: skip

    if "sampler" in parts:
        log(f"[{name}] sampler cost")
        rows = sorted({b * m for b in batches for m in (1, *(k + 1 for k in draft_lens))})
        res["sampler"] = sampler_costs(target.vocab_size, rows, device, max(3, 3 * repeats))

    log(f"[{name}] AR: this engine vs HF generate")
    engine_ar = decode_seconds(lambda: decode_ar(target, Request(prompt, tokens, tokens, _generator(device)), LAW,
                                                 Instruments(diagnostics=False)))  # fmt: skip
    hf = None  # HF's side: the same weights as HF causal LMs, their AR call and its prompt ids
    if args.no_hf or not {"ar", "speculative", "batch"} & parts:
        ar_s, _ = median_run(engine_ar, repeats)
        res["ar"] = {"engine_tokens_per_s": tokens / ar_s, "engine_s": ar_s}
    else:
        input_ids = torch.randint(
            0, shape.speech_tokens, (1, args.context), generator=torch.Generator().manual_seed(1)
        ).to(device)
        hf = {"model": hf_causal_lm(target), "draft": hf_causal_lm(draft.model), "input_ids": input_ids}
        hf["ar"] = hf_generate(hf["model"], input_ids, tokens, device)
        versus = paired(hf["ar"], engine_ar, repeats)  # the engine's AR timed beside HF generate
        ar_s, hf_s = versus["seconds"], versus["baseline_seconds"]
        res["ar"] = {"engine_tokens_per_s": tokens / ar_s, "engine_s": ar_s, "hf_tokens_per_s": tokens / hf_s,
                     "hf_s": hf_s, "engine_vs_hf": versus["speedup"], "engine_vs_hf_ci": versus["speedup_ci"],
                     "pairs": repeats, "hf_max_abs_logit_diff": hf_logits_match(target, hf["model"], prompt)}  # fmt: skip

    if "speculative" in parts:
        log(f"[{name}] speculative: exact rule vs HF assisted; synthetic α")
        res["speculative"] = speculative_rows(target, draft, prompt, engine_ar, t_cost, c, hf, args, draft_lens,
                                              alphas)  # fmt: skip
    if "drafters" in parts:
        log(f"[{name}] drafter families (SYNTHETIC α, L_d = {args.drafter_len})")
        res["drafters"] = drafter_rows(target, draft, prompt, engine_ar, t_cost, alphas, args, tokens, device)
    if "batch" in parts:
        log(f"[{name}] batch throughput")
        res["batch"] = batch_rows(shape, target, draft, hf, args, draft_lens, batches, alphas)
    return res


def speculative_rows(target, draft, prompt, engine_ar, t_cost, c, hf, args, draft_lens, alphas) -> list[dict]:
    """This engine under the exact rule and SYNTHETIC α at each L_d (and padded verify rows), and HF assisted
    generation (`hf`: HF's side, None to skip it), each timed beside its own AR."""
    device, tokens, repeats = args.device, args.tokens, args.repeats
    runs = []
    rules = [("exact (random-weight α)", ExactRule())] + [
        (f"SYNTHETIC α={a}", SyntheticRule(a)) for a in alphas
    ]
    paddings = [None, args.verify_rows] if args.verify_rows else [None]
    for label, rule in rules:
        for k, rows in itertools.product(draft_lens, paddings):
            if rows is not None and rows <= k + 1:
                continue
            verifier = target if rows is None else PaddedVerify(target, rows)
            timed = paired(engine_ar, decode_seconds(
                lambda rule=rule, k=k, verifier=verifier: decode_speculative(
                    verifier, draft, Request(prompt, tokens, tokens, _generator(device)), LAW, rule, k,
                    Instruments(diagnostics=False))), repeats)  # fmt: skip
            result = timed["last"]
            alpha = result.stats.acceptance_rate
            predicted = expected_tokens_per_round(alpha, k) / (k * c + t_cost[rows or k + 1] / t_cost[1])
            runs.append({"system": "engine", "rule": label, "draft_len": k if rows is None else f"{k} (verify {rows} rows)",
                         "tokens_per_s": tokens / timed["seconds"], "speedup": timed["speedup"],
                         "speedup_ci": timed["speedup_ci"], "pairs": repeats, "predicted": predicted, "alpha": alpha,
                         "tokens_per_target_forward": tokens / (result.stats.target_calls + 1)})  # fmt: skip
    if hf is not None:
        for k in [*draft_lens, None]:
            pin_assistant(hf["draft"], k)
            timed = paired(hf["ar"], hf_generate(hf["model"], hf["input_ids"], tokens, device, assistant=hf["draft"]),
                           repeats)  # fmt: skip
            runs.append({"system": "HF assisted", "rule": "HF speculative sampling (random-weight α)",
                         "draft_len": k if k is not None else "HF default", "tokens_per_s": tokens / timed["seconds"],
                         "speedup": timed["speedup"], "speedup_ci": timed["speedup_ci"], "pairs": repeats,
                         "tokens_per_target_forward": tokens / max(1, timed["last"])})  # fmt: skip
    return runs


def batch_rows(shape, target, draft, hf, args, draft_lens, batches, alphas) -> list[dict]:
    """Tokens/s of all rows at each batch size: the engine's AR and speculative decodes, HF generate."""
    device, tokens, repeats = args.device, args.tokens, args.repeats
    out = []
    k_batch = 3 if 3 in draft_lens else draft_lens[0]
    for b in batches:
        batch_prompt = make_prompt(shape, args.context, b)
        row = {"batch": b}
        ar_b, _ = median_run(decode_seconds(lambda p=batch_prompt: decode_ar(
            target, Request(p, tokens, tokens, _generator(device)), LAW, Instruments(diagnostics=False))), repeats)  # fmt: skip
        sp_b, _ = median_run(decode_seconds(lambda p=batch_prompt: decode_speculative(
            target, draft, Request(p, tokens, tokens, _generator(device)), LAW, SyntheticRule(max(alphas)), k_batch,
            Instruments(diagnostics=False))), repeats)  # fmt: skip
        row |= {"engine_ar_tokens_per_s": b * tokens / ar_b,
                f"engine_speculative_tokens_per_s (SYNTHETIC α={max(alphas)}, L_d={k_batch})": b * tokens / sp_b}  # fmt: skip
        if hf is not None:
            ids = hf["input_ids"].expand(b, -1).contiguous()
            hf_b, _ = median_run(hf_generate(hf["model"], ids, tokens, device), repeats)
            row["hf_generate_tokens_per_s"] = b * tokens / hf_b
        out.append(row)
    return out


def drafter_rows(target, draft, prompt, engine_ar, t_cost, alphas, args, tokens: int, device) -> list[dict]:
    """Each drafter family on this target at L_d = --drafter-len under SYNTHETIC α, timed beside AR: measured
    speedup [CI], the drafter's own cost per round in target calls (its phase clock / rounds / decode(1)) and the
    speedup that cost predicts, E(α, L_d) / (d + v)."""
    k = args.drafter_len
    with OpCounter() as ops:
        decode_ar(target, Request(prompt, tokens, tokens, _generator(device)), LAW)
    ar_ops = ops.calls / tokens
    families = {"layers (SSD)": draft, "medusa heads": HeadsDrafter(target, heads=k, kind="medusa"),
                "mtp heads": HeadsDrafter(target, heads=k, kind="mtp"), "eagle (feature)": FeatureDrafter(target),
                "block (parallel)": BlockDrafter(target, layers=2, block=k)}  # fmt: skip
    rows = []
    for label, drafter in families.items():
        with OpCounter() as ops:  # an untimed decode: what one round asks of torch, in AR tokens' worth
            rounds = decode_speculative(target, drafter, Request(prompt, tokens, tokens, _generator(device)), LAW,
                                        SyntheticRule(alphas[-1]), k, Instruments(diagnostics=False)).stats.rounds  # fmt: skip
        for alpha in alphas:
            timed = paired(engine_ar, decode_seconds(lambda drafter=drafter, alpha=alpha: decode_speculative(
                target, drafter, Request(prompt, tokens, tokens, _generator(device)), LAW, SyntheticRule(alpha), k,
                Instruments(diagnostics=False))), args.repeats)  # fmt: skip
            stats = timed["last"].stats
            d = stats.time_draft / max(1, stats.rounds) / t_cost[1]
            predicted = expected_tokens_per_round(stats.acceptance_rate, k) / (d + t_cost[k + 1] / t_cost[1])
            rows.append({"drafter": label, "alpha": stats.acceptance_rate, "draft_len": k, "draft_per_round": d,
                         "speedup": timed["speedup"], "speedup_ci": timed["speedup_ci"], "pairs": args.repeats,
                         "predicted": predicted, "tokens_per_s": tokens / timed["seconds"],
                         "ops_per_round": ops.calls / rounds / ar_ops})  # fmt: skip
    return rows


# --- output ------------------------------------------------------------------------------------
def _table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def _f(x, digits: int = 2) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _ci(value, ci, digits: int = 2) -> str:
    return f"{_f(value, digits)} [{_f(ci[0], digits)}, {_f(ci[1], digits)}]"


def markdown(results: dict) -> str:
    out = [f"# Decoding benchmark\n\n`{results['command']}`\n\n{results['machine']}; git {results['git']}.",
           "Random weights: α of the exact rule is that of a random draft; SYNTHETIC rows fix α by construction "
           "(their output is not a sample of the target). Columns: docs/benchmarks.md."]  # fmt: skip
    for res in results["shapes"]:
        a, cost = res["architecture"], res["costs"]
        out.append(f"\n## {res['shape']}: hidden {a['hidden']}, {a['layers']} layers, {a['heads']}/{a['kv_heads']} "
                   f"heads, ff {a['intermediate']}, V = {a['vocab']}; draft layers {list(a['draft_layers'])}; "
                   f"context {res['context']}, {res['tokens']} tokens, {res['dtype']} on {res['device']}, "
                   f"engine {res['engine']}")  # fmt: skip
        out.append("\n### Per-call cost\n")
        out.append(_table(["call", "ms", "ratio to target decode(1)"],
                          [[f"target {'decode(1)' if k == 1 else f'verify({k})'}", _f(ms), _f(ms / cost['target_ms'][1])]
                           for k, ms in cost["target_ms"].items()]
                          + [["draft decode(1)", _f(cost["draft_decode_ms"]), f"c = {_f(cost['c'], 3)}"]]))  # fmt: skip
        if "sampler" in res:
            out.append("\n### Sampler (distribution + sample) per step\n")
            out.append(
                _table(["law", "rows", "ms"], [[s["law"], s["rows"], _f(s["ms"], 3)] for s in res["sampler"]])
            )
        rows = []
        for path_name, per_mode in res.get("syncs", {}).items():
            for mode, s in per_mode.items():
                calls = ", ".join(f"{k} {v}" for k, v in s["by_call"].items())
                rows.append([path_name, mode, _f(s["per_round"], 1), _f(s["per_decode"], 1), calls])
        if rows:
            out.append("\n### Host syncs per round\n")
            out.append(
                _table(
                    ["cache path", "decode", "syncs / round", "+ syncs / decode", "calls (longer decode)"],
                    rows,
                )
            )
        ar = res["ar"]
        out.append("\n### AR, batch 1\n")
        line = f"this engine {_f(ar['engine_tokens_per_s'], 1)} tokens/s (median)"
        if "hf_tokens_per_s" in ar:
            line += (f"; HF generate {_f(ar['hf_tokens_per_s'], 1)} tokens/s; engine/HF {_ci(ar['engine_vs_hf'], ar['engine_vs_hf_ci'])}× "
                     f"({ar['pairs']} pairs timed side by side); same weights: max |Δ logit| "
                     f"{ar['hf_max_abs_logit_diff']:.1e}")  # fmt: skip
        out.append(line)
        if "speculative" in res:
            out.append(
                "\n### Speculative, batch 1 (speedup vs the same system's AR, timed side by side, 95 % CI)\n"
            )
            out.append(_table(
            ["system", "rule", "L_d", "tokens/s", "α", "tokens / target forward", "speedup [95% CI]", "pairs",
             "predicted", "meas/pred [95% CI]"],
            [[r["system"], r["rule"], r["draft_len"], _f(r["tokens_per_s"], 1), _f(r.get("alpha")),
              _f(r["tokens_per_target_forward"]), _ci(r["speedup"], r["speedup_ci"]), r["pairs"], _f(r.get("predicted")),
              _ci(r["speedup"] / r["predicted"], [x / r["predicted"] for x in r["speedup_ci"]]) if r.get("predicted") else "—"]
             for r in res["speculative"]],
            ))  # fmt: skip
        if "drafters" in res:
            out.append(
                "\n### Drafter families, batch 1, SYNTHETIC α (speedup vs AR timed side by side, 95 % CI)\n"
            )
            out.append(_table(
            ["drafter", "α", "L_d", "drafting / round (target calls)", "torch calls / round (AR step = 1)", "tokens/s",
             "speedup [95% CI]", "pairs", "predicted", "meas/pred [95% CI]"],
            [[r["drafter"], _f(r["alpha"]), r["draft_len"], _f(r["draft_per_round"], 3), _f(r.get("ops_per_round")),
              _f(r["tokens_per_s"], 1),
              _ci(r["speedup"], r["speedup_ci"]), r["pairs"], _f(r["predicted"]),
              _ci(r["speedup"] / r["predicted"], [x / r["predicted"] for x in r["speedup_ci"]])]
             for r in res["drafters"]],
            ))  # fmt: skip
        if "batch" in res:
            out.append("\n### Batch throughput (tokens/s, all rows)\n")
            keys = [k for k in res["batch"][0] if k != "batch"]
            out.append(
                _table(
                    ["batch", *keys], [[r["batch"], *(_f(r.get(k), 1) for k in keys)] for r in res["batch"]]
                )
            )
    return "\n".join(out) + "\n"


def figure(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = results["shapes"]
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4), squeeze=False)
    for ax, res in zip(axes[0], shapes):
        engine_runs = [r for r in res.get("speculative", []) if r["system"] == "engine"]
        for i, rule in enumerate(dict.fromkeys(r["rule"] for r in engine_runs)):
            runs = [r for r in engine_runs if r["rule"] == rule and isinstance(r["draft_len"], int)]
            ks = [r["draft_len"] for r in runs]
            speedups = [r["speedup"] for r in runs]
            err = [[v - r["speedup_ci"][0] for v, r in zip(speedups, runs)],
                   [r["speedup_ci"][1] - v for v, r in zip(speedups, runs)]]  # fmt: skip
            ax.errorbar(
                ks, speedups, yerr=err, fmt="o-", capsize=3, color=f"C{i}", label=f"{rule} measured (95% CI)"
            )
            ax.plot(ks, [r["predicted"] for r in runs], "x--", color=f"C{i}", label=f"{rule} predicted")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set(
            title=f"{res['shape']} ({res['dtype']}, {res['device']})", xlabel="L_d", ylabel="speedup vs AR"
        )
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def machine(device: str) -> str:
    if torch.device(device).type == "cuda":
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    return f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads, torch {torch.__version__}"


def git_commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], check=True,
                              capture_output=True, text=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--shape", choices=[*SHAPES, "both"], default="both", help="both = toy and cosyvoice2"
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: few tokens, two repeats, L_d 1-2, batch 1-2"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO / "experiments" / "results" / "bench_decoding",
        help="directory for results.json, results.md, speedup.png",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--context", type=int, default=200, help="prompt positions before decoding")
    parser.add_argument("--tokens", type=int, default=100, help="tokens generated per row and run")
    parser.add_argument("--draft-lens", default="1,2,3,4,5")
    parser.add_argument("--alphas", default="0.6,0.7,0.8", help="SYNTHETIC acceptance rates")
    parser.add_argument("--batches", default="1,4,8")
    parser.add_argument("--drafter-len", type=int, default=3, help="L_d of the drafter-family rows")
    parser.add_argument("--repeats", type=int, default=10,
                        help="timings per setting: pairs (alternating order) for a speedup, the median otherwise")  # fmt: skip
    parser.add_argument(
        "--verify-rows", type=int, help="also run the engine with verify calls padded to this many rows"
    )
    parser.add_argument("--compile", action="store_true",
                        help="time the engine with its compiled decode step (compile_decoding; CUDA)")  # fmt: skip
    parser.add_argument("--compile-mode", default="reduce-overhead", help="torch.compile mode for --compile")
    parser.add_argument("--threads", type=int, help="torch CPU threads")
    parser.add_argument("--no-hf", action="store_true", help="skip the HF generate / assisted rows")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated sections to run (per-call costs and AR always): {','.join(PARTS)}")  # fmt: skip
    args = parser.parse_args(argv)
    if args.quick:
        args.context, args.tokens, args.repeats = min(args.context, 32), min(args.tokens, 12), 2
        args.draft_lens, args.alphas, args.batches, args.drafter_len = "1,2", "0.8", "1,2", 2
    args.parts = set(filter(None, args.parts.split(",")))
    if args.parts - set(PARTS):
        parser.error(f"--parts: unknown {sorted(args.parts - set(PARTS))}; choose from {','.join(PARTS)}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    names = ["toy", "cosyvoice2"] if args.shape == "both" else [args.shape]
    command = "python scripts/bench_decoding.py " + " ".join(sys.argv[1:] if argv is None else argv)
    results = {"command": command.strip(), "machine": machine(args.device), "git": git_commit(),
               "law": repr(LAW), "shapes": []}  # fmt: skip
    for name in names:
        results["shapes"].append(bench_shape(name, args, log=lambda m: print(m, flush=True)))
    args.out.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out / "results.json", json.dumps(results, indent=2, default=str))
    write_atomic(args.out / "results.md", markdown(results))
    written = ["results.json", "results.md"]
    if any("speculative" in res for res in results["shapes"]):  # the figure plots the speculative rows
        figure(results, args.out / "speedup.png")
        written.append("speedup.png")
    print(markdown(results))
    print(f"wrote {', '.join(f'{args.out}/{name}' for name in written)}")
    return results


if __name__ == "__main__":
    main()
