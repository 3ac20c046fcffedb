"""Speech tokens -> waveform (`ssd.contracts.Vocoder`: `vocode(tokens, prompt) -> wav` at `sample_rate`).

Backends (Hydra `_target_`s in configs/vocoder/):
  (the toy world's vocoder is ssd.toy_world.codec.ToyVocoder)
  cosyvoice2  CosyVoice 2's flow matching + HiFT, imported from a user-provided CosyVoice checkout
              (`vocoder.cosyvoice_repo=`) with the model dir (`vocoder.model_dir=`). It follows upstream's
              zero-shot path (docs/target-cosyvoice2.md): the checkout's own `frontend_zero_shot` builds the
              flow's conditioning (24 kHz mel, CAM++ embedding) once per prompt, the prompt tokens are cut to
              half the mel's frames as upstream's frontend cuts them, then `model.token2wav(...,
              token_offset=0, finalize=True)`.

Each constructor checks its paths before importing anything heavy, so a runner fails fast.
"""

from __future__ import annotations

import hashlib
import inspect
import sys
import tempfile
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from ssd.audio.features import resample
from ssd.contracts import VocoderPrompt

# Upstream's frontend_zero_shot generations (FunAudioLLM/CosyVoice, cosyvoice/cli/frontend.py), told apart by
# the name of the prompt-audio parameter: a 16 kHz tensor up to 622a3a1^, a wav path from 622a3a1 on.
TENSOR_API = "prompt_speech_16k"
PATH_API = "prompt_wav"
SUPPORTED_FRONTENDS = (
    "frontend_zero_shot(tts_text, prompt_text, prompt_speech_16k, resample_rate[, zero_shot_spk_id]) "
    "[a 16 kHz tensor; upstream c693039 (2024-12-12) up to the parent of 622a3a1] or "
    "frontend_zero_shot(tts_text, prompt_text, prompt_wav, resample_rate, zero_shot_spk_id) "
    "[a wav path; upstream 622a3a1 (2025-12-08) on]"
)
# Upstream's path loader refuses audio below 16 kHz (load_wav's min_sr); lower rates are raised to it first.
PATH_API_MIN_RATE = 16_000
MEL_FRAMES_PER_TOKEN = 2  # CosyVoice 2's flow: token_mel_ratio (25 Hz tokens, 50 Hz mel)


def frontend_generation(frontend_zero_shot: Any, repo: str | Path) -> tuple[str, bool]:
    """(TENSOR_API or PATH_API, whether it takes zero_shot_spk_id) for the checkout's bound
    `CosyVoiceFrontEnd.frontend_zero_shot`; ValueError naming the supported upstream ranges otherwise."""
    params = list(inspect.signature(frontend_zero_shot).parameters)
    takes_spk_id = "zero_shot_spk_id" in params
    if len(params) >= 4 and params[:2] == ["tts_text", "prompt_text"] and params[3] == "resample_rate":
        if params[2] == TENSOR_API:
            return TENSOR_API, takes_spk_id
        if params[2] == PATH_API and takes_spk_id:
            return PATH_API, True
    raise ValueError(
        f"CosyVoice checkout {repo}: CosyVoiceFrontEnd.frontend_zero_shot{inspect.signature(frontend_zero_shot)} "
        f"fits neither frontend this vocoder supports: {SUPPORTED_FRONTENDS}. Check out a FunAudioLLM/CosyVoice "
        "commit in one of those ranges (vocoder.cosyvoice_repo=)"
    )


class CosyVoice2Vocoder:
    """CosyVoice 2 flow + HiFT from a CosyVoice checkout (the LM is ours; only token2wav is upstream's)."""

    codebook_size = 6561  # the flow's speech-token embedding rows (FSQ, 3^8), as the tokenizer's
    token_rate = 25

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

        try:
            from cosyvoice.cli.cosyvoice import CosyVoice2
        except ImportError as err:
            raise ImportError(
                f"cannot import CosyVoice2 from the CosyVoice checkout {repo}: {err}. vocoder=cosyvoice2 needs a "
                "FunAudioLLM/CosyVoice checkout from c693039 (2024-12-12) on, with its requirements installed"
            ) from err

        self._torch = torch
        self.model = CosyVoice2(str(model_dir), load_jit=False, load_trt=False, fp16=fp16)
        self.sample_rate = int(self.model.sample_rate)
        self.frontend_api, self._pass_spk_id = frontend_generation(
            self.model.frontend.frontend_zero_shot, repo
        )
        self._conditioning: dict[
            tuple[int, str], tuple[Any, Any]
        ] = {}  # prompt audio -> (mel feat, embedding)

    def prepare_prompt(self, prompt: VocoderPrompt) -> VocoderPrompt:
        """The prompt with its tokens cut as upstream's frontend cuts them for CosyVoice 2 (at most half the
        24 kHz mel's frames), so the LM and the flow see the same prompt tokens; the conditioning is cached."""
        tokens, _, _ = self._prepared(prompt)
        return replace(prompt, tokens=tokens)

    def vocode(self, tokens: np.ndarray, prompt: VocoderPrompt) -> np.ndarray:
        torch = self._torch
        prompt_tokens, feat, embedding = self._prepared(prompt)
        session = str(uuid.uuid1())
        self.model.model.hift_cache_dict[session] = None
        try:
            wav = self.model.model.token2wav(
                token=torch.as_tensor(np.asarray(tokens), dtype=torch.int32)[None],
                prompt_token=torch.as_tensor(prompt_tokens, dtype=torch.int32)[None],
                prompt_feat=feat,
                embedding=embedding,
                token_offset=0,
                uuid=session,
                finalize=True,
            )
        finally:
            self.model.model.hift_cache_dict.pop(session, None)
        return wav.squeeze(0).float().cpu().numpy()

    def _prepared(self, prompt: VocoderPrompt) -> tuple[np.ndarray, Any, Any]:
        """(prompt tokens, mel feat [1, 2 * len(tokens), 80], embedding): upstream's truncation
        token_len = min(mel frames // 2, tokens), applied to our tokens (idempotent, so a prepared prompt
        passes through unchanged; also right for checkouts whose frontend does not truncate yet)."""
        feat, embedding = self._prompt_conditioning(prompt)
        tokens = np.asarray(prompt.tokens, dtype=np.int64)
        token_len = min(feat.shape[1] // MEL_FRAMES_PER_TOKEN, tokens.size)
        return tokens[:token_len], feat[:, : MEL_FRAMES_PER_TOKEN * token_len], embedding

    def _prompt_conditioning(self, prompt: VocoderPrompt) -> tuple[Any, Any]:
        wav = np.ascontiguousarray(prompt.wav, dtype=np.float32)
        key = (int(prompt.sample_rate), hashlib.blake2b(wav.tobytes(), digest_size=16).hexdigest())
        if key not in self._conditioning:
            self._conditioning[key] = self._run_frontend(wav, int(prompt.sample_rate), prompt.text)
        return self._conditioning[key]

    def _run_frontend(self, wav: np.ndarray, sr: int, text: str) -> tuple[Any, Any]:
        """The checkout's own frontend_zero_shot on the prompt (tts text unused) -> (mel feat, embedding)."""
        frontend = self.model.frontend.frontend_zero_shot
        extra = ("",) if self._pass_spk_id else ()
        if self.frontend_api == TENSOR_API:
            speech_16k = self._torch.from_numpy(resample(wav, sr, 16_000))[None]
            inputs = frontend("", text, speech_16k, self.sample_rate, *extra)
        else:
            import soundfile as sf

            if sr < PATH_API_MIN_RATE:
                wav, sr = resample(wav, sr, PATH_API_MIN_RATE), PATH_API_MIN_RATE
            # Float WAV at the prompt's own rate: upstream's load_wav reads it (soundfile) without loss and
            # resamples to 16 and 24 kHz itself, as for a user's own prompt file.
            with tempfile.TemporaryDirectory(prefix="ssd_cosyvoice_prompt_") as tmp:
                path = str(Path(tmp) / "prompt.wav")
                sf.write(path, wav, sr, subtype="FLOAT")
                inputs = frontend("", text, path, self.sample_rate, *extra)
        # Kept on the CPU (many prompts over a run); token2wav moves its inputs to the model's device itself.
        return inputs["prompt_speech_feat"].cpu(), inputs["flow_embedding"].cpu()
