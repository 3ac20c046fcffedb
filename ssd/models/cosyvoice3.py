"""CosyVoice 3's speech LM (upstream `CosyVoice3LM`) behind the engine's SpeechLM interface.

Loads a Fun-CosyVoice3-0.5B model directory as distributed (docs/target-cosyvoice3.md): `llm.pt` and the
Qwen2 config + tokenizer in `CosyVoice-BlankEN/`, strictly, with the CosyVoice 2 loader
(`ssd.models.cosyvoice2`); what differs is declared here. Key layout of `llm.pt`:

    speech_embedding.weight        [S+200, H]   S = speech_token_size; rows S.. are the special ids below
    llm_decoder.weight             [S+200, H]   no bias
    llm.model.model.*, llm.model.lm_head.weight as CosyVoice 2 (Qwen2; no llm_embedding table)

Special ids inside the speech vocabulary: sos = S, EOS = S+1, task_id = S+2, fill = S+3; S+4..S+199 are
unused rows. Every one of the 200 ends a sequence. Input layout (upstream `Qwen2LM.inference` run by a
`CosyVoice3LM`): [speech_embedding[sos], embed_tokens(prompt_text ++ text), speech_embedding[task_id],
speech_embedding(prompt speech tokens)], where the text carries an instruction ending in <|endofprompt|>.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ssd.models.backbone_config import BackboneConfig
from ssd.models.base import prompt_rows
from ssd.models.cosyvoice2 import TEXT_SPECIAL_TOKENS as COSYVOICE2_TEXT_SPECIAL_TOKENS
from ssd.models.cosyvoice2 import CosyVoice2LM, CosyVoice2Prompt

SPECIAL_SPEECH_ROWS = 200
END_OF_PROMPT = "<|endofprompt|>"
# The instruction of upstream's zero-shot example and of its LibriTTS recipe (examples/libritts/cosyvoice3/run.sh
# writes it as every utterance's instruct text for training).
INSTRUCTION = "You are a helpful assistant."
# CosyVoice3Tokenizer (cosyvoice/tokenizer/tokenizer.py) adds CosyVoice 2's markers, <|endofsystem|>, then
# ARPAbet and pinyin units, in this order (the order fixes their ids).
_ARPABET = (
    "AA AA0 AA1 AA2 AE AE0 AE1 AE2 AH AH0 AH1 AH2 AO AO0 AO1 AO2 AW AW0 AW1 AW2 AY AY0 AY1 AY2 B CH D DH "
    "EH EH0 EH1 EH2 ER ER0 ER1 ER2 EY EY0 EY1 EY2 F G HH IH IH0 IH1 IH2 IY IY0 IY1 IY2 JH K L M N NG OW OW0 "
    "OW1 OW2 OY OY0 OY1 OY2 P R S SH T TH UH UH0 UH1 UH2 UW UW0 UW1 UW2 V W Y Z ZH"
)
_PINYIN = (
    "a ai an ang ao b c ch d e ei en eng f g h i ian in ing iu ià iàn iàng iào iá ián iáng iáo iè ié iòng "
    "ióng iù iú iā iān iāng iāo iē iě iōng iū iǎ iǎn iǎng iǎo iǒng iǔ j k l m n o ong ou p q r s sh t u "
    "uang ue un uo uà uài uàn uàng uá uái uán uáng uè ué uì uí uò uó uā uāi uān uāng uē uě uī uō uǎ uǎi "
    "uǎn uǎng uǐ uǒ vè w x y z zh à ài àn àng ào á ái án áng áo è èi èn èng èr é éi én éng ér ì ìn ìng í "
    "ín íng ò òng òu ó óng óu ù ùn ú ún ā āi ān āng āo ē ēi ēn ēng ě ěi ěn ěng ěr ī īn īng ō ōng ōu ū ūn "
    "ǎ ǎi ǎn ǎng ǎo ǐ ǐn ǐng ǒ ǒng ǒu ǔ ǔn ǘ ǚ ǜ"
)
TEXT_SPECIAL_TOKENS = (
    *COSYVOICE2_TEXT_SPECIAL_TOKENS,
    "<|endofsystem|>",
    *(f"[{unit}]" for unit in (_ARPABET + " " + _PINYIN).split()),
)
# Upstream's CosyVoice3Model drops a silent / breath FSQ token from what the flow hears once more than
# MAX_SILENT_RUN of them come in a row (cosyvoice/cli/model.py `llm_job`, since 2025-12-30); the LM's own
# context keeps them.
SILENT_TOKENS = frozenset((1, 2, 28, 29, 55, 248, 494, 2241, 2242, 2322, 2323))
MAX_SILENT_RUN = 5


class CosyVoice3Prompt(CosyVoice2Prompt):
    """A batch of CosyVoice 3 prompts: as CosyVoice 2's, and each row's text ids must hold <|endofprompt|>
    (make_prompt puts the instruction in front of the prompt text)."""


class CosyVoice3LM(CosyVoice2LM):
    """CosyVoice 3 speech LM: CosyVoice 2's Qwen2 adapter with upstream CosyVoice3LM's special rows.

    instruction: the text before <|endofprompt|> that make_prompt puts in front of each prompt text and
        training rows put in front of each text (docs/target-cosyvoice3.md §2).
    drop_long_silences: codec_tokens drops silent tokens beyond a run of MAX_SILENT_RUN, as upstream's
        CosyVoice3Model does before its flow (false: every generated token reaches the vocoder).
    """

    model_name = "CosyVoice 3"
    model_dir_example = "/path/to/Fun-CosyVoice3-0.5B"
    model_dir_env = "COSYVOICE3_DIR"
    text_special_tokens = TEXT_SPECIAL_TOKENS
    special_speech_rows = SPECIAL_SPEECH_ROWS
    head_bias = False
    prompt_class = CosyVoice3Prompt

    def __init__(
        self,
        backbone_config: BackboneConfig,
        speech_token_size: int,
        tokenizer: Any = None,
        instruction: str = INSTRUCTION,
        drop_long_silences: bool = True,
    ) -> None:
        super().__init__(backbone_config, speech_token_size, tokenizer)
        s = speech_token_size
        self.sos_token, self.task_id_token, self.fill_token = s, s + 2, s + 3
        self.instruction = instruction
        self.drop_long_silences = drop_long_silences
        self.end_of_prompt_id: int | None = None
        self.instruction_ids: list[int] | None = None
        if tokenizer is not None:
            vocab = tokenizer.get_vocab()
            self.instruction_ids = self.tokenize(instruction + END_OF_PROMPT)
            if END_OF_PROMPT not in vocab or self.instruction_ids[-1:] != [vocab[END_OF_PROMPT]]:
                raise ValueError(
                    f"the text tokenizer does not keep {END_OF_PROMPT} as one token (instruction {instruction!r} "
                    f"gives ids {self.instruction_ids}): load it with CosyVoice 3's special tokens "
                    "(ssd.models.cosyvoice3.TEXT_SPECIAL_TOKENS; from_dir adds them)"
                )
            self.end_of_prompt_id = vocab[END_OF_PROMPT]

    def _make_llm_embedding(self, hidden_size: int) -> None:
        return None  # sos and task_id are rows of speech_embedding

    @classmethod
    def _stop_ids(cls, speech_token_size: int) -> tuple[int, tuple[int, ...]]:
        """(EOS = S+1, stop tokens S..S+199). The first stop token is S, not EOS: it is the id upstream's
        min_len rule names (`sampling_ids` refuses `speech_token_size`), so eos_mode=mask_eos / resample_eos
        refuse what upstream refuses (docs/target-cosyvoice3.md §3)."""
        s = speech_token_size
        return s + 1, tuple(range(s, s + cls.special_speech_rows))

    @classmethod
    def from_dir(
        cls,
        model_dir: str | Path | None,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "cpu",
        instruction: str = INSTRUCTION,
        drop_long_silences: bool = True,
    ) -> CosyVoice3LM:
        """Load a Fun-CosyVoice3-0.5B model directory (llm.pt + CosyVoice-BlankEN/)."""
        return cls._load_dir(
            model_dir, dtype, device, instruction=instruction, drop_long_silences=drop_long_silences
        )

    # --- prompts -------------------------------------------------------------------------------
    def make_prompt(
        self,
        texts: Sequence[str],
        prompt_texts: Sequence[str] | None = None,
        prompt_speech_tokens: Sequence[Sequence[int]] | None = None,
    ) -> CosyVoice3Prompt:
        """As CosyVoice 2's, with each prompt text read as upstream's zero-shot example writes it:
        `{instruction}<|endofprompt|>{prompt text}`. A prompt text or text that already holds <|endofprompt|>
        is taken as given (an upstream-style prompt with its own instruction)."""
        prompt_texts, prompt_speech_tokens = prompt_rows(texts, prompt_texts, prompt_speech_tokens)
        prompt_texts = [
            p if END_OF_PROMPT in p or END_OF_PROMPT in t else f"{self.instruction}{END_OF_PROMPT}{p}"
            for p, t in zip(prompt_texts, texts)
        ]
        return super().make_prompt(texts, prompt_texts, prompt_speech_tokens)

    def embed_prompt(self, prompt: CosyVoice3Prompt) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(prompt, self.prompt_class):
            end_of_prompt = self._require_tokenizer_ids()[0]
            for row, (text, speech) in enumerate(zip(prompt.text_ids, prompt.speech_ids)):
                if not bool((text == end_of_prompt).any()):
                    raise ValueError(
                        f"CosyVoice 3 prompt row {row}: its text ids hold no {END_OF_PROMPT} (id {end_of_prompt}); "
                        f"CosyVoice 3 reads an instruction ending in {END_OF_PROMPT} before the text (upstream "
                        "asserts it): build prompts with make_prompt, which adds target.model.instruction"
                    )
                if speech.numel() and int(speech.max()) >= self.speech_token_size:
                    raise ValueError(
                        f"CosyVoice 3 prompt row {row}: prompt speech tokens must be codec tokens "
                        f"< {self.speech_token_size}, got {int(speech.max())} (a special row)"
                    )
        return super().embed_prompt(prompt)

    def codec_tokens(self, tokens: list[int]) -> list[int]:
        """Generated ids -> what upstream's flow hears: silent tokens beyond a run of MAX_SILENT_RUN dropped
        (with drop_long_silences; see SILENT_TOKENS)."""
        if not self.drop_long_silences:
            return list(tokens)
        out, run = [], 0
        for token in tokens:
            run = run + 1 if token in SILENT_TOKENS else 0
            if run <= MAX_SILENT_RUN:
                out.append(token)
        return out

    # --- training ------------------------------------------------------------------------------
    def prefix_embeds(self, text_ids: torch.Tensor) -> torch.Tensor:
        """[sos, instruction ++ <|endofprompt|>, text, task_id]: upstream's CosyVoice 3 training row, whose
        LibriTTS recipe gives every utterance the instruction."""
        instruction = torch.tensor(self._require_tokenizer_ids()[1], dtype=torch.long, device=text_ids.device)
        return self.lm_prefix(torch.cat([instruction, text_ids]))

    def sos_task_id_embeds(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.speech_embedding.weight
        return rows[self.sos_token : self.sos_token + 1], rows[self.task_id_token : self.task_id_token + 1]

    def _require_tokenizer_ids(self) -> tuple[int, list[int]]:
        if self.end_of_prompt_id is None or self.instruction_ids is None:
            raise ValueError(
                "this CosyVoice3LM has no text tokenizer, so it knows neither the id of "
                f"{END_OF_PROMPT} nor its instruction's ids: build it with CosyVoice3LM(tokenizer=...) or from_dir"
            )
        return self.end_of_prompt_id, self.instruction_ids

    # --- drafts --------------------------------------------------------------------------------
    def draft_skeleton(self, num_layers: int) -> CosyVoice3LM:
        with torch.device("meta"):
            return type(self)(
                self.backbone.config.with_layers(num_layers), self.speech_token_size, self.tokenizer,
                instruction=self.instruction, drop_long_silences=self.drop_long_silences,
            )  # fmt: skip
