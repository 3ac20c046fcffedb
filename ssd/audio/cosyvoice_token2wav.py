"""CosyVoice's token2wav without its LM: the checkout's own frontend (prompt mel + CAM++ embedding), flow
matching and HiFT, built from a CosyVoice model dir, in this process or as a worker process.

This file imports nothing from `ssd` and only the standard library at the top, so that a CosyVoice
environment (its own torch, torchaudio, transformers) runs it as a script:

    <cosyvoice env>/bin/python cosyvoice_token2wav.py --repo R --model-dir M [--model-class CosyVoice3]

serves requests on stdin/stdout (`serve`); `--check` builds everything and exits, `--replay DIR` reruns one
saved request in the foreground (the commands a worker error prints). Messages are a JSON header and .npy arrays, read with
allow_pickle=False: nothing received is unpickled.

Streaming (`stream_chunk`): one call of upstream's streaming token2wav for a session (its HiFT cache lives in
upstream's `hift_cache_dict` under the session's id, here or in the worker); `ssd.audio.vocoder` schedules the
calls as upstream's `tts(stream=True)` does (`ssd.audio.streaming`).

Upstream's `CosyVoice2` / `CosyVoice3` classes also build and load the LM; this builds only what token2wav
needs: the model dir's HyperPyYAML with its `llm` entry overridden to null (so the LM is never
constructed), the flow and HiFT loaded from flow.pt / hift.pt with weights_only=True, upstream's model
class around them with an empty module in the LM's place, and upstream's frontend.
"""

from __future__ import annotations

import inspect
import json
import os
import struct
import sys
import tempfile
import traceback
import uuid
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple


class ModelClass(NamedTuple):
    config: str  # the model dir's HyperPyYAML
    speech_tokenizer: str  # the frontend's ONNX speech tokenizer in the model dir
    model: str  # the class in cosyvoice/cli/model.py that holds token2wav


# Upstream's model classes (cosyvoice/cli/cosyvoice.py), by name: what each builds its frontend and model from.
MODEL_CLASSES = {
    "CosyVoice2": ModelClass("cosyvoice2.yaml", "speech_tokenizer_v2.onnx", "CosyVoice2Model"),
    "CosyVoice3": ModelClass("cosyvoice3.yaml", "speech_tokenizer_v3.onnx", "CosyVoice3Model"),
}

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
TENSOR_API_RATE = 16_000  # the tensor generation's prompt rate
PATH_API_MIN_RATE = 16_000  # upstream's path loader refuses audio below this rate (load_wav's min_sr)


def check_paths(repo: str | Path | None, model_dir: str | Path | None, model_class: str) -> tuple[Path, Path]:
    """(repo, model_dir) as Paths, or a clear error before anything is imported."""
    if model_class not in MODEL_CLASSES:
        raise ValueError(f"vocoder.model_class={model_class!r}: choose one of {sorted(MODEL_CLASSES)}")
    for key, value in (("cosyvoice_repo", repo), ("model_dir", model_dir)):
        if value is None:
            raise ValueError(f"vocoder.{key} is not set (COSYVOICE_REPO / target.model.model_dir)")
    repo, model_dir = Path(repo), Path(model_dir)
    spec = MODEL_CLASSES[model_class]
    for path in (
        repo / "cosyvoice" / "cli" / "model.py",
        model_dir / spec.config,
        model_dir / "flow.pt",
        model_dir / "hift.pt",
    ):
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} not found: the {model_class} vocoder needs vocoder.cosyvoice_repo=<a CosyVoice git "
                f"checkout> and vocoder.model_dir=<the model dir with {spec.config}, flow.pt, hift.pt, "
                f"campplus.onnx, {spec.speech_tokenizer}>"
            )
    return repo, model_dir


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


class Token2Wav:
    """Upstream's frontend conditioning and token2wav for one model dir, in this process (numpy in and out)."""

    def __init__(
        self, repo: str | Path, model_dir: str | Path, model_class: str = "CosyVoice2", fp16: bool = False
    ) -> None:
        repo, model_dir = check_paths(repo, model_dir, model_class)
        spec = MODEL_CLASSES[model_class]
        for extra in (repo / "third_party" / "Matcha-TTS", repo):  # upstream's own import setup
            if str(extra) not in sys.path:
                sys.path.insert(0, str(extra))
        import torch

        try:
            import cosyvoice.cli.model as upstream_model
            from cosyvoice.cli.frontend import CosyVoiceFrontEnd
            from hyperpyyaml import load_hyperpyyaml
        except ImportError as err:
            raise ImportError(
                f"cannot import CosyVoice's frontend and model from the checkout {repo} with {sys.executable}: "
                f"{err}. Install the checkout's requirements in this environment, or run the vocoder in the "
                "CosyVoice environment with vocoder.python=<its python>"
            ) from err
        if not hasattr(upstream_model, spec.model):
            raise ImportError(f"CosyVoice checkout {repo} has no {spec.model} (model_class={model_class})")

        self._torch = torch
        # The model dir's HyperPyYAML constructs every `!new:` entry it holds; `llm: null` replaces the LM's
        # entry before construction, so the LM is never built (nothing else in the file refers to it).
        with open(model_dir / spec.config) as f:
            configs = load_hyperpyyaml(
                f, overrides={"qwen_pretrain_path": str(model_dir / "CosyVoice-BlankEN"), "llm": None}
            )
        model_cls = getattr(upstream_model, spec.model)
        fp16 = bool(fp16) and torch.cuda.is_available()  # upstream turns fp16 off without CUDA too
        # Upstream's model class calls .half() / .to() on the LM in some versions: an empty module takes them.
        self.model = model_cls(
            torch.nn.Module(), configs["flow"], configs["hift"], **_model_options(model_cls, fp16)
        )
        device = self.model.device
        flow_state = torch.load(model_dir / "flow.pt", map_location=device, weights_only=True)
        self.model.flow.load_state_dict(flow_state, strict=True)
        self.model.flow.to(device).eval()
        hift_state = torch.load(model_dir / "hift.pt", map_location=device, weights_only=True)
        # Upstream's rule: a HiFiGAN checkpoint holds the generator under "generator.".
        self.model.hift.load_state_dict(
            {k.replace("generator.", ""): v for k, v in hift_state.items()}, strict=True
        )
        self.model.hift.to(device).eval()
        self.frontend = CosyVoiceFrontEnd(
            configs["get_tokenizer"],
            configs["feat_extractor"],
            str(model_dir / "campplus.onnx"),
            str(model_dir / spec.speech_tokenizer),
            str(model_dir / "spk2info.pt"),
            configs["allowed_special"],
        )
        self.sample_rate = int(configs["sample_rate"])
        self.frontend_api, self._pass_spk_id = frontend_generation(self.frontend.frontend_zero_shot, repo)
        self.prompt_rate = TENSOR_API_RATE if self.frontend_api == TENSOR_API else None  # None: any >= 16 kHz
        self.streaming = streaming_schedule(model_cls, self.model)

    def info(self) -> dict[str, Any]:
        return {
            "sample_rate": self.sample_rate,
            "frontend_api": self.frontend_api,
            "prompt_rate": self.prompt_rate,
            "streaming": self.streaming,
        }

    def conditioning(self, wav: Any, sr: int, text: str) -> tuple[Any, Any]:
        """The checkout's own frontend_zero_shot on the prompt (tts text unused) -> (mel feat float32
        [1, frames, 80], embedding float32 [1, 192]) as numpy arrays. A tensor-generation frontend needs
        16 kHz audio, a path-generation one at least 16 kHz (the caller resamples)."""
        import numpy as np

        torch = self._torch
        wav = np.ascontiguousarray(wav, dtype=np.float32)
        frontend = self.frontend.frontend_zero_shot
        extra = ("",) if self._pass_spk_id else ()
        if self.frontend_api == TENSOR_API:
            if sr != TENSOR_API_RATE:
                raise ValueError(f"this checkout's frontend takes 16 kHz prompt audio, got {sr} Hz")
            inputs = frontend("", text, torch.from_numpy(wav)[None], self.sample_rate, *extra)
        else:
            if sr < PATH_API_MIN_RATE:
                raise ValueError(f"upstream's wav loader refuses prompts below 16 kHz, got {sr} Hz")
            import soundfile as sf

            # Float WAV at the prompt's own rate: upstream's load_wav reads it (soundfile) without loss and
            # resamples to 16 and 24 kHz itself, as for a user's own prompt file.
            with tempfile.TemporaryDirectory(prefix="ssd_cosyvoice_prompt_") as tmp:
                path = str(Path(tmp) / "prompt.wav")
                sf.write(path, wav, sr, subtype="FLOAT")
                inputs = frontend("", text, path, self.sample_rate, *extra)
        feat = inputs["prompt_speech_feat"].float().cpu().numpy()
        return feat, inputs["flow_embedding"].float().cpu().numpy()

    def token2wav(self, tokens: Any, prompt_tokens: Any, feat: Any, embedding: Any) -> Any:
        """Upstream's non-streaming token2wav (token_offset 0, finalize) -> float32 waveform [samples]."""
        return self._call(str(uuid.uuid1()), tokens, prompt_tokens, feat, embedding, 0, True, {})

    def stream_chunk(self, session: str, tokens: Any, prompt_tokens: Any, feat: Any, embedding: Any,
                     token_offset: int, finalize: bool) -> Any:  # fmt: skip
        """One call of upstream's streaming token2wav for `session` (every token so far, the tokens already
        synthesised, finalize on the last call), with the arguments upstream's tts(stream=True) passes: stream=True
        on the calls before the last where token2wav takes it, none on the last. Its HiFT cache is upstream's
        hift_cache_dict[session], made on the first call and dropped after the last."""
        if not self.streaming["supported"]:
            raise ValueError(self.streaming["why"])
        extra = {"stream": True} if self.streaming["stream_arg"] and not finalize else {}
        return self._call(
            session, tokens, prompt_tokens, feat, embedding, int(token_offset), bool(finalize), extra
        )

    def _call(self, session: str, tokens: Any, prompt_tokens: Any, feat: Any, embedding: Any, token_offset: int,
              finalize: bool, extra: dict) -> Any:  # fmt: skip
        """upstream's token2wav for one session; its HiFT cache made on the session's first call (offset 0) and
        dropped after its last (finalize) or on an error."""
        import numpy as np

        torch = self._torch
        if token_offset == 0:
            self.model.hift_cache_dict[session] = None
        try:
            with torch.no_grad():
                wav = self.model.token2wav(
                    token=torch.as_tensor(np.asarray(tokens), dtype=torch.int32)[None],
                    prompt_token=torch.as_tensor(np.asarray(prompt_tokens), dtype=torch.int32)[None],
                    prompt_feat=torch.from_numpy(np.ascontiguousarray(feat, dtype=np.float32)),
                    embedding=torch.from_numpy(np.ascontiguousarray(embedding, dtype=np.float32)),
                    token_offset=token_offset,
                    uuid=session,
                    finalize=finalize,
                    **extra,
                )
        except BaseException:
            self.model.hift_cache_dict.pop(session, None)
            raise
        if finalize:
            self.model.hift_cache_dict.pop(session, None)
        return wav.squeeze(0).float().cpu().numpy()

    def stream_close(self, session: str) -> None:
        """Drop a session's cache (a stream abandoned before its last call)."""
        self.model.hift_cache_dict.pop(session, None)


def streaming_schedule(model_cls: Any, model: Any) -> dict[str, Any]:
    """How the checkout streams, read off its own model class: token_hop_len (the model's), pre_lookahead_len (the
    flow's), whether tts pads the first chunk to the prompt (`prompt_token_pad` in its source), whether token2wav
    takes `stream`; `supported` False (with `why`) for a model class this vocoder cannot drive in chunks."""
    why = None
    if "use_flow_cache" in inspect.signature(model_cls.__init__).parameters:
        why = (f"this checkout's {model_cls.__name__} streams with a flow cache (upstream 2025-04 to 2025-05), which "
               "this vocoder does not drive: check out an upstream commit outside that range to stream")  # fmt: skip
    elif not hasattr(model_cls, "tts") or not hasattr(model, "token_hop_len"):
        why = f"this checkout's {model_cls.__name__} has no streaming tts / token_hop_len to follow"
    try:
        tts_source = inspect.getsource(model_cls.tts)
    except (AttributeError, OSError, TypeError):
        tts_source = ""
    return {
        "supported": why is None,
        "why": why,
        "token_hop_len": int(getattr(model, "token_hop_len", 25)),
        "pre_lookahead_len": int(getattr(model.flow, "pre_lookahead_len", 3)),
        "align_prompt": "prompt_token_pad" in tts_source,
        "stream_arg": "stream" in inspect.signature(model.token2wav).parameters,
    }


def _model_options(model_cls: Any, fp16: bool) -> dict[str, Any]:
    """Keyword arguments for upstream's model class beyond (llm, flow, hift), across its versions."""
    options = {}
    for name, param in list(inspect.signature(model_cls.__init__).parameters.items())[4:]:
        if name == "fp16":
            options[name] = fp16
        elif name == "use_flow_cache":  # 2025-04 .. 2025-05: the non-streaming flow
            options[name] = False
        elif param.default is inspect.Parameter.empty and param.kind not in (
            param.VAR_POSITIONAL,
            param.VAR_KEYWORD,
        ):
            raise TypeError(f"{model_cls.__name__}.__init__ needs {name!r}, which this vocoder cannot supply")
    return options


# --- the worker protocol: length-prefixed JSON header, then the named arrays as .npy --------------------------


def write_message(stream: BinaryIO, header: dict[str, Any], arrays: dict[str, Any] | None = None) -> None:
    import io

    import numpy as np

    blobs = []
    for name, array in (arrays or {}).items():
        buffer = io.BytesIO()
        np.save(buffer, np.asarray(array), allow_pickle=False)
        blobs.append((name, buffer.getvalue()))
    head = json.dumps({**header, "arrays": [[name, len(blob)] for name, blob in blobs]}).encode()
    stream.write(struct.pack("<Q", len(head)) + head)
    for _, blob in blobs:
        stream.write(blob)
    stream.flush()


def _read_exactly(stream: BinaryIO, n: int) -> bytes:
    data = stream.read(n)
    if len(data) != n:
        raise EOFError(f"stream closed after {len(data)} of {n} bytes")
    return data


def read_message(stream: BinaryIO) -> tuple[dict[str, Any], dict[str, Any]]:
    import io

    import numpy as np

    (size,) = struct.unpack("<Q", _read_exactly(stream, 8))
    header = json.loads(_read_exactly(stream, size))
    arrays = {
        name: np.load(io.BytesIO(_read_exactly(stream, length)), allow_pickle=False)
        for name, length in header.pop("arrays", [])
    }
    return header, arrays


def handle(engine: Token2Wav, header: dict[str, Any], arrays: dict[str, Any]) -> tuple[dict, dict]:
    """One request -> (response header, response arrays)."""
    op = header.get("op")
    if op == "conditioning":
        feat, embedding = engine.conditioning(arrays["wav"], int(header["sample_rate"]), str(header["text"]))
        return {"ok": True}, {"feat": feat, "embedding": embedding}
    if op == "token2wav":
        wav = engine.token2wav(arrays["tokens"], arrays["prompt_tokens"], arrays["feat"], arrays["embedding"])
        return {"ok": True}, {"wav": wav}
    if op == "stream_chunk":
        wav = engine.stream_chunk(str(header["session"]), arrays["tokens"], arrays["prompt_tokens"], arrays["feat"],
                                  arrays["embedding"], int(header["token_offset"]), bool(header["finalize"]))  # fmt: skip
        return {"ok": True}, {"wav": wav}
    if op == "stream_close":
        engine.stream_close(str(header["session"]))
        return {"ok": True}, {}
    raise ValueError(f"unknown request op {op!r}")


def save_request(directory: str | Path, header: dict[str, Any], arrays: dict[str, Any]) -> Path:
    """A request as request.json + one .npy per array (what --replay reads)."""
    import numpy as np

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "request.json").write_text(json.dumps(header))
    for name, array in arrays.items():
        np.save(directory / f"{name}.npy", np.asarray(array), allow_pickle=False)
    return directory


def load_request(directory: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    import numpy as np

    directory = Path(directory)
    header = json.loads((directory / "request.json").read_text())
    arrays = {p.stem: np.load(p, allow_pickle=False) for p in sorted(directory.glob("*.npy"))}
    return header, arrays


def _error(err: BaseException) -> dict[str, Any]:
    return {"ok": False, "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}


def serve(args: Any) -> int:
    """The worker loop: a ready message (or the build error), then one response per request until EOF."""
    # The protocol owns the real stdout; anything upstream prints goes to stderr instead.
    channel = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    requests = sys.stdin.buffer
    try:
        engine = Token2Wav(args.repo, args.model_dir, args.model_class, args.fp16)
    except Exception as err:  # noqa: BLE001 - reported to the parent, which raises it
        write_message(channel, _error(err))
        return 1
    write_message(channel, {"ok": True, **engine.info()})
    while True:
        try:
            header, arrays = read_message(requests)
        except EOFError:
            return 0
        try:
            response, out = handle(engine, header, arrays)
        except Exception as err:  # noqa: BLE001 - one failed request does not end the worker
            response, out = _error(err), {}
        write_message(channel, response, out)


def replay(args: Any) -> int:
    """Rerun one saved request in the foreground, tracebacks on the terminal."""
    engine = Token2Wav(args.repo, args.model_dir, args.model_class, args.fp16)
    header, arrays = load_request(args.replay)
    _, out = handle(engine, header, arrays)
    print(json.dumps({name: list(array.shape) for name, array in out.items()}))
    return 0


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", required=True, help="a FunAudioLLM/CosyVoice checkout")
    parser.add_argument(
        "--model-dir", required=True, help="the model dir (its HyperPyYAML, flow.pt, hift.pt)"
    )
    parser.add_argument("--model-class", default="CosyVoice2", choices=sorted(MODEL_CLASSES))
    parser.add_argument("--fp16", action="store_true")
    parser.add_argument("--replay", help="a saved request dir: run it once in the foreground")
    parser.add_argument("--check", action="store_true", help="build everything, print what was built, exit")
    args = parser.parse_args(argv)
    if args.check:
        print(json.dumps(Token2Wav(args.repo, args.model_dir, args.model_class, args.fp16).info()))
        return 0
    return replay(args) if args.replay else serve(args)


if __name__ == "__main__":
    sys.exit(main())
