"""Fitting the toy codec (`fit_codec`): PCA + k-means over the (phonetic) token features of the training
split, then the token decoder. The fitted codec is `ssd.toy_world.codec.ToyCodec`."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import soundfile as sf
import torch

from ssd.audio.features import mel_filterbank
from ssd.toy_world.codec import ToyCodec, ToyCodecConfig, frame_features, stack_frames
from ssd.toy_world.codec_nets import PhoneticEncoder, TokenDecoder
from ssd.toy_world.corpus import ALIGNMENT_SUFFIX, read_alignment


def phone_state_labels(
    alignment: Sequence[tuple[str, float]], n_frames: int, cfg: ToyCodecConfig, phones: dict[str, int]
) -> torch.Tensor:
    """Class per 100 Hz frame: phone index * phone_states + which part of the phone the frame's centre is in."""
    centres = np.arange(n_frames) * cfg.hop_length / cfg.sample_rate  # centred STFT frames
    ends = np.array([end for _, end in alignment])
    starts = np.concatenate([[0.0], ends[:-1]])
    seg = np.minimum(np.searchsorted(ends, centres, side="right"), len(ends) - 1)
    position = (centres - starts[seg]) / np.maximum(ends[seg] - starts[seg], 1e-6)
    state = np.clip((position * cfg.phone_states).astype(int), 0, cfg.phone_states - 1)
    ids = np.array([phones[p] for p, _ in alignment])[seg]
    return torch.from_numpy(ids * cfg.phone_states + state)


def fit_codec(
    wav_paths: Sequence[str | Path],
    cfg: ToyCodecConfig | dict | None = None,
    seed: int = 0,
    progress=True,
) -> ToyCodec:
    """Fit PCA + k-means codebook and the decoder on `wav_paths` (the training split)."""
    from tqdm.auto import tqdm

    cfg = cfg if isinstance(cfg, ToyCodecConfig) else ToyCodecConfig.from_dict(cfg)
    if not wav_paths:
        raise ValueError("fit_codec: no wav files given (is the corpus' training subset empty?)")
    torch.manual_seed(seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.num_threads)
    t0 = time.perf_counter()
    try:
        fb = mel_filterbank(cfg.n_mels, cfg.sample_rate, cfg.n_fft, htk=True)
        log_mels, targets, voices, kept = [], [], [], []
        for path in tqdm(wav_paths, desc="codec: features", disable=not progress):
            wav, sr = sf.read(path, dtype="float32", always_2d=True)
            if sr != cfg.sample_rate:
                raise ValueError(f"fit_codec: {path} is {sr} Hz, the codec config says {cfg.sample_rate} Hz")
            mag = ToyCodec._magnitude(wav[:, 0], cfg)
            if mag.shape[1] == 0:
                continue
            log_mel = ToyCodec._log_mel(mag, fb)
            log_mels.append(log_mel)
            kept.append(Path(path))
            if cfg.decoder_target == "log_mel":
                targets.append(log_mel)
            else:
                targets.append(torch.log(torch.clamp(mag, min=1e-4)))
            voices.append(log_mel.mean(1))
        encoder, phones, encoder_stats = None, [], {}
        if cfg.features == "phonetic":
            encoder, phones, encoder_stats = train_phonetic_encoder(kept, log_mels, cfg, seed, progress)
        feats = [stack_frames(frame_features(m, encoder), cfg.frames_per_token) for m in log_mels]
        stacked = np.concatenate(feats)
        rng = np.random.default_rng(seed)
        sample = stacked[rng.permutation(len(stacked))[: cfg.kmeans_max_vectors]]
        if len(sample) < cfg.codebook_size:
            raise ValueError(
                f"fit_codec: {len(sample)} token frames cannot fill a codebook of {cfg.codebook_size}; "
                "add training audio or lower codebook_size"
            )
        pca_mean = sample.mean(0)
        if cfg.pca_dim:
            # Principal axes = right singular vectors of the centred sample.
            _, _, vt = np.linalg.svd(sample - pca_mean, full_matrices=False)
            components = vt[: min(cfg.pca_dim, sample.shape[1])]
        else:
            components = np.eye(sample.shape[1], dtype=np.float32)
        centroids = kmeans((sample - pca_mean) @ components.T, cfg.codebook_size, cfg.kmeans_iters, seed)
        t_tokenizer = time.perf_counter() - t0
        mean_voice = torch.stack(voices).mean(0).numpy()
        codec = ToyCodec(cfg, pca_mean, components, centroids, mean_voice, TokenDecoder(cfg), encoder, phones)
        tokens = [torch.from_numpy(codec._nearest(f)) for f in feats]
        stats = train_decoder(codec, tokens, targets, voices, seed, progress)
    finally:
        torch.set_num_threads(threads)
    codec.fit_report = {
        "train_utterances": len(feats),
        "train_tokens": int(len(stacked)),
        "tokenizer_seconds": round(t_tokenizer, 1),
        "codebook_used": int(len(np.unique(np.concatenate([t.numpy() for t in tokens])))),
        **encoder_stats,
        **stats,
        "fit_seconds": round(time.perf_counter() - t0, 1),
    }
    return codec


def train_decoder(codec: ToyCodec, tokens, targets, voices, seed: int, progress: bool) -> dict:
    """Train the codec's token decoder on (token, target spectrogram, voice) crops; step-based."""
    from tqdm.auto import tqdm

    cfg, f = codec.cfg, codec.cfg.frames_per_token
    crops = RandomCrops([len(t) for t in tokens], cfg.decoder_crop_tokens, seed)
    model = codec.decoder.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.decoder_lr, weight_decay=1e-4)
    start, losses, step, capped = time.perf_counter(), [], 0, False
    bar = tqdm(total=cfg.decoder_max_steps, desc="codec: decoder", disable=not progress)
    # Step-based, so the result does not depend on machine load; the seconds cap only guards a hang.
    while step < cfg.decoder_max_steps:
        if time.perf_counter() - start > cfg.decoder_train_seconds:
            capped = True
            break
        tok_b, target_b, voice_b = [], [], []
        for i, s, e in crops.sample(cfg.decoder_batch_size):
            tok_b.append(tokens[i][s:e])
            target_b.append(targets[i][:, s * f : e * f])
            voice_b.append(voices[i])
        pred = model(torch.stack(tok_b), torch.stack(voice_b))
        loss = torch.nn.functional.l1_loss(pred, torch.stack(target_b))
        set_cosine_lr(opt, cfg.decoder_lr, step, cfg.decoder_max_steps)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{np.mean(losses[-50:]):.3f}")
    bar.close()
    model.eval()
    return {
        "decoder_steps": step,
        "decoder_stopped_by_seconds_cap": capped,
        "decoder_seconds": round(time.perf_counter() - start, 1),
        "decoder_final_l1": round(float(np.mean(losses[-50:])), 4) if losses else None,
    }


class RandomCrops:
    """Seeded random windows of one length over sequences of `lengths` (the codec's training batches);
    the length is `crop`, cut to the shortest sequence so every sequence can be drawn."""

    def __init__(self, lengths: Sequence[int], crop: int, seed: int) -> None:
        self.lengths, self.crop = list(lengths), min(crop, min(lengths))
        self.generator = torch.Generator().manual_seed(seed)

    def sample(self, batch: int) -> list[tuple[int, int, int]]:
        """`batch` (sequence index, start, end) triples."""
        out = []
        for i in torch.randint(len(self.lengths), (batch,), generator=self.generator).tolist():
            start = int(torch.randint(self.lengths[i] - self.crop + 1, (1,), generator=self.generator))
            out.append((i, start, start + self.crop))
        return out


def set_cosine_lr(opt: torch.optim.Optimizer, base_lr: float, step: int, total: int) -> None:
    for group in opt.param_groups:
        group["lr"] = base_lr * 0.5 * (1 + math.cos(math.pi * step / total))


def train_phonetic_encoder(
    wav_paths: Sequence[Path],
    log_mels: Sequence[torch.Tensor],
    cfg: ToyCodecConfig,
    seed: int,
    progress: bool,
) -> tuple[PhoneticEncoder, list[str], dict]:
    """Train the encoder to classify each frame's phone state from the corpus' alignments (.phones.txt)."""
    from tqdm.auto import tqdm

    alignments = [read_alignment(p.with_suffix(ALIGNMENT_SUFFIX)) for p in wav_paths]
    phones = sorted({phone for a in alignments for phone, _ in a})
    index = {p: i for i, p in enumerate(phones)}
    labels = [
        phone_state_labels(a, m.shape[1], cfg, index) for a, m in zip(alignments, log_mels, strict=True)
    ]
    normed = [m - m.mean(dim=1, keepdim=True) for m in log_mels]
    crops = RandomCrops([m.shape[1] for m in normed], cfg.encoder_crop_frames, seed)
    model = PhoneticEncoder(cfg, len(phones) * cfg.phone_states).train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.encoder_lr, weight_decay=1e-4)
    start, accuracies = time.perf_counter(), []
    bar = tqdm(range(cfg.encoder_max_steps), desc="codec: phonetic encoder", disable=not progress)
    for step in bar:
        batch = crops.sample(cfg.encoder_batch_size)
        x_b = torch.stack([normed[i][:, s:e] for i, s, e in batch])
        y = torch.stack([labels[i][s:e] for i, s, e in batch])
        logits = model(x_b)
        loss = torch.nn.functional.cross_entropy(logits, y)
        set_cosine_lr(opt, cfg.encoder_lr, step, cfg.encoder_max_steps)
        opt.zero_grad()
        loss.backward()
        opt.step()
        accuracies.append(float((logits.argmax(1) == y).float().mean()))
        bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{np.mean(accuracies[-50:]):.3f}")
    return (
        model.eval(),
        phones,
        {
            "phone_states": len(phones) * cfg.phone_states,
            "encoder_steps": cfg.encoder_max_steps,
            "encoder_frame_accuracy": round(float(np.mean(accuracies[-50:])), 3) if accuracies else None,
            "encoder_seconds": round(time.perf_counter() - start, 1),
        },
    )


def kmeans(x: np.ndarray, k: int, iters: int, seed: int) -> np.ndarray:
    """Lloyd's k-means in torch, centroids [k, dim]; empty clusters are re-seeded with the worst-fit points.

    Hand-written because scikit-learn's KMeans took 575 s for 5 iterations (100k x 64, k=1024) on this
    shared 2-core CPU (OpenMP oversubscription); these matmul iterations take well under a second each.
    """
    data = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    gen = torch.Generator().manual_seed(seed)
    centroids = data[torch.randperm(len(data), generator=gen)[:k]].clone()
    sq_norms = (data**2).sum(1)
    for _ in range(iters):
        dist = sq_norms[:, None] - 2 * data @ centroids.T + (centroids**2).sum(1)[None]
        best, assign = dist.min(1)
        counts = torch.bincount(assign, minlength=k)
        sums = torch.zeros_like(centroids).index_add_(0, assign, data)
        filled = counts > 0
        centroids[filled] = sums[filled] / counts[filled, None]
        empty = int((~filled).sum())
        if empty:
            centroids[~filled] = data[best.topk(empty).indices]
    return centroids.numpy()
