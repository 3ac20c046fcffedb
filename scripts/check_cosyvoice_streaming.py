#!/usr/bin/env python
"""Does the vocoder's streaming equal the checkout's own tts(stream=True) for the same tokens? One command.

  python scripts/check_cosyvoice_streaming.py --repo /src/CosyVoice --model-dir /models/CosyVoice2-0.5B
  python scripts/check_cosyvoice_streaming.py --repo ... --model-dir /models/Fun-CosyVoice3-0.5B --model-class CosyVoice3

Both sides get the same prompt conditioning (the checkout's own frontend on --prompt-wav, default a 3 s tone)
and the same speech tokens (--tokens random codes, seeded). Ours: `CosyVoice2Vocoder.stream`, the tokens pushed
in random splits of 1-9 (as speculative rounds deliver them). Upstream's: the checkout's `tts(stream=True)`
generator with its LM thread replaced (`llm_job` does nothing) and its 0.1 s poll (`time.sleep` in
cosyvoice/cli/model.py) handing it --per-poll tokens each time, so its loop sees an LM that emits tokens as it
polls. Prints the chunk lengths of both and the largest sample difference; exits 1 when they differ. The token2wav
runs in this process (the checkout's requirements installed here). tests/test_cosyvoice_pipeline.py runs the same
comparison on stand-in checkouts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing


class _Poll:
    """Stands in for the `time` module of cosyvoice/cli/model.py: its sleep (the loop's poll) hands the session
    the next tokens, as if the LM had emitted them meanwhile; everything else is the real module's."""

    def __init__(self, real: Any, model: Any, tokens: list[int], per_poll: int) -> None:
        self.real, self.model, self.tokens, self.per_poll = real, model, tokens, per_poll

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def sleep(self, seconds: float) -> None:
        (session,) = self.model.tts_speech_token_dict  # one tts call at a time
        got = self.model.tts_speech_token_dict[session]
        got.extend(self.tokens[len(got) : len(got) + self.per_poll])
        if len(got) == len(self.tokens):
            self.model.llm_end_dict[session] = True


def upstream_tts_stream(
    model: Any, tokens, prompt_tokens, feat, embedding, per_poll: int = 1
) -> list[np.ndarray]:
    """The chunks of the checkout's own `model.tts(stream=True)` for `tokens` (its LM replaced as above)."""
    import torch

    module = sys.modules[type(model).tts.__module__]
    real_time, tokens = module.time, [int(t) for t in tokens]
    model.llm_job = lambda *args, **kwargs: None  # the LM thread: the tokens come from the poll instead
    module.time = _Poll(real_time, model, tokens, per_poll)
    try:
        with torch.no_grad():
            outputs = list(model.tts(
                flow_embedding=torch.from_numpy(np.ascontiguousarray(embedding, dtype=np.float32)),
                flow_prompt_speech_token=torch.as_tensor(np.asarray(prompt_tokens), dtype=torch.int32)[None],
                prompt_speech_feat=torch.from_numpy(np.ascontiguousarray(feat, dtype=np.float32)),
                stream=True,
            ))  # fmt: skip
    finally:
        module.time = real_time
        del model.llm_job
    return [out["tts_speech"].squeeze(0).float().cpu().numpy() for out in outputs]


def ours(vocoder: Any, tokens: np.ndarray, prompt: Any, seed: int) -> list[np.ndarray]:
    """`vocoder.stream(prompt)` with the tokens pushed in random splits of 1-9."""
    rng, session, chunks, at = np.random.default_rng(seed), vocoder.stream(prompt), [], 0
    while at < len(tokens):
        n = int(rng.integers(1, 10))
        chunks += session.push(tokens[at : at + n])
        at += n
    return chunks + session.finish()


def compare(
    vocoder: Any, tokens: np.ndarray, prompt: Any, per_poll: int = 1, seed: int = 0
) -> dict[str, Any]:
    """Both sides' chunks for the same tokens and prompt: lengths, the largest difference, whether equal."""
    mine = ours(vocoder, tokens, prompt, seed)
    prompt_tokens, feat, embedding = vocoder._prepared(prompt)
    theirs = upstream_tts_stream(vocoder.engine.model, tokens, prompt_tokens, feat, embedding, per_poll)
    same_shape = [c.shape for c in mine] == [c.shape for c in theirs]
    diff = max((float(np.abs(a - b).max()) for a, b in zip(mine, theirs) if a.size), default=0.0)
    return {
        "chunks_ours": [int(c.size) for c in mine],
        "chunks_upstream": [int(c.size) for c in theirs],
        "max_abs_difference": diff if same_shape else None,
        "equal": bool(same_shape and all(np.array_equal(a, b) for a, b in zip(mine, theirs))),
        "schedule": vocoder.streaming,
    }


def main(argv: list[str] | None = None) -> int:
    from ssd.audio.features import load_audio
    from ssd.audio.vocoder import CosyVoice2Vocoder
    from ssd.contracts import VocoderPrompt

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", required=True, help="a FunAudioLLM/CosyVoice checkout")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--model-class", default="CosyVoice2", choices=["CosyVoice2", "CosyVoice3"])
    parser.add_argument("--prompt-wav", help="prompt audio (default: a 3 s 220 Hz tone at 24 kHz)")
    parser.add_argument("--prompt-text", default="a prompt")
    parser.add_argument("--tokens", type=int, default=120, help="speech tokens to synthesise (random codes)")
    parser.add_argument("--per-poll", type=int, default=1, help="tokens upstream's loop finds at each poll")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.prompt_wav:
        wav, sr = load_audio(args.prompt_wav, None)
    else:
        sr = 24_000
        wav = (0.3 * np.sin(2 * np.pi * 220 * np.arange(3 * sr) / sr)).astype(np.float32)
    rng = np.random.default_rng(args.seed)
    vocoder = CosyVoice2Vocoder(args.repo, args.model_dir, model_class=args.model_class)
    codes = vocoder.codebook_size
    prompt = VocoderPrompt(
        wav, sr, args.prompt_text, rng.integers(0, codes, int(np.ceil(len(wav) * 25 / sr)))
    )
    result = compare(vocoder, rng.integers(0, codes, args.tokens), prompt, args.per_poll, args.seed)
    print(json.dumps(result, indent=1))
    return 0 if result["equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
