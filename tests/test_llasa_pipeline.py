"""The LLaSA pipeline end to end: X-codec2 (through a stand-in of the xcodec2 package's model class),
LibriTTS shards in LLaSA's vocabulary, draft training with the real CLI, and the vocabulary pairing check.

The real xcodec2 package cannot run under torch 2.13 (it imports torchaudio, which has no build for it; its
model class loads facebook/w2v-bert-2.0 by hub id and has fixed full sizes: docs/target-llasa.md, "X-codec2"),
so the tests write a module in the package's layout,
`xcodec2/modeling_xcodec2.py` with a class `XCodec2Model` of the same API (from_pretrained, encode_code,
decode_code) and X-codec2's framing: 16 kHz, one FSQ code of 4^8 = 65536 per 320 samples (50 Hz).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from test_libritts import write_utterance

from ssd.audio.xcodec2 import XCodec2
from ssd.contracts import VocoderPrompt
from ssd.models.llasa import LlasaLM
from tests.fixtures_models import TINY_LLAMA, WORDS

REPO = Path(__file__).resolve().parents[1]
SPEECH_TOKENS = 40  # the tiny LLaSA's <|s_N|> tokens (target.speech_token_size=40)

STANDIN_MODULE = '''
"""Stand-in of xcodec2.modeling_xcodec2 for tests: XCodec2Model's API and framing, a toy codec inside."""
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

HOP = 320  # 16 kHz / 50 Hz
LEVELS = 4  # FSQ levels per dimension; 8 dimensions -> 4**8 = 65536 codes


class XCodec2Model(torch.nn.Module):
    def __init__(self, proj):
        super().__init__()
        self.register_buffer("proj", proj)  # [HOP, 8]

    @classmethod
    def from_pretrained(cls, path):
        json.loads((Path(path) / "config.json").read_text())
        return cls(load_file(str(Path(path) / "model.safetensors"))["proj"])

    def encode_code(self, input_waveform, sample_rate=16000):
        wav = torch.nn.functional.pad(input_waveform, (0, HOP - input_waveform.shape[1] % HOP))
        frames = wav.reshape(wav.shape[0], -1, HOP)
        levels = ((torch.tanh(frames @ self.proj) + 1) / 2 * LEVELS).long().clamp(0, LEVELS - 1)
        codes = (levels * LEVELS ** torch.arange(8)).sum(-1)
        return codes[:, None, :]  # [B, 1, T]

    def decode_code(self, vq_code):
        digits = (vq_code[:, 0, :, None] // LEVELS ** torch.arange(8)) % LEVELS
        values = (digits.float() + 0.5) / LEVELS * 2 - 1
        frames = values @ torch.linalg.pinv(self.proj)
        return frames.reshape(vq_code.shape[0], 1, -1)  # [B, 1, T * HOP]
'''


def write_standin_xcodec2(root: Path) -> tuple[Path, Path]:
    """(import root holding the stand-in package, a model dir in X-codec2's format for it)."""
    from safetensors.torch import save_file

    package = root / "site" / "xcodec2"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text("")
    (package / "modeling_xcodec2.py").write_text(textwrap.dedent(STANDIN_MODULE))
    model_dir = root / "xcodec2_model"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text('{"model_type": "xcodec"}')
    proj = torch.randn(320, 8, generator=torch.Generator().manual_seed(0)) * 0.5
    save_file({"proj": proj}, str(model_dir / "model.safetensors"))
    return root / "site", model_dir


@pytest.fixture(scope="module")
def standin(tmp_path_factory) -> tuple[Path, Path]:
    return write_standin_xcodec2(tmp_path_factory.mktemp("xcodec2"))


@pytest.fixture
def xcodec2_dir(standin, monkeypatch):
    """The stand-in's model dir, with the stand-in package importable as `xcodec2`."""
    from ssd.audio import xcodec2

    site, model_dir = standin
    xcodec2._load_model.cache_clear()
    monkeypatch.syspath_prepend(str(site))
    for name in [m for m in sys.modules if m == "xcodec2" or m.startswith("xcodec2.")]:
        monkeypatch.delitem(sys.modules, name)
    yield model_dir
    xcodec2._load_model.cache_clear()
    for name in [m for m in sys.modules if m == "xcodec2" or m.startswith("xcodec2.")]:
        del sys.modules[name]


LLASA_WORDS = WORDS + ["user", "assistant", "convert", "the", "text", "to", "speech", ":"]


def make_llasa_dir(
    path: Path, num_layers: int = 5, num_speech_tokens: int = SPEECH_TOKENS, hidden_size: int = 32
) -> Path:
    """A random-weight LLaSA dir in the real format with `num_layers` layers (5: pcg_3layer is a real subset)."""
    from ssd.models.checkpoints import write_llasa_dir
    from ssd.models.text_tokenizer import write_word_tokenizer

    tokenizer_dir = write_word_tokenizer(LLASA_WORDS, path.parent / f"{path.name}_words")
    config = {**TINY_LLAMA, "num_hidden_layers": num_layers, "hidden_size": hidden_size,
              "intermediate_size": 2 * hidden_size}  # fmt: skip
    return write_llasa_dir(path, config, num_speech_tokens, tokenizer_dir)


@pytest.fixture(scope="module")
def llasa_dir(tmp_path_factory) -> Path:
    return make_llasa_dir(tmp_path_factory.mktemp("llasa") / "llasa")


def run_prepare_script(corpus: Path, out: Path, llasa: Path, standin: tuple[Path, Path]):
    site, model_dir = standin
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / "prepare_libritts.py"), "tokens", str(corpus), str(out),
         "--text-tokenizer", str(llasa), "--speech-tokenizer", "llasa", "--speech-tokenizer-path", str(model_dir),
         "--num-workers", "0", "--no-progress"],
        capture_output=True, text=True, cwd=REPO,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{site}:{REPO}"},
    )  # fmt: skip


@pytest.fixture(scope="module")
def llasa_world(tmp_path_factory, standin) -> dict[str, Path]:
    """A LLaSA dir with all 65536 X-codec2 codes (its real vocabulary layout, tiny layers), a LibriTTS-layout
    corpus (train-clean-100: 4 speakers, dev-clean: 2) and its shards written by the prepare script."""
    root = tmp_path_factory.mktemp("llasa_world")
    llasa = make_llasa_dir(root / "llasa", num_speech_tokens=65536, hidden_size=16)
    corpus = root / "corpus"
    rng = np.random.default_rng(0)
    for n in range(16):
        speaker = n % 6 + 1
        subset = "dev-clean" if speaker > 4 else "train-clean-100"
        text = " ".join(rng.choice(WORDS[:20], rng.integers(2, 6)))
        write_utterance(corpus, subset, f"{speaker}_5_{n:06d}_000000", text, 1.0 + 0.1 * (n % 5), seed=n)
    shards = root / "data" / "libritts_llasa"  # where data=libritts looks for target=llasa's shards
    done = run_prepare_script(corpus, shards, llasa, standin)
    assert done.returncode == 0, done.stderr[-3000:]
    return {"llasa": llasa, "corpus": corpus, "data_dir": root / "data", "shards": shards}


# --- X-codec2 ------------------------------------------------------------------------------------------


def test_xcodec2_tokenizes_at_50_hz_into_65536_codes_and_vocodes_at_16_khz(xcodec2_dir):
    codec = XCodec2.load(xcodec2_dir)
    assert (codec.sample_rate, codec.token_rate, codec.codebook_size) == (16000, 50, 65536)
    assert XCodec2(xcodec2_dir).model is codec.model  # the tokenizer and the vocoder share one model
    rng = np.random.default_rng(0)
    wav_24k = (0.3 * rng.standard_normal(24000)).astype(np.float32)  # 1 s at 24 kHz: resampled to 16 kHz
    codes = codec.encode(wav_24k, 24000)
    # X-codec2 pads every input by 320 - N % 320 samples, so 16000 samples give 50 + 1 codes.
    assert codes.dtype == np.int64 and codes.shape == (51,)
    assert codes.min() >= 0 and codes.max() < 65536 and len(np.unique(codes)) > 10
    assert np.array_equal(codec.encode(wav_24k, 24000), codes)

    prompt_codes = codes[:10]
    prompt = VocoderPrompt(wav=wav_24k, sample_rate=24000, text="", tokens=prompt_codes)
    audio = codec.vocode(codes[10:], prompt)
    assert audio.dtype == np.float32 and audio.shape == (41 * 320,)  # the prompt's share is cut off
    whole = codec.model.decode_code(torch.from_numpy(codes)[None, None]).reshape(-1).numpy()
    np.testing.assert_allclose(audio, whole[10 * 320 :], atol=1e-6)
    alone = codec.vocode(codes, VocoderPrompt(wav=wav_24k, sample_rate=24000, text="", tokens=np.zeros(0)))
    np.testing.assert_allclose(alone, whole, atol=1e-6)


def test_xcodec2_errors_name_the_fix(xcodec2_dir, tmp_path, monkeypatch):
    codec = XCodec2.load(xcodec2_dir)
    prompt = VocoderPrompt(wav=np.zeros(160, np.float32), sample_rate=16000, text="", tokens=np.zeros(0))
    with pytest.raises(ValueError, match=r"must lie in \[0, 65536\)"):
        codec.vocode(np.array([1, 65536]), prompt)
    with pytest.raises(ValueError, match="XCODEC2_DIR"):
        XCodec2(None)
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="model.safetensors does not exist.*HKUST-Audio/xcodec2"):
        XCodec2(tmp_path / "half")
    from ssd.audio import xcodec2

    xcodec2._load_model.cache_clear()
    for name in ("xcodec2", "xcodec2.modeling_xcodec2"):  # the package is not installed
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match=r"pip install 'ssd\[xcodec2\]'.*--no-deps xcodec2==0.1.5"):
        XCodec2(xcodec2_dir)


def test_target_llasa_brings_x_codec2():
    from ssd.config import compose

    cfg = compose("sweep", ["target=llasa"])
    assert cfg.speech_tokenizer._target_ == "ssd.audio.xcodec2.XCodec2.load"
    assert cfg.vocoder._target_ == "ssd.audio.xcodec2.XCodec2"
    for target in ("llasa", "cosyvoice2"):  # data=libritts reads the shards of the target's vocabulary
        data = compose("train_draft", [f"target={target}", "data=libritts", "paths.data_dir=/d"]).data
        assert data.shard_dirs == f"/d/libritts_{target}"


# --- pairing ---------------------------------------------------------------------------------------------


def _llasa_with_all_codes() -> LlasaLM:
    """A LlasaLM with X-codec2's 65536 speech tokens (built directly: a tokenizer with 65k added tokens
    is slow to write)."""
    from ssd.models.backbone_config import BackboneConfig

    config = BackboneConfig(model_type="llama", vocab_size=65536 + 16, hidden_size=8, intermediate_size=16,
                            num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4, qkv_bias=False)  # fmt: skip
    return LlasaLM(config, speech_offset=16, num_speech_tokens=65536, speech_end_id=10)


def test_a_cosyvoice_tokenizer_with_llasa_fails_at_load_naming_the_three_configs(xcodec2_dir, tmp_path):
    from test_cosyvoice_tokenizer import _write_model

    from ssd.audio.cosyvoice_tokenizer import CosyVoiceSpeechTokenizer
    from ssd.config import compose
    from ssd.evaluation.pairing import check_pairing

    cfg = compose("sweep", ["target=llasa", "speech_tokenizer=cosyvoice2"])
    cosyvoice = CosyVoiceSpeechTokenizer(_write_model(tmp_path / "speech_tokenizer_v2.onnx"))
    target, xcodec2 = _llasa_with_all_codes(), XCodec2.load(xcodec2_dir)
    with pytest.raises(ValueError) as err:
        check_pairing("llasa", cfg, cosyvoice, target, xcodec2)
    message = str(err.value)
    assert (
        "speech_tokenizer=cosyvoice2 (6561 codes at 25 Hz) does not match target=llasa (65536 codes)"
        in message
    )
    assert "and vocoder=llasa (65536 codes at 50 Hz) run at different token rates" in message
    assert "one vocabulary" in message

    check_pairing(
        "llasa", compose("sweep", ["target=llasa"]), xcodec2, target, xcodec2
    )  # the matching trio passes
    with pytest.raises(
        ValueError, match=r"vocoder=llasa \(65536 codes at 50 Hz\) does not match target=llasa"
    ):
        check_pairing("llasa", compose("sweep", ["target=llasa"]), xcodec2, LlasaLM.from_dir(make_llasa_dir(
            tmp_path / "llasa40", num_layers=1), num_speech_tokens=SPEECH_TOKENS), xcodec2)  # fmt: skip


def test_the_runner_refuses_a_cosyvoice_tokenizer_for_llasa_at_load(xcodec2_dir, llasa_dir, tmp_path):
    """What a user meets: `python sweep.py target=llasa speech_tokenizer=cosyvoice2` stops in load_models,
    before any decoding, with the three configs named."""
    from test_cosyvoice_tokenizer import _write_model

    from ssd.config import compose
    from ssd.evaluation import models
    from ssd.evaluation.settings import RunSettings

    onnx = _write_model(tmp_path / "speech_tokenizer_v2.onnx")
    common = ["target=llasa", f"target.model.model_dir={llasa_dir}", f"target.speech_token_size={SPEECH_TOKENS}",
              "decoding=ar", "eval=libritts_test_clean", "asr=pocketsphinx", "sim=resemblyzer", "logger=none",
              f"vocoder.path={xcodec2_dir}"]  # fmt: skip
    models._LOADED.clear()
    try:
        cfg = compose("sweep", [*common, "speech_tokenizer=cosyvoice2", f"speech_tokenizer.path={onnx}"])
        with pytest.raises(ValueError, match=r"speech_tokenizer=cosyvoice2 \(6561 codes at 25 Hz\) does not match "
                           r"target=llasa \(40 codes\).*vocoder=llasa"):  # fmt: skip
            models.load_models(RunSettings.from_config(cfg))
    finally:
        models._LOADED.clear()


# --- LibriTTS shards in LLaSA's vocabulary ----------------------------------------------------------------


def test_prepare_libritts_writes_llasa_shards(llasa_world, xcodec2_dir):
    """The script with --speech-tokenizer llasa: the shard's text ids are exactly what LLaSA's training rows
    put between the chat template's pieces, and its speech tokens are X-codec2's codes of the audio."""
    from ssd.audio.features import load_audio
    from ssd.training.data import TokenShardDataset

    shards, corpus = llasa_world["shards"], llasa_world["corpus"]
    rows = [r for f in sorted(shards.glob("shard-*.parquet")) for r in pq.read_table(f).to_pylist()]
    assert len(rows) == 16 and len(TokenShardDataset.from_shards(shards)) == 16
    model = LlasaLM.from_dir(llasa_world["llasa"])
    assert model.speech_token_size == 65536
    codec = XCodec2.load(xcodec2_dir)
    empty = model._chat_ids("")
    split = empty.index(model.tokenizer.convert_tokens_to_ids("<|TEXT_UNDERSTANDING_START|>")) + 1
    for row in rows:
        # What training feeds (prefix_embeds: template ++ shard text ids ++ template) is the prompt format.
        assert model._chat_ids(row["text"]) == empty[:split] + row["text_tokens"] + empty[split:]
        embedded = model.prefix_embeds(torch.tensor(row["text_tokens"]))
        reference = model.backbone.embed_tokens(torch.tensor(model._chat_ids(row["text"])))
        torch.testing.assert_close(embedded, reference)
        wav = next(corpus.rglob(f"{row['utt']}.wav"))
        assert row["speech_tokens"] == codec.encode(*load_audio(wav, target_sr=None)).tolist()
        assert len(row["speech_tokens"]) == round(row["duration"] * 16000) // 320 + 1  # 50 Hz


def test_shards_of_another_text_tokenizer_are_refused(llasa_world, tmp_path):
    """Training feeds shard text ids into the target's embedding: ids of another tokenizer must not pass."""
    from ssd.models.text_tokenizer import load_text_tokenizer, write_word_tokenizer
    from ssd.training.data import check_text_tokenizer

    check_text_tokenizer(llasa_world["shards"], LlasaLM.from_dir(llasa_world["llasa"]).tokenizer)
    other = load_text_tokenizer(write_word_tokenizer(LLASA_WORDS[::-1], tmp_path / "reversed"))
    with pytest.raises(ValueError, match=r"prepared with another text tokenizer.*--text-tokenizer"):
        check_text_tokenizer(llasa_world["shards"], other)


# --- draft training with the real CLI ---------------------------------------------------------------------


def test_train_draft_cli_trains_a_pcg_draft_of_llasa(llasa_world, tmp_path):
    """`python train_draft.py target=llasa draft=pcg_3layer data=libritts trainer=cpu` on the prepared shards."""
    from ssd.drafters.layers import load_draft

    run_dir = tmp_path / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "train_draft.py", "target=llasa", "draft=pcg_3layer", "data=libritts", "trainer=cpu",
         f"target.model.model_dir={llasa_world['llasa']}", f"paths.data_dir={llasa_world['data_dir']}",
         "data.train_subsets=[train-clean-100]", "data.max_tokens=400", "data.num_workers=0", "max_steps=4",
         "val_every_steps=2", "logger=none", f"hydra.run.dir={run_dir}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "draft dev alpha (sum min(p,q), softmax):" in done.stdout + done.stderr

    target = LlasaLM.from_dir(llasa_world["llasa"])
    draft = load_draft(run_dir / "draft.pt", target)
    assert len(draft.model.backbone.layers) == 3  # layers [0, 1, -1] of the 5
    trained = {k for k, p in draft.named_parameters() if p.requires_grad}
    assert trained and all(k.split(".")[1] in ("lm_head", "backbone") for k in trained)
    # Training moved the trainable head away from the target's (tied) one; frozen layer -1 is the target's.
    assert not torch.equal(draft.model.lm_head.weight, target.lm_head.weight)
    torch.testing.assert_close(
        draft.model.backbone.layers[2].state_dict(), target.backbone.layers[4].state_dict()
    )
