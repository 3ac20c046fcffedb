"""Speech tokens -> waveform (`ssd.contracts.Vocoder`: `vocode(tokens, prompt) -> wav` at `sample_rate`).

Backends (Hydra `_target_`s in configs/vocoder/):
  (the toy world's vocoder is ssd.toy_world.codec.ToyVocoder)
  cosyvoice2  CosyVoice 2's (or 3's) flow matching + HiFT from a user-provided CosyVoice checkout
              (`vocoder.cosyvoice_repo=`) and model dir (`vocoder.model_dir=`), built without upstream's LM
              (ssd/audio/cosyvoice_token2wav.py). It follows upstream's zero-shot path
              (docs/target-cosyvoice2.md): the checkout's own `frontend_zero_shot` builds the flow's
              conditioning (24 kHz mel, CAM++ embedding) once per prompt, the prompt tokens are cut to half
              the mel's frames as upstream's frontend cuts them, then `model.token2wav(..., token_offset=0,
              finalize=True)`. In this process, or with `vocoder.python=` in a worker process running the
              CosyVoice environment's own Python (its torch and torchaudio), so this one needs neither.
              Streaming (`stream`): upstream's streaming token2wav, called on the schedule of upstream's
              tts(stream=True) as the checkout defines it (ssd/audio/streaming.py).

Each constructor checks its paths before importing anything heavy, so a runner fails fast.
"""

from __future__ import annotations

import hashlib
import shlex
import shutil
import subprocess
import tempfile
import uuid
from collections import deque
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from ssd.audio import cosyvoice_token2wav as upstream
from ssd.audio.cosyvoice_token2wav import PATH_API, TENSOR_API, Token2Wav, check_paths
from ssd.audio.features import resample
from ssd.audio.streaming import ChunkedStream, ChunkSchedule
from ssd.contracts import VocoderPrompt

__all__ = ["PATH_API", "TENSOR_API", "CosyVoice2Vocoder", "Token2WavWorker", "WorkerError"]
MEL_FRAMES_PER_TOKEN = 2  # CosyVoice 2 and 3's flow: token_mel_ratio (25 Hz tokens, 50 Hz mel)
WORKER_SCRIPT = Path(upstream.__file__)
WORKER_LOG_LINES = 40  # the worker's last stderr lines quoted when it dies


class WorkerError(RuntimeError):
    """A failure inside the token2wav worker: its message carries the worker's traceback and a command that
    reproduces the failure in the foreground."""


class Token2WavWorker:
    """`Token2Wav` in another Python, the user's CosyVoice environment, as a child process: prompt audio and
    tokens go in, conditioning and waveforms come back (ssd/audio/cosyvoice_token2wav.py, "the worker
    protocol"). Its stderr goes to a log file, quoted when it dies."""

    def __init__(
        self,
        python: str | Path,
        repo: Path,
        model_dir: Path,
        model_class: str = "CosyVoice2",
        fp16: bool = False,
    ) -> None:
        executable = shutil.which(str(python))
        if executable is None:
            raise FileNotFoundError(
                f"vocoder.python={python} is not an executable Python: give the python of the environment that "
                "has CosyVoice's requirements (e.g. <conda env>/bin/python)"
            )
        self.command = [executable, str(WORKER_SCRIPT), "--repo", str(repo), "--model-dir", str(model_dir),
                        "--model-class", model_class, *(["--fp16"] if fp16 else [])]  # fmt: skip
        self.log_path = Path(tempfile.mkstemp(prefix="ssd_token2wav_worker_", suffix=".log")[1])
        with open(self.log_path, "wb") as log:
            self._process = subprocess.Popen(
                self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, cwd=str(repo)
            )
        check = shlex.join([*self.command, "--check"])
        try:
            ready, _ = self._receive("start")
        except WorkerError as err:
            raise WorkerError(f"{err}\nReproduce: {check}") from None
        if not ready["ok"]:
            self.close()
            raise WorkerError(self._failure("start", ready, check))
        self.info = {k: ready[k] for k in ("sample_rate", "frontend_api", "prompt_rate", "streaming")}

    def conditioning(self, wav: np.ndarray, sr: int, text: str) -> tuple[np.ndarray, np.ndarray]:
        out = self._call({"op": "conditioning", "sample_rate": int(sr), "text": text}, {"wav": wav})
        return out["feat"], out["embedding"]

    def token2wav(self, tokens, prompt_tokens, feat, embedding) -> np.ndarray:
        arrays = {"tokens": tokens, "prompt_tokens": prompt_tokens, "feat": feat, "embedding": embedding}
        return self._call({"op": "token2wav"}, arrays)["wav"]

    def stream_chunk(
        self, session, tokens, prompt_tokens, feat, embedding, token_offset, finalize
    ) -> np.ndarray:
        header = {"op": "stream_chunk", "session": session, "token_offset": int(token_offset),
                  "finalize": bool(finalize)}  # fmt: skip
        arrays = {"tokens": tokens, "prompt_tokens": prompt_tokens, "feat": feat, "embedding": embedding}
        return self._call(header, arrays)["wav"]

    def stream_close(self, session: str) -> None:
        self._call({"op": "stream_close", "session": session}, {})

    def _call(self, header: dict[str, Any], arrays: dict[str, Any]) -> dict[str, np.ndarray]:
        try:
            upstream.write_message(self._process.stdin, header, arrays)
        except (BrokenPipeError, OSError, ValueError):
            pass  # the worker is gone; _receive says why
        try:
            response, out = self._receive(header["op"])
        except WorkerError as err:
            raise WorkerError(f"{err}\nReproduce: {self._replay_command(header, arrays)}") from None
        if not response["ok"]:
            raise WorkerError(self._failure(header["op"], response, self._replay_command(header, arrays)))
        return out

    def _replay_command(self, header: dict[str, Any], arrays: dict[str, Any]) -> str:
        saved = upstream.save_request(tempfile.mkdtemp(prefix="ssd_token2wav_request_"), header, arrays)
        return shlex.join([*self.command, "--replay", str(saved)])

    def _receive(self, what: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        try:
            return upstream.read_message(self._process.stdout)
        except (EOFError, OSError, ValueError) as err:
            code = self._process.wait(timeout=30)
            with open(self.log_path, errors="replace") as log:
                tail = "".join(deque(log, maxlen=WORKER_LOG_LINES))
            raise WorkerError(
                f"the CosyVoice token2wav worker exited with code {code} during {what} ({err}).\n"
                f"--- its last stderr lines ({self.log_path}) ---\n{tail}--- end ---"
            ) from None

    def _failure(self, what: str, response: dict[str, Any], reproduce: str) -> str:
        return (
            f"the CosyVoice token2wav worker ({self.command[0]}) failed during {what}: {response['error']}\n"
            f"--- worker traceback ---\n{response['traceback']}--- end ---\nReproduce: {reproduce}"
        )

    def close(self) -> None:
        process = getattr(self, "_process", None)
        if process is None or process.poll() is not None:
            return
        try:
            process.stdin.close()
            process.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            process.kill()
            process.wait()

    def __del__(self) -> None:
        self.close()


class CosyVoice2Vocoder:
    """CosyVoice 2 (or 3, `model_class="CosyVoice3"`) flow + HiFT from a CosyVoice checkout; the LM is ours,
    upstream's is never built. In this process by default; with `python=` in that Python's process."""

    codebook_size = 6561  # the flow's speech-token embedding rows (FSQ, 3^8), as the tokenizer's
    token_rate = 25

    def __init__(
        self,
        cosyvoice_repo: str | Path | None,
        model_dir: str | Path | None,
        fp16: bool = False,
        python: str | Path | None = None,
        model_class: str = "CosyVoice2",
    ) -> None:
        repo, model_dir = check_paths(cosyvoice_repo, model_dir, model_class)
        if python is None:
            self.engine: Token2Wav | Token2WavWorker = Token2Wav(repo, model_dir, model_class, fp16)
            info = self.engine.info()
        else:
            self.engine = Token2WavWorker(python, repo, model_dir, model_class, fp16)
            info = self.engine.info
        self.model_class = model_class
        self.sample_rate = int(info["sample_rate"])
        self.frontend_api = info["frontend_api"]
        self._prompt_rate = info["prompt_rate"]
        self.streaming = info[
            "streaming"
        ]  # the checkout's streaming schedule (cosyvoice_token2wav.streaming_schedule)
        # prompt audio -> (mel feat [1, frames, 80], embedding [1, 192]), numpy
        self._conditioning: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = {}

    def prepare_prompt(self, prompt: VocoderPrompt) -> VocoderPrompt:
        """The prompt with its tokens cut as upstream's frontend cuts them (at most half the 24 kHz mel's
        frames), so the LM and the flow see the same prompt tokens; the conditioning is cached."""
        tokens, _, _ = self._prepared(prompt)
        return replace(prompt, tokens=tokens)

    def vocode(self, tokens: np.ndarray, prompt: VocoderPrompt) -> np.ndarray:
        prompt_tokens, feat, embedding = self._prepared(prompt)
        wav = self.engine.token2wav(np.asarray(tokens, dtype=np.int64), prompt_tokens, feat, embedding)
        return np.asarray(wav, dtype=np.float32)

    def stream(self, prompt: VocoderPrompt) -> CosyVoiceStream:
        """A streaming session of upstream's token2wav on this prompt (`ssd.contracts.StreamingVocoder`)."""
        if not self.streaming["supported"]:
            raise ValueError(f"eval.streaming=true: {self.streaming['why']}")
        schedule = ChunkSchedule(self.streaming["token_hop_len"], self.streaming["pre_lookahead_len"],
                                 self.streaming["align_prompt"])  # fmt: skip
        return CosyVoiceStream(self.engine, schedule, *self._prepared(prompt))

    def close(self) -> None:
        """Stop the worker process (if any); the vocoder cannot vocode afterwards."""
        if isinstance(self.engine, Token2WavWorker):
            self.engine.close()

    def _prepared(self, prompt: VocoderPrompt) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(prompt tokens, mel feat [1, 2 * len(tokens), 80], embedding): upstream's truncation
        token_len = min(mel frames // 2, tokens), applied to our tokens (idempotent, so a prepared prompt
        passes through unchanged; also right for checkouts whose frontend does not truncate yet)."""
        feat, embedding = self._prompt_conditioning(prompt)
        tokens = np.asarray(prompt.tokens, dtype=np.int64)
        token_len = min(feat.shape[1] // MEL_FRAMES_PER_TOKEN, tokens.size)
        return tokens[:token_len], feat[:, : MEL_FRAMES_PER_TOKEN * token_len], embedding

    def _prompt_conditioning(self, prompt: VocoderPrompt) -> tuple[np.ndarray, np.ndarray]:
        wav = np.ascontiguousarray(prompt.wav, dtype=np.float32)
        key = (int(prompt.sample_rate), hashlib.blake2b(wav.tobytes(), digest_size=16).hexdigest())
        if key not in self._conditioning:
            sr = int(prompt.sample_rate)
            # The tensor generation takes 16 kHz audio; the path generation reads any rate from 16 kHz up
            # and resamples it itself (upstream's load_wav), so the prompt goes at its own rate there.
            target = self._prompt_rate or (
                upstream.PATH_API_MIN_RATE if sr < upstream.PATH_API_MIN_RATE else sr
            )
            if target != sr:
                wav, sr = resample(wav, sr, target), target
            self._conditioning[key] = self.engine.conditioning(wav, sr, prompt.text)
        return self._conditioning[key]


class CosyVoiceStream(ChunkedStream):
    """One utterance through upstream's streaming token2wav: each call gets every token so far and the offset of
    the tokens already synthesised; upstream's own token2wav crops, caches and crossfades (its hift_cache_dict
    under this session's id)."""

    def __init__(self, engine: Any, schedule: ChunkSchedule, prompt_tokens, feat, embedding) -> None:
        super().__init__(schedule, len(prompt_tokens))
        self.engine, self.conditioning = engine, (prompt_tokens, feat, embedding)
        self.session = f"ssd-stream-{uuid.uuid4()}"
        self.open = False  # upstream holds a cache for this session

    def _synthesise(self, tokens: np.ndarray, token_offset: int, finalize: bool) -> np.ndarray:
        self.open = True
        wav = self.engine.stream_chunk(self.session, tokens, *self.conditioning, token_offset, finalize)
        self.open = not finalize  # a last call that returned has dropped the session's cache
        return np.asarray(wav, dtype=np.float32)

    def _close(self) -> None:
        if self.open:
            self.engine.stream_close(self.session)
            self.open = False
