"""Print the chi-square statistics behind tests/test_speculative.py: the first-3-token joint law of
speculative decoding vs the enumerated AR law (positives), and the broken variants the tests must
reject (negative controls). Uses the test module's own models and functions.

    python scripts/chi_square_report.py
"""

import sys

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "tests"))

import test_speculative as T

import ssd.decoding.generate as generate
from ssd.decoding.acceptance import ExactRule, TargetOnlyRule, ToleranceRule

target, _ = T.trigram_pair(T.VOCAB, seed=2, draft_noise=1.5)
laws = {"plain": T.exact_joint_law(target, T.PLAIN), "ras": T.exact_joint_law(target, T.RAS)}


stat = T.chi_square

rows = []
for name in ("plain", "ras"):
    for rule in (ExactRule(), ToleranceRule(0.0), TargetOnlyRule()):
        s = stat(T.spec_samples(T.CONFIGS[name], rule, 3), laws[name])
        rows.append((f"{rule!r} L_d=3 {name}", *s))
rows.append(
    (
        "NEG resample from q (L_d=2, plain)",
        *stat(T.spec_samples(T.PLAIN, T.ResampleFromTarget(), 2), laws["plain"]),
    )
)
rows.append(
    (
        "NEG softmax residual (L_d=2, plain)",
        *stat(T.spec_samples(T.PLAIN, T.SoftmaxResidual(), 2), laws["plain"]),
    )
)
rows.append(
    (
        "NEG tolerance beta=0.4 (L_d=2, plain)",
        *stat(T.spec_samples(T.PLAIN, ToleranceRule(0.4), 2), laws["plain"]),
    )
)
no_ras = T.SamplingConfig(top_k=3, top_p=0.9, nucleus="cosyvoice", stop_tokens=(T.EOS,))
rows.append(
    (
        "NEG plain top-k/top-p verifier vs RAS target",
        *stat(T.spec_samples(no_ras, ExactRule(), 3), laws["ras"]),
    )
)
real_w = generate.verification_windows
generate.verification_windows = lambda lw, dt, w: lw.unsqueeze(1).expand(-1, dt.shape[1] + 1, -1)
rows.append(
    ("NEG RAS window without draft tokens", *stat(T.spec_samples(T.RAS, ExactRule(), 3), laws["ras"]))
)
generate.verification_windows = real_w
real_d = generate.draft_token


def greedy_softmax(cfg, logits, window, step, min_len, g):
    _, law = real_d(cfg, logits, window, step, min_len, g)
    return law.argmax(-1), law


generate.draft_token = greedy_softmax
rows.append(
    ("NEG greedy draft with softmax p", *stat(T.spec_samples(T.PLAIN, ExactRule(), 2), laws["plain"]))
)
generate.draft_token = real_d
print("| variant | chi2 | df | p |\n|---|---|---|---|")
for n, c, df, p in rows:
    print(f"| {n} | {c:.1f} | {df} | {p:.3g} |")
