"""Speech tokens -> waveform (`ssd.contracts.Vocoder`: `vocode(tokens, prompt) -> wav` at `sample_rate`).

Backends (Hydra `_target_`s in configs/vocoder/):
  (the toy world's vocoder is ssd.toy_world.codec.ToyVocoder)
  cosyvoice2  CosyVoice 2's flow matching + HiFT, imported from a user-provided CosyVoice checkout
              (`vocoder.cosyvoice_repo=`) with the model dir (`vocoder.model_dir=`). It follows upstream's
              zero-shot path: the flow is conditioned on the prompt's speech tokens, its 24 kHz mel and its
              CAM++ embedding (`frontend_zero_shot`), then `model.token2wav(..., token_offset=0, finalize=True)`.

Each constructor checks its paths before importing anything heavy, so a runner fails fast.
"""

from __future__ import annotations

import inspect
import sys
import uuid
from pathlib import Path

import numpy as np

from ssd.audio.features import resample
from ssd.contracts import VocoderPrompt


class CosyVoice2Vocoder:
    """CosyVoice 2 flow + HiFT from a CosyVoice checkout (the LM is ours; only token2wav is upstream's)."""

    def __init__(
        self, cosyvoice_repo: str | Path | None, model_dir: str | Path | None, fp16: bool = False
    ) -> None:
        for key, value in (("cosyvoice_repo", cosyvoice_repo), ("model_dir", model_dir)):
            if value is None:
                raise ValueError(
                    f"vocoder.{key} is not set (vocoder=cosyvoice2; COSYVOICE_REPO / target.model.model_dir)"
                )
        repo, model_dir = Path(cosyvoice_repo), Path(model_dir)
        for path in (
            repo / "cosyvoice" / "cli" / "cosyvoice.py",
            model_dir / "flow.pt",
            model_dir / "hift.pt",
        ):
            if not path.is_file():
                raise FileNotFoundError(
                    f"{path} not found: vocoder=cosyvoice2 needs vocoder.cosyvoice_repo=<a CosyVoice git checkout> "
                    "and vocoder.model_dir=<CosyVoice2-0.5B dir with flow.pt, hift.pt, campplus.onnx>"
                )
        for extra in (repo, repo / "third_party" / "Matcha-TTS"):  # upstream's own import setup
            if str(extra) not in sys.path:
                sys.path.insert(0, str(extra))
        import torch
        from cosyvoice.cli.cosyvoice import CosyVoice2

        self._torch = torch
        self.model = CosyVoice2(str(model_dir), load_jit=False, load_trt=False, fp16=fp16)
        self.sample_rate = int(self.model.sample_rate)

    def vocode(self, tokens: np.ndarray, prompt: VocoderPrompt) -> np.ndarray:
        torch = self._torch
        speech_16k = torch.from_numpy(resample(prompt.wav, prompt.sample_rate, 16_000))[None]
        # The flow's conditioning exactly as upstream's zero-shot inference builds it (tts text unused here).
        # Upstream added a 5th argument (zero_shot_spk_id) in 2025; pass it only where it exists.
        frontend = self.model.frontend.frontend_zero_shot
        extra = ("",) if "zero_shot_spk_id" in inspect.signature(frontend).parameters else ()
        inputs = frontend("", prompt.text, speech_16k, self.sample_rate, *extra)
        session = str(uuid.uuid1())
        self.model.model.hift_cache_dict[session] = None
        try:
            wav = self.model.model.token2wav(
                token=torch.as_tensor(np.asarray(tokens), dtype=torch.int32)[None],
                prompt_token=torch.as_tensor(np.asarray(prompt.tokens), dtype=torch.int32)[None],
                prompt_feat=inputs["prompt_speech_feat"],
                embedding=inputs["flow_embedding"],
                token_offset=0,
                uuid=session,
                finalize=True,
            )
        finally:
            self.model.model.hift_cache_dict.pop(session, None)
        return wav.squeeze(0).float().cpu().numpy()
