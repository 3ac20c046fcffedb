"""Naturalness judges behind `score(wav, sr) -> {name: MOS}` (ssd.contracts.MOSJudge); NMOS = `primary`.

Backends:
- DNSMOS P.835 (SIG / BAK / OVRL) and its P.808 model, from the ONNX files that ship inside the
  `speechmos` wheel, through onnxruntime (the offline default; configs/mos/dnsmos.yaml).
- UTMOS (UTMOS22 strong learner) from a local checkpoint in the state-dict format of SpeechMOS's
  `utmos22_strong` torch-hub model (configs/mos/utmos.yaml).

Both are non-intrusive estimators trained to predict listener MOS; they are not listener MOS.
Audio is resampled to 16 kHz (`ssd.audio.features.resample`). Audio a judge cannot score (silent, too
short, non-finite) raises ValueError; the runner records the utterance's MOS as missing, as for SIM.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np

from ssd.audio.features import resample
from ssd.audio.onnx import onnx_session

MOS_SAMPLE_RATE = 16_000
MIN_SECONDS = 0.25  # shorter clips say nothing about naturalness (DNSMOS repeats a clip to fill 9 s)


def _speech_16k(wav: np.ndarray, sr: int, judge: str) -> np.ndarray:
    """Mono float32 at 16 kHz, checked: long enough and not silent."""
    if isinstance(sr, bool) or not isinstance(sr, int | np.integer) or sr <= 0:
        raise ValueError(f"{judge}: sample rate must be a positive integer (Hz), got {sr!r}")
    audio = resample(wav, int(sr), MOS_SAMPLE_RATE)
    if audio.size < MIN_SECONDS * MOS_SAMPLE_RATE:
        raise ValueError(
            f"{judge}: audio is {audio.size / MOS_SAMPLE_RATE:.3f} s long; need at least {MIN_SECONDS} s"
        )
    if not np.abs(audio).max() > 1e-6:
        raise ValueError(f"{judge}: audio is silent (peak below 1e-6)")
    # Both models were trained on [-1, 1] audio; a vocoder's overshoot is what a player would clip.
    return np.clip(audio, -1.0, 1.0)


# --------------------------------------------------------------------------------------------------
# DNSMOS
# --------------------------------------------------------------------------------------------------

DNSMOS_WINDOW_SECONDS = 9.01  # the models' input length
# The published cubic/quadratic maps from the P.835 model's raw outputs to MOS (DNSMOS's own evaluation
# script), for the regular and the personalised (pDNSMOS) model: (sig, bak, ovrl) polynomials.
_P835_POLYFIT = {
    False: ([-0.08397278, 1.22083953, 0.0052439], [-0.13166888, 1.60915514, -0.39604546],
            [-0.06766283, 1.11546468, 0.04602535]),
    True: ([-0.01019296, 0.02751166, 1.19576786, -0.24348726], [-0.04976499, 0.44276479, -0.1644611, 0.96883132],
           [-0.00533021, 0.005101, 1.18058466, -0.11236046]),
}  # fmt: skip


def speechmos_model_dir() -> Path:
    """The folder of the `speechmos` package (its ONNX models lie in subfolders)."""
    try:
        import importlib.util

        spec = importlib.util.find_spec("speechmos")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "DNSMOS needs the `speechmos` package (its wheel ships the ONNX models): "
            "pip install speechmos==0.0.1.1 (or the project's `judges` extra)"
        )
    return Path(next(iter(spec.submodule_search_locations)))


class DNSMOS:
    """DNSMOS P.835 (`sig`, `bak`, `ovrl`) and P.808 (`p808`) on 16 kHz audio; NMOS = `ovrl`.

    The ONNX files are those of the `speechmos` wheel, loaded here rather than through its
    `speechmos.dnsmos.run`: that wrapper opens its sessions with every core (no thread setting), keeps
    a module-global model, loops forever on an empty array (it doubles the clip until it is 9 s long),
    and imports `requests` it never uses. The scoring procedure is DNSMOS's own: a clip shorter than
    9.01 s is doubled until it is not, then scored on 9.01 s windows every whole second, the window
    scores averaged.
    """

    primary = "ovrl"

    def __init__(self, personalized: bool = False, p808: bool = True, num_threads: int | None = 1,
                 model_dir: str | os.PathLike | None = None) -> None:  # fmt: skip
        root = Path(str(model_dir)) if model_dir is not None else speechmos_model_dir()
        self.personalized = bool(personalized)
        p835 = root / ("pdnsmos_models" if self.personalized else "dnsmos_models") / "sig_bak_ovr.onnx"
        paths = [p835] + ([root / "dnsmos_models" / "model_v8.onnx"] if p808 else [])
        for path in paths:
            if not path.is_file():
                raise FileNotFoundError(
                    f"DNSMOS model_dir={root}: no {path.relative_to(root)} (the layout of the speechmos "
                    "0.0.1.1 wheel); leave model_dir null to use the installed speechmos package"
                )
        self.p835 = onnx_session(p835, num_threads)
        self.p808 = onnx_session(paths[1], num_threads) if p808 else None
        self.keys = ("ovrl", "sig", "bak", *(("p808",) if p808 else ()))
        self._polys = [np.poly1d(c) for c in _P835_POLYFIT[self.personalized]]

    def _p808_features(self, window: np.ndarray) -> np.ndarray:
        import librosa

        # The P.808 model's input: 120-band log-mel (n_fft 321, hop 160), dB re the max, mapped by (x + 40) / 40.
        mel = librosa.feature.melspectrogram(
            y=window, sr=MOS_SAMPLE_RATE, n_fft=321, hop_length=160, n_mels=120
        )
        return ((librosa.power_to_db(mel, ref=np.max) + 40) / 40).T.astype(np.float32)[None]

    def score(self, wav: np.ndarray, sr: int) -> dict[str, float]:
        audio = _speech_16k(wav, sr, "DNSMOS")
        window = int(DNSMOS_WINDOW_SECONDS * MOS_SAMPLE_RATE)
        while audio.size < window:  # DNSMOS doubles a short clip until it fills a window
            audio = np.concatenate([audio, audio])
        starts = range(
            int(audio.size // MOS_SAMPLE_RATE - DNSMOS_WINDOW_SECONDS) + 1
        )  # whole seconds, as DNSMOS counts
        p835, p808 = [], []
        for second in starts:
            segment = audio[second * MOS_SAMPLE_RATE : second * MOS_SAMPLE_RATE + window]
            (raw,) = self.p835.run(None, {"input_1": segment[None].astype(np.float32)})
            p835.append([poly(value) for poly, value in zip(self._polys, raw[0])])
            if self.p808 is not None:
                (mos,) = self.p808.run(None, {"input_1": self._p808_features(segment[:-160])})
                p808.append(float(mos.reshape(-1)[0]))
        sig, bak, ovrl = np.mean(p835, axis=0)
        out = {"ovrl": float(ovrl), "sig": float(sig), "bak": float(bak)}
        if self.p808 is not None:
            out["p808"] = float(np.mean(p808))
        return out


# --------------------------------------------------------------------------------------------------
# UTMOS
# --------------------------------------------------------------------------------------------------

# The SSL front end of the checkpoint (a fairseq-layout wav2vec 2.0) -> transformers' Wav2Vec2Model names.
_W2V_RENAMES = (
    (r"feature_extractor\.conv_layers\.(\d+)\.0\.weight", r"feature_extractor.conv_layers.\1.conv.weight"),
    (r"feature_extractor\.conv_layers\.0\.2\.(weight|bias)", r"feature_extractor.conv_layers.0.layer_norm.\1"),
    (r"layer_norm\.(weight|bias)", r"feature_projection.layer_norm.\1"),
    (r"post_extract_proj\.(weight|bias)", r"feature_projection.projection.\1"),
    (r"encoder\.pos_conv\.0\.weight_g", "encoder.pos_conv_embed.conv.weight_g"),
    (r"encoder\.pos_conv\.0\.weight_v", "encoder.pos_conv_embed.conv.weight_v"),
    (r"encoder\.pos_conv\.0\.bias", "encoder.pos_conv_embed.conv.bias"),
    (r"encoder\.layer_norm\.(weight|bias)", r"encoder.layer_norm.\1"),
    (r"encoder\.layers\.(\d+)\.self_attn\.(q|k|v|out)_proj\.(weight|bias)", r"encoder.layers.\1.attention.\2_proj.\3"),
    (r"encoder\.layers\.(\d+)\.self_attn_layer_norm\.(weight|bias)", r"encoder.layers.\1.layer_norm.\2"),
    (r"encoder\.layers\.(\d+)\.fc1\.(weight|bias)", r"encoder.layers.\1.feed_forward.intermediate_dense.\2"),
    (r"encoder\.layers\.(\d+)\.fc2\.(weight|bias)", r"encoder.layers.\1.feed_forward.output_dense.\2"),
    (r"encoder\.layers\.(\d+)\.final_layer_norm\.(weight|bias)", r"encoder.layers.\1.final_layer_norm.\2"),
    (r"mask_emb", ""),  # the pre-training mask vector: unused at inference, dropped
)  # fmt: skip
_HEAD_KEYS = ("domain_emb", "judge_emb", "projection.0.weight", "projection.0.bias",
              "projection.2.weight", "projection.2.bias")  # fmt: skip
UTMOS_CONV_STRIDES = (5, 2, 2, 2, 2, 2, 2)  # wav2vec 2.0's feature encoder (20 ms frames at 16 kHz)


def _rename_w2v(key: str) -> str | None:
    for pattern, replacement in _W2V_RENAMES:
        if re.fullmatch(pattern, key):
            return re.sub(pattern, replacement, key)
    return None


class UTMOS:
    """UTMOS22 strong learner from a local checkpoint; `score` -> {"utmos": MOS on 1..5}; NMOS = `utmos`.

    The checkpoint is the state dict of SpeechMOS's `utmos22_strong` (torch hub, v1.x:
    `utmos22_strong_step7459_v1.pt`): `wav2vec2.*` (a fairseq-layout wav2vec 2.0 base: conv feature
    encoder, post-LN transformer), `domain_emb` / `judge_emb` [1, 128], `blstm.*` (bidirectional LSTM) and
    `projection.{0,2}.*`. The wav2vec 2.0 part runs as transformers' `Wav2Vec2Model` (the same
    architecture); sizes are read from the tensors, `num_heads` (12 in UTMOS) cannot be.
    Score = 2 * (frame scores averaged over time) + 3, as the model was trained.
    """

    primary = "utmos"
    keys = ("utmos",)

    def __init__(self, checkpoint: str | os.PathLike, num_heads: int = 12, device: str = "cpu") -> None:
        path = Path(str(checkpoint))  # None (unset) reads as a missing file
        if not path.is_file():
            raise FileNotFoundError(
                f"UTMOS checkpoint={path}: no such file (the state dict of SpeechMOS's utmos22_strong, "
                "utmos22_strong_step7459_v1.pt from its v1.0.0 release)"
            )
        import torch

        from ssd.files import read_checkpoint

        try:
            state = read_checkpoint(path, "UTMOS state dict")
        except ValueError as err:  # a pickle that is not a plain state dict, or not a torch file at all
            raise ValueError(f"UTMOS checkpoint={path} is not a torch state dict file: {err}") from err
        if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
            state = state["state_dict"]
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise ValueError(
                f"UTMOS checkpoint={path}: expected a state dict of tensors, got {type(state).__name__}"
            )
        self._torch = torch
        self.device = torch.device(device)
        self.ssl, self.domain_emb, self.judge_emb, self.blstm, self.projection = self._build(
            state, path, num_heads
        )

    def _build(self, state: dict, path: Path, num_heads: int):
        torch = self._torch
        from transformers import Wav2Vec2Config, Wav2Vec2Model

        missing = [k for k in _HEAD_KEYS if k not in state]
        ssl_state, unknown = {}, []
        for key, value in state.items():
            if key.startswith("wav2vec2."):
                new = _rename_w2v(key[len("wav2vec2.") :])
                if new is None:
                    unknown.append(key)
                elif new:
                    ssl_state[new] = value
            elif key not in _HEAD_KEYS and not key.startswith("blstm."):
                unknown.append(key)
        required = ("feature_projection.projection.weight", "encoder.pos_conv_embed.conv.weight_v",
                    "encoder.layers.0.feed_forward.intermediate_dense.weight")  # fmt: skip
        missing += [f"wav2vec2.<{k}>" for k in required if k not in ssl_state]
        if not any(k.startswith("blstm.") for k in state):
            missing.append("blstm.*")
        if missing or unknown:
            raise ValueError(
                f"UTMOS checkpoint={path} is not a SpeechMOS utmos22_strong state dict: missing "
                f"{missing[:6]}, unexpected {unknown[:6]} (a UTMOS22 fairseq/lightning checkpoint must be "
                "converted to SpeechMOS's layout first)"
            )
        conv = sorted(int(m.group(1)) for k in ssl_state
                      if (m := re.fullmatch(r"feature_extractor\.conv_layers\.(\d+)\.conv\.weight", k)))  # fmt: skip
        if len(conv) != len(UTMOS_CONV_STRIDES):
            raise ValueError(
                f"UTMOS checkpoint={path}: {len(conv)} feature-encoder convolutions, wav2vec 2.0 has "
                f"{len(UTMOS_CONV_STRIDES)}"
            )
        conv_w = [ssl_state[f"feature_extractor.conv_layers.{i}.conv.weight"] for i in conv]
        hidden = ssl_state["feature_projection.projection.weight"].shape[0]
        pos_v = ssl_state["encoder.pos_conv_embed.conv.weight_v"]
        layers = 1 + max(int(k.split(".")[2]) for k in ssl_state if k.startswith("encoder.layers."))
        if hidden % int(num_heads):
            raise ValueError(
                f"UTMOS checkpoint={path}: hidden size {hidden} is not divisible by num_heads={num_heads}"
            )
        config = Wav2Vec2Config(
            hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=int(num_heads),
            intermediate_size=ssl_state["encoder.layers.0.feed_forward.intermediate_dense.weight"].shape[0],
            conv_dim=[w.shape[0] for w in conv_w], conv_kernel=[w.shape[2] for w in conv_w],
            conv_stride=list(UTMOS_CONV_STRIDES), conv_bias=False, feat_extract_norm="group",
            num_conv_pos_embeddings=pos_v.shape[2], num_conv_pos_embedding_groups=hidden // pos_v.shape[1],
            do_stable_layer_norm=False, hidden_act="gelu", feat_extract_activation="gelu",
            apply_spec_augment=False, mask_time_prob=0.0, layerdrop=0.0,
        )  # fmt: skip
        ssl = Wav2Vec2Model(config)
        ssl_state = _to_module_names(ssl, ssl_state)
        result = ssl.load_state_dict(ssl_state, strict=False)
        if result.missing_keys or result.unexpected_keys:
            raise ValueError(
                f"UTMOS checkpoint={path}: the wav2vec 2.0 tensors do not fit (missing {result.missing_keys[:6]}, "
                f"unexpected {result.unexpected_keys[:6]})"
            )
        w_ih = state["blstm.weight_ih_l0"]
        blstm = torch.nn.LSTM(w_ih.shape[1], w_ih.shape[0] // 4, batch_first=True, bidirectional=True)
        proj_w = state["projection.0.weight"]
        projection = torch.nn.Sequential(torch.nn.Linear(proj_w.shape[1], proj_w.shape[0]), torch.nn.ReLU(),
                                         torch.nn.Linear(proj_w.shape[0], 1))  # fmt: skip
        try:
            blstm.load_state_dict({k[len("blstm.") :]: v for k, v in state.items() if k.startswith("blstm.")})
            projection.load_state_dict(
                {k[len("projection.") :]: v for k, v in state.items() if k.startswith("projection.")}
            )
        except RuntimeError as err:
            raise ValueError(
                f"UTMOS checkpoint={path}: the BLSTM / projection tensors do not fit ({err})"
            ) from err
        cat = hidden + state["domain_emb"].shape[1] + state["judge_emb"].shape[1]
        if w_ih.shape[1] != cat:
            raise ValueError(
                f"UTMOS checkpoint={path}: the BLSTM takes {w_ih.shape[1]} features, SSL + embeddings give {cat}"
            )
        modules = [m.to(self.device).eval() for m in (ssl, blstm, projection)]
        return (
            modules[0],
            state["domain_emb"].to(self.device),
            state["judge_emb"].to(self.device),
            *modules[1:],
        )

    def score(self, wav: np.ndarray, sr: int) -> dict[str, float]:
        torch = self._torch
        audio = torch.from_numpy(_speech_16k(wav, sr, "UTMOS")).to(self.device)[None]
        with torch.inference_mode():
            frames = self.ssl(audio).last_hidden_state  # [1, T, hidden]
            t = frames.shape[1]
            features = torch.cat(
                [frames, self.domain_emb[:, None].expand(1, t, -1), self.judge_emb[:, None].expand(1, t, -1)],
                dim=2,
            )
            frame_scores = self.projection(self.blstm(features)[0])  # [1, T, 1]
        return {"utmos": float(frame_scores.mean()) * 2 + 3}


def _to_module_names(module, state: dict) -> dict:
    """Legacy weight-norm names (`weight_g` / `weight_v`) -> the module's own, where transformers builds
    the positional convolution with torch's parametrised weight norm (`parametrizations.weight.original0/1`)."""
    own = set(module.state_dict())
    out = {}
    for key, value in state.items():
        if key not in own and key.endswith((".weight_g", ".weight_v")):
            alt = (
                key[: -len("weight_g")]
                + "parametrizations.weight.original"
                + ("0" if key.endswith("_g") else "1")
            )
            key = alt if alt in own else key
        out[key] = value
    return out
