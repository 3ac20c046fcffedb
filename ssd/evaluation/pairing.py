"""One vocabulary per run: the speech tokenizer, the target and the vocoder must speak the same codes.

A tokenizer whose tokens the target was not trained on (CosyVoice 2's 6561 codes at 25 Hz fed to LLaSA,
which reads 65536 X-codec2 codes at 50 Hz) decodes without any error and produces noise, so the pairing is
checked when the models are loaded, before any decoding. Each part states its vocabulary: the speech
tokenizer and the vocoder by `codebook_size` and `token_rate`, the target by `speech_token_size`. A value a
part leaves unset (None, or no such attribute: a user's own class may not know it) is not compared.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

from omegaconf import OmegaConf

from ssd.config_files import CONFIG_MODULE, group_options


def config_label(group: str, node: Any) -> str:
    """`group=<option>` for the configs/<group>/ option whose `_target_` this node calls, else
    `group._target_=<callable>` (a user's own class)."""
    target = node.get("_target_") if node is not None else None
    for option in group_options(group):
        raw = OmegaConf.create(resources.files(CONFIG_MODULE).joinpath(group, f"{option}.yaml").read_text())
        if raw.get("_target_") == target:  # read unresolved: the options interpolate other groups
            return f"{group}={option}"
    return f"{group}._target_={target}"


def _vocabulary(part: Any) -> tuple[int | None, int | None]:
    return getattr(part, "codebook_size", None), getattr(part, "token_rate", None)


def _describe(codes: int | None, rate: int | None) -> str:
    what = [f"{codes} codes" if codes is not None else "codes not stated"]
    if rate is not None:
        what.append(f"at {rate} Hz")
    return " ".join(what)


def check_pairing(
    target_name: str, parts: dict[str, Any], speech_tokenizer: Any, target: Any, vocoder: Any
) -> None:
    """Raise ValueError naming the three configs when the tokenizer, target and vocoder are not one
    vocabulary (codebook sizes against the target's speech_token_size; token rates of tokenizer and vocoder).
    parts: the run's config nodes by key ("speech_tokenizer", "vocoder")."""
    tok_codes, tok_rate = _vocabulary(speech_tokenizer)
    voc_codes, voc_rate = _vocabulary(vocoder)
    target_codes = getattr(target, "speech_token_size", None)
    labels = {
        "speech_tokenizer": config_label("speech_tokenizer", parts.get("speech_tokenizer")),
        "target": f"target={target_name}",
        "vocoder": config_label("vocoder", parts.get("vocoder")),
    }
    problems = []
    if None not in (tok_codes, target_codes) and tok_codes != target_codes:
        problems.append(
            f"{labels['speech_tokenizer']} ({_describe(tok_codes, tok_rate)}) does not match "
            f"{labels['target']} ({target_codes} codes)"
        )
    if None not in (voc_codes, target_codes) and voc_codes != target_codes:
        problems.append(
            f"{labels['vocoder']} ({_describe(voc_codes, voc_rate)}) does not match "
            f"{labels['target']} ({target_codes} codes)"
        )
    if None not in (tok_rate, voc_rate) and tok_rate != voc_rate:
        problems.append(
            f"{labels['speech_tokenizer']} ({_describe(tok_codes, tok_rate)}) and {labels['vocoder']} "
            f"({_describe(voc_codes, voc_rate)}) run at different token rates"
        )
    if problems:
        raise ValueError(
            "; ".join(problems)
            + f" ({labels['speech_tokenizer']}, {labels['target']}, {labels['vocoder']}): "
            "the speech tokenizer, the target and the vocoder must be one vocabulary; choose the target's own "
            f"codec (drop the speech_tokenizer= / vocoder= overrides, so target={target_name} brings its "
            "own) or a target trained on these tokens"
        )
