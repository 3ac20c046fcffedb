"""Drafter families: what proposes draft tokens to the speculative loop (`ssd.contracts.Drafter`).

- `autoregressive`: any SpeechLM run token by token (the session every model-based drafter uses);
- `layers`: SSD's and PCG's drafter, a subset of the target's own layers (`build_draft`);
- `heads`: Medusa heads or MTP modules on the target's last hidden state;
- `eagle`: an EAGLE-style one-layer drafter on fused target features (low, middle, top layers);
- `block`: a parallel block drafter that fills a whole block of masked positions in one call.

Each family is a `_target_` in configs/draft/ and trains with `train_draft.py draft=<name>`.
"""
