"""Tiny real-format model directories for tests.

The fixtures `tiny_cosyvoice2_dir`, `tiny_cosyvoice3_dir` and `tiny_llasa_dir` are registered for every
test by tests/conftest.py (`pytest_plugins`): take them by parameter name. The builders and constants
(`make_tiny_cosyvoice2_dir`, `TINY_SPEECH_TOKENS`, ...) are plain imports.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

WORDS = (
    "bin lay place set blue green red white at by in with "
    "zero one two three four five six seven eight nine again now please soon"
).split()

TINY_QWEN2 = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    max_position_embeddings=512,
    initializer_range=0.2,  # large, so random logits are far from uniform
)
TINY_SPEECH_TOKENS = 61  # head = 64 entries; EOS = 61; stop tokens 61..63

TINY_LLAMA = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    max_position_embeddings=512,
    initializer_range=0.2,
    tie_word_embeddings=True,
)
TINY_LLASA_SPEECH_TOKENS = 40


def make_tiny_cosyvoice2_dir(
    path: Path, seed: int = 0, speech_tokens: int = TINY_SPEECH_TOKENS, **config_overrides
) -> Path:
    """A random-weight CosyVoice 2 dir (llm.pt + CosyVoice-BlankEN/) with a word tokenizer."""
    from ssd.models.checkpoints import write_cosyvoice2_dir
    from ssd.models.text_tokenizer import write_word_tokenizer

    tokenizer_dir = write_word_tokenizer(WORDS, Path(path).parent / f"{Path(path).name}_words")
    return write_cosyvoice2_dir(path, {**TINY_QWEN2, **config_overrides}, speech_tokens, tokenizer_dir, seed)


COSYVOICE3_INSTRUCTION_WORDS = ["you", "are", "a", "helpful", "assistant"]  # its default instruction's words


def make_tiny_cosyvoice3_dir(
    path: Path, seed: int = 0, speech_token_size: int = TINY_SPEECH_TOKENS, **config_overrides
) -> Path:
    """A random-weight CosyVoice 3 dir (llm.pt with speech_token_size + 200 special rows, CosyVoice-BlankEN/)
    with a word tokenizer that knows the default instruction's words."""
    from ssd.models.checkpoints import write_cosyvoice3_dir
    from ssd.models.text_tokenizer import write_word_tokenizer

    words = WORDS + COSYVOICE3_INSTRUCTION_WORDS
    tokenizer_dir = write_word_tokenizer(words, Path(path).parent / f"{Path(path).name}_words")
    return write_cosyvoice3_dir(
        path, {**TINY_QWEN2, **config_overrides}, speech_token_size, tokenizer_dir, seed
    )


def make_tiny_llasa_dir(path: Path, seed: int = 0) -> Path:
    """A random-weight LLaSA dir (config.json + model.safetensors + tokenizer with chat template)."""
    from ssd.models.checkpoints import write_llasa_dir
    from ssd.models.text_tokenizer import write_word_tokenizer

    words = WORDS + ["user", "assistant", "convert", "the", "text", "to", "speech", ":"]
    tokenizer_dir = write_word_tokenizer(words, Path(path).parent / f"{Path(path).name}_words")
    return write_llasa_dir(path, TINY_LLAMA, TINY_LLASA_SPEECH_TOKENS, tokenizer_dir, seed)


@pytest.fixture(scope="session")
def tiny_cosyvoice2_dir(tmp_path_factory) -> Path:
    return make_tiny_cosyvoice2_dir(tmp_path_factory.mktemp("models") / "cosyvoice2")


@pytest.fixture(scope="session")
def tiny_cosyvoice3_dir(tmp_path_factory) -> Path:
    return make_tiny_cosyvoice3_dir(tmp_path_factory.mktemp("models") / "cosyvoice3")


@pytest.fixture(scope="session")
def tiny_llasa_dir(tmp_path_factory) -> Path:
    return make_tiny_llasa_dir(tmp_path_factory.mktemp("models") / "llasa")
