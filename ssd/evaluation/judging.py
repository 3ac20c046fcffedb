"""One decoded item, vocoded and judged: the record `utterances.jsonl` holds for it (without its timing)."""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch

from ssd.evaluation.items import Item

log = logging.getLogger(__name__)


def judge(m: Any, item: Item, tokens: list[int], finish_reason: str, row: dict, limits: tuple[int, int],
          streaming: bool = False, audio: tuple[np.ndarray, float] | None = None) -> tuple[dict, np.ndarray]:  # fmt: skip
    """Vocode (timed) and judge one decoded item; returns (record without the LM timing, waveform).
    streaming: the audio is the vocoder's streamed chunks, concatenated; `audio`: (that waveform, the seconds its
    synthesis took) when a timed streaming decode already made it."""
    from ssd.audio.speaker import similarity
    from ssd.evaluation.streaming import streamed_wav
    from ssd.evaluation.wer import utterance_wer

    pair = item.pair
    token_rate = getattr(m.speech_tokenizer, "token_rate", 25)
    # The PCG stress test (perturb): the vocoder hears other tokens than the LM generated.
    vocoded = m.perturb(tokens, item.seed) if m.perturb is not None else tokens
    codes = m.target.codec_tokens(vocoded)
    if audio is not None:
        wav, vocoder_time = audio
    elif streaming:
        wav, vocoder_time = streamed_wav(m.vocoder, codes, item.vprompt)
    else:
        start = time.perf_counter()
        wav = (
            m.vocoder.vocode(np.asarray(codes, dtype=np.int64), item.vprompt)
            if codes
            else np.zeros(0, np.float32)
        )
        if m.target.device.type == "cuda":
            torch.cuda.synchronize(m.target.device)
        vocoder_time = time.perf_counter() - start
    hypothesis = m.asr.transcribe(wav, m.vocoder.sample_rate) if wav.size else ""
    scored = utterance_wer(pair.text, hypothesis)
    try:
        sim = similarity(m.speaker.embed(wav, m.vocoder.sample_rate), item.embedding)
    except ValueError as err:  # too short or silent to embed: recorded as missing, counted in metrics
        log.warning("%s: no SIM (%s)", pair.utt, err)
        sim = None
    accepted_per_round = list(row["accepted_per_round"])
    record = {
        "utt": pair.utt, "speaker": pair.speaker, "prompt_utt": pair.prompt_utt, "text": pair.text,
        "seed": item.seed, "tokens": tokens, "n_tokens": len(tokens), "finish_reason": finish_reason,
        "min_len": int(limits[0]), "max_len": int(limits[1]),
        "audio_sec": len(codes) / token_rate,  # what the vocoder hears (CosyVoice 3 drops long silent runs)
        "vocoder_time": vocoder_time,
        "target_calls": row["target_calls"], "draft_calls": row["draft_calls"], "rounds": row["rounds"],
        "accepted_total": sum(accepted_per_round),
        "proposed": row["proposed"], "accepted": row["accepted"],
        "overlap_sum": row["overlap_sum"], "tv_sum": row["tv_sum"],
        "accepted_per_round": accepted_per_round, "draft_len_per_round": list(row["draft_len_per_round"]),
        "hypothesis": hypothesis, "errors": scored.errors, "ref_words": scored.ref_words, "wer": scored.wer,
        "sim": sim,
        # TV(output law, q) is known when the rule preserves q (0) or the engine computed it; else tv_sum is None.
        "tv_known": row["tv_sum"] is not None,
    }  # fmt: skip
    if m.mos is not None:
        record.update(mos_fields(m.mos, wav, m.vocoder.sample_rate, pair.utt))
    if m.perturb is not None:
        record.update(vocoded_tokens=vocoded, swapped=sum(a != b for a, b in zip(tokens, vocoded)))
    if row.get("beta_audit") is not None:  # the engine's β audit (per accepted draft token)
        record["beta_audit"] = row["beta_audit"]
    if m.language is not None:
        if item.wrong_text is not None:
            wrong = utterance_wer(item.wrong_text, hypothesis)
            record.update(
                wrong_text=item.wrong_text, wrong_errors=wrong.errors, wrong_ref_words=wrong.ref_words
            )
        record["slot_correct"] = m.language.slot_correct(pair.text, hypothesis)
    return record, wav


def mos_fields(judge: Any, wav: np.ndarray, sr: int, utt: str) -> dict:
    """A record's naturalness fields: `nmos` (the judge's primary estimate) and `mos_<key>` for each of
    its `keys`; all None when the audio cannot be judged (too short, silent: counted in metrics as missing)."""
    try:
        scores = judge.score(wav, sr)
    except ValueError as err:
        log.warning("%s: no MOS (%s)", utt, err)
        scores = {}
    return {"nmos": scores.get(judge.primary), **{f"mos_{k}": scores.get(k) for k in judge.keys}}
