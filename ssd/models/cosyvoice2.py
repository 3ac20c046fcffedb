"""CosyVoice 2's speech LM (Qwen2LM) behind the engine's SpeechLM interface.

Loads a CosyVoice2-0.5B model directory as distributed (docs/targets.md §2.1): `llm.pt` and the Qwen2
config + tokenizer in `CosyVoice-BlankEN/` (its `model.safetensors` is for upstream's loader; ours reads
the same weights from llm.pt). Key layout of `llm.pt`, loaded strictly:

    llm_embedding.weight                                   [2, H]      row 0 = sos, row 1 = task_id
    speech_embedding.weight                                [S+3, H]    S = speech_token_size
    llm_decoder.weight, llm_decoder.bias                   [S+3, H], [S+3]
    llm.model.model.embed_tokens.weight                    [V_text, H]
    llm.model.model.layers.{i}.self_attn.{q,k,v}_proj.{weight,bias}
    llm.model.model.layers.{i}.self_attn.o_proj.weight
    llm.model.model.layers.{i}.mlp.{gate,up,down}_proj.weight
    llm.model.model.layers.{i}.{input,post_attention}_layernorm.weight
    llm.model.model.norm.weight                            [H]
    llm.model.lm_head.weight                               [V_text, H] (text head: unused for speech)

Input layout (upstream `Qwen2LM.inference`): [sos, embed_tokens(prompt_text ++ text), task_id,
speech_embedding(prompt speech tokens)], then each generated token through speech_embedding;
logits from llm_decoder (with bias) over S+3 entries; EOS = S, stop tokens S..S+2.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from ssd.files import read_checkpoint, write_tree
from ssd.models.backbone_config import BackboneConfig
from ssd.models.base import (
    CachedSpeechLM,
    check_state_dict,
    pad_right,
    prompt_rows,
    require_model_dir,
    resolve_dtype,
)
from ssd.models.text_tokenizer import load_text_tokenizer
from ssd.models.transformer import Backbone, Linear

LLM_FILE = "llm.pt"
TOKENIZER_SUBDIR = "CosyVoice-BlankEN"
BACKBONE_PREFIX = "llm.model.model."
TEXT_HEAD_KEY = "llm.model.lm_head.weight"
UPSTREAM_QWEN_PREFIX = "llm.model."  # upstream's Qwen2Encoder.model: a transformers Qwen2ForCausalLM
TEXT_LM_WEIGHTS = "model.safetensors"  # in CosyVoice-BlankEN/, read by upstream's loader only
# Upstream's QwenTokenizer adds these to the BlankEN tokenizer (cosyvoice/tokenizer/tokenizer.py).
TEXT_SPECIAL_TOKENS = (
    "<|im_start|>", "<|im_end|>", "<|endofprompt|>", "[breath]", "<strong>", "</strong>", "[noise]",
    "[laughter]", "[cough]", "[clucking]", "[accent]", "[quick_breath]", "<laughter>", "</laughter>",
    "[hissing]", "[sigh]", "[vocalized-noise]", "[lipsmack]", "[mn]",
)  # fmt: skip


@dataclass
class CosyVoice2Prompt:
    """A batch of prompts. Row b: text tokens of prompt_text ++ text, prompt speech tokens, and the
    number of tokens of the target text alone (min_len / max_len are multiples of it)."""

    text_ids: list[torch.Tensor]  # per row, LongTensor [T_text_b]
    speech_ids: list[torch.Tensor]  # per row, LongTensor [T_speech_b] (may be empty)
    target_text_lens: torch.Tensor  # LongTensor [B]

    def __post_init__(self) -> None:
        self.text_ids = [torch.as_tensor(t, dtype=torch.long).reshape(-1) for t in self.text_ids]
        self.speech_ids = [torch.as_tensor(t, dtype=torch.long).reshape(-1) for t in self.speech_ids]
        self.target_text_lens = torch.as_tensor(self.target_text_lens, dtype=torch.long).reshape(-1)
        b = len(self.text_ids)
        if b == 0 or len(self.speech_ids) != b or self.target_text_lens.numel() != b:
            raise ValueError(
                f"{type(self).__name__}: text_ids ({b} rows), speech_ids ({len(self.speech_ids)} rows) and "
                f"target_text_lens ({self.target_text_lens.numel()}) must have the same non-zero batch size"
            )
        for row, (text, n) in enumerate(zip(self.text_ids, self.target_text_lens.tolist())):
            if not 1 <= n <= text.numel():
                raise ValueError(
                    f"{type(self).__name__} row {row}: target_text_lens={n} must be in [1, {text.numel()}] "
                    "(the target text needs at least one token and is part of text_ids)"
                )

    @property
    def batch_size(self) -> int:
        return len(self.text_ids)


class CosyVoice2LM(CachedSpeechLM):
    """CosyVoice 2 speech LM: Qwen2 backbone + sos/task_id embedding + speech embedding and head.

    The class attributes below are what CosyVoice 3 (`ssd.models.cosyvoice3`) changes."""

    min_token_text_ratio = 2
    max_token_text_ratio = 20
    model_name = "CosyVoice 2"
    model_dir_example = "/path/to/CosyVoice2-0.5B"
    model_dir_env = "COSYVOICE2_DIR"
    text_special_tokens = TEXT_SPECIAL_TOKENS
    special_speech_rows = 3  # rows of speech_embedding / llm_decoder after the codec's speech_token_size
    head_bias = True
    prompt_class: type[CosyVoice2Prompt] = CosyVoice2Prompt

    def __init__(
        self, backbone_config: BackboneConfig, speech_token_size: int, tokenizer: Any = None
    ) -> None:
        super().__init__()
        h, rows = backbone_config.hidden_size, speech_token_size + self.special_speech_rows
        self.backbone = Backbone(backbone_config)
        self.llm_embedding = self._make_llm_embedding(h)
        self.speech_embedding = nn.Embedding(rows, h)
        self.llm_decoder = Linear(h, rows, bias=self.head_bias)
        # The text head is never used for speech; kept only when untied so save_dir round-trips.
        self.text_lm_head = (
            None
            if backbone_config.tie_word_embeddings
            else nn.Linear(h, backbone_config.vocab_size, bias=False)
        )
        self.speech_token_size = speech_token_size
        self.vocab_size = rows
        self.eos_token, self.stop_tokens = self._stop_ids(speech_token_size)
        self.tokenizer = tokenizer

    def _make_llm_embedding(self, hidden_size: int) -> nn.Embedding | None:
        """CosyVoice 2's own [2, H] table: row 0 = sos, row 1 = task_id."""
        return nn.Embedding(2, hidden_size)

    @staticmethod
    def _stop_ids(speech_token_size: int) -> tuple[int, tuple[int, ...]]:
        """(EOS, stop tokens): EOS = S; S+1 and S+2 end a sequence too (docs/targets.md §2.2)."""
        s = speech_token_size
        return s, (s, s + 1, s + 2)

    # --- checkpoint format ---------------------------------------------------------------------
    @classmethod
    def from_dir(
        cls,
        model_dir: str | Path | None,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "cpu",
    ) -> CosyVoice2LM:
        """Load a CosyVoice 2 model directory (llm.pt + CosyVoice-BlankEN/)."""
        return cls._load_dir(model_dir, dtype, device)

    @classmethod
    def _load_dir(
        cls,
        model_dir: str | Path | None,
        dtype: str | torch.dtype,
        device: str | torch.device,
        **options: Any,
    ) -> CosyVoice2LM:
        """from_dir's body, shared by the CosyVoice generations; `options` go to the constructor."""
        model_dir = require_model_dir(
            model_dir, cls.model_name, cls.model_dir_example, cls.model_dir_env,
            (LLM_FILE, f"{TOKENIZER_SUBDIR}/config.json"),
            f"a {cls.model_name} model dir holds {LLM_FILE} and {TOKENIZER_SUBDIR}/config.json (+ tokenizer files)",
        )  # fmt: skip
        llm_path, config_path = model_dir / LLM_FILE, model_dir / TOKENIZER_SUBDIR / "config.json"
        backbone_config = _read_backbone_config(config_path, cls.model_name)
        state = read_checkpoint(llm_path, f"{cls.model_name} llm.pt", mmap=True)
        speech_token_size = _speech_rows(state, llm_path, cls.model_name) - cls.special_speech_rows
        if speech_token_size < 1:
            raise ValueError(
                f"{llm_path}: speech_embedding.weight has {speech_token_size + cls.special_speech_rows} rows; a "
                f"{cls.model_name} llm.pt has the codec's tokens + {cls.special_speech_rows} (is this another "
                "CosyVoice generation's checkpoint?)"
            )
        expected = cls.expected_llm_pt_shapes(backbone_config, speech_token_size)
        check_state_dict(state, expected, llm_path)
        tokenizer = load_text_tokenizer(
            model_dir / TOKENIZER_SUBDIR, extra_special_tokens=cls.text_special_tokens
        )
        if len(tokenizer) > backbone_config.vocab_size:
            raise ValueError(
                f"{model_dir / TOKENIZER_SUBDIR}: tokenizer has {len(tokenizer)} tokens (with CosyVoice's special "
                f"tokens) but config.json vocab_size is {backbone_config.vocab_size}"
            )
        with torch.device("meta"):
            model = cls(backbone_config, speech_token_size, tokenizer=tokenizer, **options)
        model.load_state_dict(model._from_llm_pt(state), strict=True, assign=True)
        model.backbone.init_rope()
        return model.to(device=device, dtype=resolve_dtype(dtype)).eval()

    @classmethod
    def expected_llm_pt_shapes(
        cls, config: BackboneConfig, speech_token_size: int
    ) -> dict[str, tuple[int, ...]]:
        """Every key of a valid llm.pt and its shape: this class's own llm.pt keys, built on "meta"."""
        with torch.device("meta"):
            model = cls(config, speech_token_size)
        return {k: tuple(v.shape) for k, v in model.llm_pt_state_dict().items()}

    def llm_pt_state_dict(self) -> dict[str, torch.Tensor]:
        """This model's weights under the exact llm.pt keys (text head tied to embed_tokens when tied)."""
        out: dict[str, torch.Tensor] = {}
        for key, value in self.state_dict().items():
            if key.startswith("backbone."):
                out[BACKBONE_PREFIX + key.removeprefix("backbone.")] = value
            elif key.startswith("text_lm_head."):
                out[TEXT_HEAD_KEY] = value
            else:
                out[key] = value
        out.setdefault(TEXT_HEAD_KEY, self.backbone.embed_tokens.weight.detach())
        return out

    def _from_llm_pt(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for key, value in state.items():
            if key.startswith(BACKBONE_PREFIX):
                out["backbone." + key.removeprefix(BACKBONE_PREFIX)] = value
            elif key == TEXT_HEAD_KEY:
                if self.text_lm_head is not None:
                    out["text_lm_head.weight"] = value
            else:
                out[key] = value
        return out

    def save_dir(self, out_dir: str | Path) -> Path:
        """Write llm.pt + CosyVoice-BlankEN/ (config.json, model.safetensors, the tokenizer) in the
        distributed format, so upstream's CosyVoice2 loader opens the dir as well as ours. Written through
        `ssd.files.write_tree`: each file whole, never through a link."""
        if self.tokenizer is None:
            raise ValueError("save_dir needs the model's text tokenizer (CosyVoice2LM(tokenizer=...))")
        return write_tree(out_dir, self._write_dir)

    def _write_dir(self, out_dir: Path) -> None:
        (out_dir / TOKENIZER_SUBDIR).mkdir(parents=True, exist_ok=True)
        state = {
            k: v.detach().to("cpu", torch.float32).contiguous() for k, v in self.llm_pt_state_dict().items()
        }
        if self.text_lm_head is None:  # tied: one tensor under both keys, as upstream's file has
            state[TEXT_HEAD_KEY] = state[BACKBONE_PREFIX + "embed_tokens.weight"]
        torch.save(state, out_dir / LLM_FILE)  # out_dir: write_tree's fresh staging dir
        # Upstream's Qwen2Encoder runs Qwen2ForCausalLM.from_pretrained(CosyVoice-BlankEN/) before llm.pt is
        # loaded over it, so the text LM's weights must be there too (HF keys: llm.pt's minus "llm.model.").
        text_lm = {
            k.removeprefix(UPSTREAM_QWEN_PREFIX): v
            for k, v in state.items()
            if k.startswith(UPSTREAM_QWEN_PREFIX)
        }
        if self.text_lm_head is None:
            # Tied: transformers ties lm_head to embed_tokens itself (safetensors refuses a shared tensor).
            del text_lm[TEXT_HEAD_KEY.removeprefix(UPSTREAM_QWEN_PREFIX)]
        save_file(text_lm, str(out_dir / TOKENIZER_SUBDIR / TEXT_LM_WEIGHTS), metadata={"format": "pt"})
        hf_config = self.backbone.config.to_hf()
        hf_config.architectures = ["Qwen2ForCausalLM"]
        hf_config.save_pretrained(out_dir / TOKENIZER_SUBDIR)
        self.tokenizer.save_pretrained(str(out_dir / TOKENIZER_SUBDIR))

    # --- prompts -------------------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        """Text token ids with the BlankEN tokenizer, no BOS/EOS (as upstream's frontend)."""
        if self.tokenizer is None:
            raise ValueError(
                f"this {type(self).__name__} has no text tokenizer; build prompts from token ids instead"
            )
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def make_prompt(
        self,
        texts: Sequence[str],
        prompt_texts: Sequence[str] | None = None,
        prompt_speech_tokens: Sequence[Sequence[int]] | None = None,
    ) -> CosyVoice2Prompt:
        """A prompt batch from strings (normalised text) and per-row prompt speech tokens."""
        prompt_texts, prompt_speech_tokens = prompt_rows(texts, prompt_texts, prompt_speech_tokens)
        targets = [self.tokenize(t) for t in texts]
        for row, ids in enumerate(targets):
            if not ids:
                raise ValueError(f"make_prompt row {row}: text {texts[row]!r} has no tokens")
        return self.prompt_class(
            text_ids=[self.tokenize(p) + t for p, t in zip(prompt_texts, targets)],
            speech_ids=[list(s) for s in prompt_speech_tokens],
            target_text_lens=[len(t) for t in targets],
        )

    def length_limits(self, prompt: CosyVoice2Prompt) -> tuple[torch.Tensor, torch.Tensor]:
        """(min_len [B], max_len [B]) of generated tokens: 2x / 20x the target text's token count."""
        n = prompt.target_text_lens
        return self.min_speech_tokens(n), n * self.max_token_text_ratio

    def min_speech_tokens(self, text_lens: torch.Tensor) -> torch.Tensor:
        return text_lens * self.min_token_text_ratio

    # --- SpeechLM pieces -----------------------------------------------------------------------
    def _text_embeds(self, ids: torch.Tensor) -> torch.Tensor:
        vocab = self.backbone.config.vocab_size
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise ValueError(
                f"text token ids must lie in [0, {vocab}), got [{int(ids.min())}, {int(ids.max())}]"
            )
        return self.backbone.embed_tokens(ids)

    def embed_prompt(self, prompt: CosyVoice2Prompt) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(prompt, self.prompt_class):
            raise TypeError(
                f"{type(self).__name__} needs a {self.prompt_class.__name__}, got {type(prompt).__name__}"
            )
        rows = []
        for text, speech in zip(prompt.text_ids, prompt.speech_ids):
            speech = speech.to(self.device)
            self._check_speech_ids(speech, "prompt speech tokens")
            rows.append(torch.cat([self.lm_prefix(text.to(self.device)), self.embed_speech(speech)]))
        return pad_right(rows)

    def embed_speech(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.speech_embedding(tokens)

    def speech_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.llm_decoder(hidden)

    # --- training ------------------------------------------------------------------------------
    def prefix_embeds(self, text_ids: torch.Tensor) -> torch.Tensor:
        """A training row's prefix: the inference one (lm_prefix) of the row's text."""
        return self.lm_prefix(text_ids)

    def lm_prefix(self, text_ids: torch.Tensor) -> torch.Tensor:
        """[sos, text, task_id] (docs/targets.md §2.2): the output at task_id predicts the first speech token."""
        sos, task_id = self.sos_task_id_embeds()
        return torch.cat([sos, self._text_embeds(text_ids), task_id])

    def sos_task_id_embeds(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The sos and task_id input rows, [1, H] each (CosyVoice 2: llm_embedding rows 0 and 1)."""
        return self.llm_embedding.weight[0:1], self.llm_embedding.weight[1:2]

    # --- drafts --------------------------------------------------------------------------------
    def module_groups(self) -> dict[str, nn.Module]:
        groups: dict[str, nn.Module] = {"text_embedding": self.backbone.embed_tokens}
        if self.llm_embedding is not None:
            groups["llm_embedding"] = self.llm_embedding
        groups["speech_embedding"] = self.speech_embedding
        groups.update({f"layers.{i}": layer for i, layer in enumerate(self.backbone.layers)})
        groups["norm"] = self.backbone.norm
        groups["head"] = self.llm_decoder
        if self.text_lm_head is not None:
            groups["text_head"] = self.text_lm_head
        return groups

    def draft_skeleton(self, num_layers: int) -> CosyVoice2LM:
        with torch.device("meta"):
            return type(self)(
                self.backbone.config.with_layers(num_layers), self.speech_token_size, self.tokenizer
            )


def _read_backbone_config(config_path: Path, model_name: str) -> BackboneConfig:
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(str(config_path.parent), local_files_only=True)
    except Exception as err:  # transformers raises several types for a bad config.json
        raise ValueError(f"{config_path}: not a readable HF config ({err})") from err
    if hf_config.model_type != "qwen2":
        raise ValueError(f"{config_path}: model_type is {hf_config.model_type!r}, {model_name} needs 'qwen2'")
    return BackboneConfig.from_hf(hf_config)


def _speech_rows(state: dict[str, torch.Tensor], path: Path, model_name: str) -> int:
    key = "speech_embedding.weight"
    if key not in state:
        raise KeyError(f"{path}: missing key {key!r} (is this a {model_name} llm.pt?)")
    return int(state[key].shape[0])
