"""PCG group sources from the toy world's codec (configs/groups/mel.yaml, codec.yaml): the vectors of head ids
0..S-1 (head id N is codec token N) that `ssd.decoding.pcg.PCGRule` builds its groups over."""

from __future__ import annotations

import torch

from ssd.toy_world.codec import ToyCodec


class _CodecVectors:
    name: str

    def __init__(self, codec_dir: str) -> None:
        if not codec_dir:
            raise ValueError(
                f"groups={self.name} builds groups from a toy codec: set groups.codec_dir (e.g. "
                "${toy_world.dir}/codec), or use groups=embedding"
            )
        self.codec_dir = codec_dir

    def _codec(self, target) -> ToyCodec:
        codec = ToyCodec.load(self.codec_dir)
        speech = int(getattr(target, "speech_token_size", target.vocab_size))
        if codec.codebook_size != speech:
            raise ValueError(
                f"groups.codec_dir={self.codec_dir}: the codec has {codec.codebook_size} tokens but the target "
                f"{speech} speech tokens: point it at this target's codec"
            )
        return codec


class CodecCentroids(_CodecVectors):
    """The toy codec's codebook centroids."""

    name = "codec"

    def __call__(self, target) -> torch.Tensor:
        return torch.from_numpy(self._codec(target).centroids).float()


class MelFrames(_CodecVectors):
    """The log-mel frames the toy codec's decoder gives each token alone (average voice), flattened and centred
    over the vocabulary (the PCG paper's mel-similarity ablation)."""

    name = "mel"

    def __call__(self, target) -> torch.Tensor:
        codec = self._codec(target)
        with torch.inference_mode():
            tokens = torch.arange(codec.codebook_size).unsqueeze(-1)  # each token decoded alone
            voice = torch.from_numpy(codec.mean_voice).expand(codec.codebook_size, -1)
            out = codec.decoder(tokens, voice)  # [V, n_out, frames]
            if codec.cfg.decoder_target == "log_mel":
                log_mel = out
            else:
                log_mel = torch.log(torch.einsum("mf,vft->vmt", codec.mel_fb, out.exp()).clamp_min(1e-5))
        frames = log_mel.flatten(1)
        return frames - frames.mean(0)  # cosine of deviations from the average frame, not of loudness
