"""Text tokenizers from local directories (nothing is fetched from a hub).

`load_text_tokenizer` opens any HF tokenizer directory (the BlankEN Qwen tokenizer of CosyVoice 2,
LLaSA's LLaMA tokenizer, the toy world's word tokenizer); use it as
`tok(text, add_special_tokens=False).input_ids`. `write_word_tokenizer` makes the small
word-level tokenizer of the toy world and of the tests.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
UNK = "[UNK]"
GENERIC_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def load_text_tokenizer(path: str | Path, extra_special_tokens: Sequence[str] = ()) -> Any:
    """A transformers tokenizer from a local directory; BOS/EOS are never added by our callers.

    extra_special_tokens: added as additional special tokens when missing (CosyVoice 2's
    frontend adds its markers such as "[breath]" the same way).
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"text tokenizer directory {path} does not exist")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"text tokenizer directory {path} has none of the tokenizer files {list(TOKENIZER_FILES)}"
        )
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    config_path = path / "tokenizer_config.json"
    declared = json.loads(config_path.read_text()).get("tokenizer_class") if config_path.is_file() else None
    # A generic tokenizers-backed dir (our word tokenizer) must not be re-typed by a model config.json
    # lying beside it (AutoTokenizer would pick Qwen2Tokenizer and add "<|endoftext|>").
    loader = PreTrainedTokenizerFast if declared in GENERIC_TOKENIZER_CLASSES else AutoTokenizer
    tokenizer = loader.from_pretrained(str(path), local_files_only=True)
    missing = [t for t in extra_special_tokens if t not in tokenizer.get_vocab()]
    if missing:
        add_special_tokens(tokenizer, missing)
    return tokenizer


def unknown_words(tokenizer: Any, texts: Iterable[str]) -> list[str]:
    """The words of `texts` (letters and digits of any script; punctuation around them left out) that
    `tokenizer` maps to its unknown token: a word-level tokenizer's out-of-vocabulary words. Byte-level BPE
    tokenizers have none."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None:
        return []
    words = {"".join(ch for ch in w if ch.isalnum() or ch in "'-") for text in texts for w in text.split()}
    words = sorted(w for w in words if any(ch.isalnum() for ch in w))
    ids = tokenizer(words, add_special_tokens=False).input_ids if words else []
    return [w for w, piece in zip(words, ids) if unk in piece]


def add_special_tokens(tokenizer: Any, tokens: Sequence[str]) -> None:
    """Add `tokens` as additional special tokens, keeping the ones the tokenizer already has. The keyword that
    keeps them was renamed in transformers 5 (replace_additional_special_tokens -> replace_extra_special_tokens);
    this takes whichever the installed release has."""
    params = inspect.signature(tokenizer.add_special_tokens).parameters
    keep = next(
        k for k in ("replace_extra_special_tokens", "replace_additional_special_tokens") if k in params
    )
    tokenizer.add_special_tokens({"additional_special_tokens": list(tokens)}, **{keep: False})


def write_word_tokenizer(
    words: Iterable[str],
    out_dir: str | Path,
    special_tokens: Sequence[str] = (),
    lexicon: Mapping[str, Sequence[str]] | None = None,
) -> Path:
    """Write a word-level HF tokenizer (lowercase, whitespace split, "[UNK]" = id 0) to out_dir.

    Ids: [UNK] = 0, then the distinct lowercased words in first-seen order, then special_tokens.
    With `lexicon` (word -> units, e.g. its phones) the tokens are the units instead: a normalizer
    rewrites each whole word as its units, so "kitten" gives [k, ih, t, ax, n] and a word outside the
    lexicon stays one [UNK]. Writes tokenizer.json + tokenizer_config.json; returns out_dir.
    """
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab: dict[str, int] = {UNK: 0}
    rewrites = []
    for word in words:
        word = word.strip().lower()
        if not word or any(ch.isspace() for ch in word):
            raise ValueError(f"write_word_tokenizer: {word!r} is not a single non-empty word")
        if lexicon is None:
            vocab.setdefault(word, len(vocab))
            continue
        units = [str(u).lower() for u in lexicon.get(word, ())]
        if not units or not all(u.isalnum() for u in units):
            raise ValueError(f"write_word_tokenizer: lexicon[{word!r}] = {units}: give alphanumeric units")
        for unit in units:
            vocab.setdefault(unit, len(vocab))
        # Units are lowercase alphanumerics: a rewritten word can never match another word's pattern.
        rewrites.append(normalizers.Replace(Regex(rf"\b{re.escape(word)}\b"), " ".join(units)))
    clashes = sorted(set(vocab) & {w.strip().lower() for w in (lexicon or {})})
    if clashes:
        raise ValueError(
            f"write_word_tokenizer: units {clashes} are also words: a rewrite would be rewritten again"
        )
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.normalizer = normalizers.Sequence([normalizers.Lowercase(), *rewrites])
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token=UNK)
    if special_tokens:
        tokenizer.add_special_tokens({"additional_special_tokens": list(special_tokens)})
    from ssd.files import write_tree

    return write_tree(out_dir, lambda staging: tokenizer.save_pretrained(str(staging)))
