"""The toy world's speech tokenizer (audio -> 25 Hz tokens) and vocoder (tokens -> audio).

Tokenizer (features="phonetic", the default): like CosyVoice 2's supervised semantic tokens. A small
convolutional encoder over the utterance-mean-removed 80-bin log-mel (100 Hz) is trained to classify
each frame's phone state (flite's alignment, 3 states per phone); its bottleneck features, 4 frames
stacked per 25 Hz token, are PCA-projected and clustered by k-means. Trained across speakers to predict
phones, the tokens carry the words and little of the voice, so an LM trained on them meets speakers it
never saw in the same token language. (features="log_mel" clusters the mean-removed log-mel itself:
those tokens keep the speaker's formants, and the toy target then fails on unseen speakers.)
Vocoder: a small convolutional decoder maps tokens (with context on both sides) plus the prompt's
mean log-mel (the voice, as CosyVoice's flow stage takes the prompt mel) to a log-magnitude
spectrogram; Griffin-Lim turns that into a waveform. Everything is fitted on the toy training split.
It streams as CosyVoice does (`ToyVocoder.stream`, `ssd.audio.streaming`): the same chunk schedule, the
decoder rerun on every token so far with the lookahead tokens' frames dropped, and a cache of the last
frames and their audio crossfaded into the next chunk, as HiFT's.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch

from ssd.audio.features import mel_filterbank, resample
from ssd.audio.streaming import ChunkedStream, ChunkSchedule, fade_in_out
from ssd.contracts import VocoderPrompt
from ssd.files import read_checkpoint, write_atomic, write_checkpoint
from ssd.toy_world.codec_nets import PhoneticEncoder, TokenDecoder

# Bump when the saved format changes; load() refuses other versions.
FORMAT_VERSION = 2
DECODER_TARGETS = ("log_magnitude", "log_mel")
FEATURES = ("phonetic", "log_mel")


@dataclass
class ToyCodecConfig:
    sample_rate: int = 16000
    token_rate: int = 25
    hop_length: int = 160  # 100 Hz frames: 4 per token; short hops make Griffin-Lim cleaner
    win_length: int = 640
    n_fft: int = 1024
    n_mels: int = 80
    codebook_size: int = 1024
    features: str = "phonetic"  # see the module docstring
    phone_states: int = 3  # classes per phone for the phonetic encoder (begin/middle/end)
    encoder_channels: int = 192
    encoder_layers: int = 3  # dilated convs after the input conv
    encoder_bottleneck: int = 32  # per-frame feature the tokens are clustered from
    encoder_max_steps: int = 400
    encoder_batch_size: int = 16
    encoder_crop_frames: int = 200
    encoder_lr: float = 2e-3
    pca_dim: int = 64  # 0 = cluster the raw stacked frames
    kmeans_max_vectors: int = 150_000
    kmeans_iters: int = 40
    decoder_channels: int = 192
    decoder_token_layers: int = 4  # dilated convs at 25 Hz: the context each token sees
    decoder_frame_layers: int = 2
    # What the decoder predicts: "log_mel" (n_mels bins, mapped to linear magnitude by the filterbank's
    # pseudo-inverse) trains ~4x faster per step than "log_magnitude" (n_fft//2+1 bins) and gave lower WER.
    decoder_target: str = "log_mel"
    decoder_max_steps: int = 1500  # governs training length and the lr schedule: deterministic
    decoder_train_seconds: float = 1800.0  # safety cap only; the fit report says if it cut training short
    decoder_batch_size: int = 32
    decoder_crop_tokens: int = 40
    decoder_lr: float = 2e-3
    griffin_lim_iters: int = 32
    num_threads: int = 2

    def __post_init__(self) -> None:
        if self.sample_rate % (self.hop_length * self.token_rate):
            raise ValueError(
                f"ToyCodecConfig: sample_rate {self.sample_rate} must be a multiple of "
                f"hop_length*token_rate = {self.hop_length * self.token_rate}"
            )
        if self.features not in FEATURES:
            raise ValueError(f"ToyCodecConfig: features must be one of {FEATURES}, got {self.features!r}")
        if self.decoder_target not in DECODER_TARGETS:
            raise ValueError(
                f"ToyCodecConfig: decoder_target must be one of {DECODER_TARGETS}, got {self.decoder_target!r}"
            )
        if self.codebook_size < 2:
            raise ValueError(f"ToyCodecConfig: codebook_size must be >= 2, got {self.codebook_size}")

    @property
    def frames_per_token(self) -> int:
        return self.sample_rate // (self.hop_length * self.token_rate)

    @classmethod
    def from_dict(cls, d: dict | None) -> ToyCodecConfig:
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"toy codec config: unknown keys {unknown}; known keys: {sorted(known)}")
        return cls(**d)


def frame_features(log_mel: torch.Tensor, encoder: PhoneticEncoder | None) -> torch.Tensor:
    """Per-frame features the tokens are clustered from [D, frames]: the utterance-mean-removed log-mel,
    through the phonetic encoder when there is one."""
    normed = log_mel - log_mel.mean(dim=1, keepdim=True)
    if encoder is None:
        return normed
    if normed.shape[1] == 0:  # shorter than one frame: convolutions cannot pad an empty input
        return normed.new_zeros(encoder.bottleneck.out_channels, 0)
    with torch.inference_mode():
        return encoder.features(normed[None])[0]


def stack_frames(frames: torch.Tensor, frames_per_token: int) -> np.ndarray:
    """[D, frames] -> [T_tok, D * frames_per_token]: the frames of each 25 Hz token side by side."""
    t = frames.shape[1] // frames_per_token
    return frames[:, : t * frames_per_token].T.reshape(t, frames.shape[0] * frames_per_token).numpy()


class ToyCodec:
    """Fitted tokenizer + vocoder. Build with `fit`, persist with `save`/`load`."""

    def __init__(
        self,
        cfg: ToyCodecConfig,
        pca_mean: np.ndarray,
        pca_components: np.ndarray,
        centroids: np.ndarray,
        mean_voice: np.ndarray,
        decoder: TokenDecoder,
        encoder: PhoneticEncoder | None = None,
        phones: Sequence[str] = (),
    ) -> None:
        if (encoder is None) != (cfg.features != "phonetic"):
            raise ValueError(
                f"ToyCodec: features={cfg.features!r} needs a phonetic encoder exactly when phonetic"
            )
        self.cfg = cfg
        self.encoder = None if encoder is None else encoder.eval()
        self.phones = list(phones)
        self.pca_mean = pca_mean.astype(np.float32)
        self.pca_components = pca_components.astype(np.float32)
        self.centroids = centroids.astype(np.float32)
        self.mean_voice = mean_voice.astype(np.float32)
        self.decoder = decoder.eval()
        self.mel_fb = mel_filterbank(cfg.n_mels, cfg.sample_rate, cfg.n_fft, htk=True)
        self.mel_to_linear = torch.linalg.pinv(self.mel_fb)
        self.fit_report: dict = {}

    sample_rate = property(lambda self: self.cfg.sample_rate)
    token_rate = property(lambda self: self.cfg.token_rate)
    codebook_size = property(lambda self: self.cfg.codebook_size)

    # ---- analysis -----------------------------------------------------------------------------------
    @staticmethod
    def _magnitude(wav: np.ndarray, cfg: ToyCodecConfig) -> torch.Tensor:
        """|STFT| [n_freq, frames], frames cut to a whole number of tokens (a shorter tail is dropped)."""
        n_tokens = len(wav) // (cfg.hop_length * cfg.frames_per_token)
        # Centred STFT reflect-pads n_fft // 2 samples, which needs at least that many.
        x = torch.from_numpy(np.pad(np.asarray(wav, dtype=np.float32), (0, max(0, cfg.n_fft - len(wav)))))
        spec = torch.stft(
            x,
            cfg.n_fft,
            cfg.hop_length,
            cfg.win_length,
            window=torch.hann_window(cfg.win_length),
            center=True,
            return_complex=True,
        ).abs()
        return spec[:, : n_tokens * cfg.frames_per_token]

    @staticmethod
    def _log_mel(mag: torch.Tensor, fb: torch.Tensor) -> torch.Tensor:
        return torch.log(torch.clamp(fb @ mag, min=1e-5))

    def _check_wav(self, wav: np.ndarray, sr: int) -> np.ndarray:
        wav = np.asarray(wav, dtype=np.float32)
        if wav.ndim != 1:
            raise ValueError(
                f"ToyCodec.encode: expected mono audio of shape [samples], got shape {wav.shape}"
            )
        return resample(wav, sr, self.sample_rate)

    def _project(self, feats: np.ndarray) -> np.ndarray:
        return (feats - self.pca_mean) @ self.pca_components.T

    def encode(self, wav: np.ndarray, sr: int) -> np.ndarray:
        """Audio -> int64 tokens [T_tok] at `token_rate` (one token per 1/25 s; a tail shorter than that is dropped)."""
        wav = self._check_wav(wav, sr)
        log_mel = self._log_mel(self._magnitude(wav, self.cfg), self.mel_fb)
        return self._nearest(stack_frames(frame_features(log_mel, self.encoder), self.cfg.frames_per_token))

    def voice_of(self, wav: np.ndarray, sr: int) -> np.ndarray:
        """The voice statistic the decoder is conditioned on: mean log-mel [n_mels] of `wav`."""
        wav = self._check_wav(wav, sr)
        mag = self._magnitude(wav, self.cfg)
        if mag.shape[1] == 0:
            raise ValueError(f"ToyCodec: prompt audio of {len(wav)} samples is shorter than one token")
        return self._log_mel(mag, self.mel_fb).mean(1).numpy()

    # ---- synthesis ----------------------------------------------------------------------------------
    def decode(
        self,
        tokens: np.ndarray,
        prompt_tokens: np.ndarray | None = None,
        prompt_wav: np.ndarray | None = None,
    ) -> np.ndarray:
        """Tokens -> float32 audio at `sample_rate`, len(tokens) / token_rate seconds long.

        prompt_wav (at `sample_rate`) sets the voice; without it the training set's average voice is used.
        prompt_tokens are decoded as left context and cut off, as CosyVoice's flow stage does.
        """
        if len(np.asarray(tokens).reshape(-1)) == 0:
            return np.zeros(0, dtype=np.float32)
        voice = self.mean_voice if prompt_wav is None else self.voice_of(prompt_wav, self.sample_rate)
        return griffin_lim(self.magnitude(tokens, prompt_tokens, voice), self.cfg)

    def magnitude(
        self, tokens: np.ndarray, prompt_tokens: np.ndarray | None, voice: np.ndarray
    ) -> torch.Tensor:
        """|STFT| [n_freq, len(tokens) * frames_per_token] the decoder gives `tokens` after the prompt's tokens
        (their frames cut off) in the voice `voice` (`voice_of`)."""
        tokens = np.asarray(tokens)
        if tokens.ndim != 1:
            raise ValueError(f"ToyCodec.decode: tokens must have shape [T], got {tokens.shape}")
        if len(tokens) and (tokens.min() < 0 or tokens.max() >= self.codebook_size):
            raise ValueError(
                f"ToyCodec.decode: token ids must lie in [0, {self.codebook_size}), got "
                f"[{tokens.min()}, {tokens.max()}] (strip EOS/stop tokens before decoding)"
            )
        n_prompt = 0
        if prompt_tokens is not None and len(prompt_tokens):
            prompt_tokens = np.asarray(prompt_tokens, dtype=np.int64).reshape(-1)
            n_prompt = len(prompt_tokens)
            tokens = np.concatenate([prompt_tokens, tokens])
        with torch.inference_mode():
            log_mag = self.decoder(
                torch.as_tensor(tokens, dtype=torch.long)[None], torch.from_numpy(np.asarray(voice))[None]
            )[0]
        magnitude = log_mag[:, n_prompt * self.cfg.frames_per_token :].exp()
        if self.cfg.decoder_target == "log_mel":
            magnitude = torch.clamp(self.mel_to_linear @ magnitude, min=1e-5)
        return magnitude

    # ---- persistence --------------------------------------------------------------------------------
    def save(self, directory: str | Path) -> None:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        write_atomic(
            d / "codec.npz",
            lambda f: np.savez(
                f,
                pca_mean=self.pca_mean,
                pca_components=self.pca_components,
                centroids=self.centroids,
                mean_voice=self.mean_voice,
            ),
        )
        write_checkpoint(d / "decoder.pt", self.decoder.state_dict())
        if self.encoder is not None:
            write_checkpoint(d / "encoder.pt", self.encoder.state_dict())
        meta = {
            "format_version": FORMAT_VERSION,
            "config": asdict(self.cfg),
            "phones": self.phones,
            "fit_report": self.fit_report,
        }
        write_atomic(d / "codec.json", json.dumps(meta, indent=1))

    @classmethod
    def load(cls, path: str | Path) -> ToyCodec:
        """The codec saved in directory `path` (configs/speech_tokenizer/toy.yaml instantiates it by `path`)."""
        d = Path(path)
        meta = json.loads((d / "codec.json").read_text()) if (d / "codec.json").is_file() else {}
        needed = ["codec.json", "codec.npz", "decoder.pt"]
        if meta.get("config", {}).get("features") == "phonetic":
            needed.append("encoder.pt")
        missing = [n for n in needed if not (d / n).is_file()]
        if missing:
            raise FileNotFoundError(
                f"ToyCodec.load: {d} lacks {missing}; build it with scripts/build_toy_world.py"
            )
        if meta.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"ToyCodec.load: {d / 'codec.json'} has format_version {meta.get('format_version')}, "
                f"this code reads {FORMAT_VERSION}; rebuild the codec"
            )
        cfg = ToyCodecConfig.from_dict(meta["config"])
        try:  # arrays only: an object array would be unpickled, i.e. could run code
            with np.load(d / "codec.npz", allow_pickle=False) as npz:
                arrays = {name: npz[name] for name in npz.files}
        except Exception as err:  # numpy raises ValueError, OSError, BadZipFile, ... for a bad file
            raise ValueError(
                f"{d / 'codec.npz'} is not a readable toy codec array file ({str(err).splitlines()[0][:160]}): "
                "rebuild the codec (scripts/build_toy_world.py)"
            ) from None
        decoder = TokenDecoder(cfg)
        decoder.load_state_dict(read_checkpoint(d / "decoder.pt", "toy codec decoder"))
        encoder = None
        if cfg.features == "phonetic":
            encoder = PhoneticEncoder(cfg, len(meta["phones"]) * cfg.phone_states)
            encoder.load_state_dict(read_checkpoint(d / "encoder.pt", "toy codec encoder"))
        codec = cls(
            cfg,
            arrays["pca_mean"],
            arrays["pca_components"],
            arrays["centroids"],
            arrays["mean_voice"],
            decoder,
            encoder,
            meta["phones"],
        )
        codec.fit_report = meta.get("fit_report", {})
        return codec

    def _nearest(self, feats: np.ndarray) -> np.ndarray:
        """Index of the nearest centroid per row of stacked token features."""
        proj = self._project(feats)
        # Squared distance minus the row's own norm (constant per row): one matmul.
        d = -2 * proj @ self.centroids.T + (self.centroids**2).sum(1)[None]
        return d.argmin(1).astype(np.int64)


def griffin_lim(magnitude: torch.Tensor, cfg: ToyCodecConfig, momentum: float = 0.99) -> np.ndarray:
    """Fast Griffin-Lim (Perraudin et al. 2013) from |STFT| [n_freq, frames] (torchaudio is unusable here).

    Phase starts at zero, so the output is deterministic.
    """
    window = torch.hann_window(cfg.win_length)
    length = magnitude.shape[1] * cfg.hop_length
    stft_args = dict(n_fft=cfg.n_fft, hop_length=cfg.hop_length, win_length=cfg.win_length, window=window)
    angles = torch.ones_like(magnitude, dtype=torch.complex64)
    previous = torch.zeros_like(angles)
    for _ in range(cfg.griffin_lim_iters):
        wav = torch.istft(magnitude * angles, length=length, **stft_args)
        rebuilt = torch.stft(wav, center=True, return_complex=True, **stft_args)[:, : magnitude.shape[1]]
        angles = rebuilt - momentum / (1 + momentum) * previous
        angles = angles / (angles.abs() + 1e-8)
        previous = rebuilt
    wav = torch.istft(magnitude * angles, length=length, **stft_args)
    return wav.numpy().astype(np.float32)


class ToyVocoder:
    """The toy codec's decoder; the prompt's tokens are left context and its audio sets the voice.

    Streaming (`stream`): CosyVoice's chunk schedule (token_hop_len, pre_lookahead_len, align_prompt:
    `ssd.audio.streaming.ChunkSchedule`) and HiFT's cache, `cache_frames` spectrogram frames (16 at 100 Hz: the
    160 ms of HiFT's 8 mel frames at 50 Hz) and their audio, crossfaded under a Hamming window."""

    def __init__(
        self,
        codec_dir: str | Path | None,
        token_hop_len: int = 25,
        pre_lookahead_len: int = 3,
        align_prompt: bool = True,
        cache_frames: int = 16,
    ) -> None:
        if codec_dir is None or not Path(codec_dir).is_dir():
            raise FileNotFoundError(
                f"vocoder.codec_dir={codec_dir}: no toy codec there; build the toy world "
                "(python scripts/build_toy_world.py) or set vocoder.codec_dir"
            )
        self.codec = ToyCodec.load(codec_dir)
        if not 1 <= cache_frames <= token_hop_len * self.codec.cfg.frames_per_token:
            raise ValueError(
                f"vocoder.cache_frames={cache_frames} must lie in [1, token_hop_len x frames per token = "
                f"{token_hop_len * self.codec.cfg.frames_per_token}] (a chunk holds the frames it caches)"
            )
        self.sample_rate = self.codec.sample_rate
        # The codec's vocabulary, which the runner's pairing check compares with the tokenizer and target.
        self.codebook_size, self.token_rate = self.codec.codebook_size, self.codec.token_rate
        self.schedule = ChunkSchedule(token_hop_len, pre_lookahead_len, align_prompt)
        self.cache_frames = int(cache_frames)

    def vocode(self, tokens: np.ndarray, prompt: VocoderPrompt) -> np.ndarray:
        wav = resample(prompt.wav, prompt.sample_rate, self.sample_rate)
        return self.codec.decode(np.asarray(tokens, dtype=np.int64), prompt.tokens, wav)

    def stream(self, prompt: VocoderPrompt) -> ToyStream:
        wav = resample(prompt.wav, prompt.sample_rate, self.sample_rate)
        return ToyStream(self, prompt.tokens, self.codec.voice_of(wav, self.sample_rate))


class ToyStream(ChunkedStream):
    """One utterance streamed by the toy vocoder: each call reruns the decoder on every token so far (the prompt's
    as left context), keeps the frames of tokens token_offset .. end (end: all but the lookahead, or all when
    finalizing), prepends the cached frames, runs Griffin-Lim, crossfades the cached audio into the start and
    holds back the new tail, as upstream's HiFT cache."""

    def __init__(self, vocoder: ToyVocoder, prompt_tokens: np.ndarray, voice: np.ndarray) -> None:
        prompt_tokens = np.asarray(prompt_tokens, dtype=np.int64).reshape(-1)
        super().__init__(vocoder.schedule, len(prompt_tokens))
        self.codec, self.prompt, self.voice = vocoder.codec, prompt_tokens, voice
        self.cache_frames = vocoder.cache_frames
        self.overlap = self.cache_frames * self.codec.cfg.hop_length  # samples of the cached frames
        self.window = np.hamming(2 * self.overlap).astype(np.float32)
        self.cache: tuple[torch.Tensor, np.ndarray] | None = None  # (frames, their audio)

    def _synthesise(self, tokens: np.ndarray, token_offset: int, finalize: bool) -> np.ndarray:
        fpt = self.codec.cfg.frames_per_token
        end = len(tokens) if finalize else len(tokens) - self.schedule.pre_lookahead_len
        frames = self.codec.magnitude(tokens, self.prompt, self.voice)[:, token_offset * fpt : end * fpt]
        if self.cache is not None:
            frames = torch.cat([self.cache[0], frames], 1)
        wav = griffin_lim(frames, self.codec.cfg)
        if self.cache is not None:
            wav = fade_in_out(wav, self.cache[1], self.window)
        if finalize:
            return wav
        self.cache = (frames[:, -self.cache_frames :], wav[-self.overlap :])
        return wav[: -self.overlap]

    def _close(self) -> None:
        self.cache = None
