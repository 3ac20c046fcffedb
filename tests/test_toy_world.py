"""The toy world's builder, corpus layout, language and codec, on the `micro` size (seconds)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from omegaconf import OmegaConf

from ssd.data.grid_language import GridLanguage
from ssd.toy_world import STAGES, build_toy_world
from ssd.toy_world.codec import ToyCodec, ToyCodecConfig
from ssd.toy_world.codec_fit import fit_codec, phone_state_labels
from ssd.toy_world.corpus import ALIGNMENT_SUFFIX, ToySpeaker, flite_phones, read_alignment, synthesize
from ssd.toy_world.stages import DONE_FILE, Stage

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
pytestmark = pytest.mark.skipif(
    shutil.which("flite") is None or shutil.which("sox") is None, reason="needs flite, sox"
)


def micro_cfg() -> dict:
    cfg = OmegaConf.to_container(OmegaConf.load(CONFIGS / "toy_world" / "micro.yaml"))
    del cfg["dir"]  # interpolates paths.data_dir; tests pass the root directly
    return cfg


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("toy")
    results = build_toy_world(micro_cfg(), root, progress=False)
    return root, micro_cfg(), results


def test_libritts_layout(world):
    root, cfg, _ = world
    corpus = root / "corpus"
    speakers = {}
    for subset, spec in cfg["corpus"]["subsets"].items():
        wavs = sorted((corpus / subset).glob("*/*/*.wav"))
        assert len(wavs) == spec["speakers"] * spec["utterances_per_speaker"]
        for wav in wavs:
            spk, chapter = wav.parent.parent.name, wav.parent.name
            assert re.fullmatch(rf"{spk}_{chapter}_\d{{6}}_\d{{6}}\.wav", wav.name), wav
            assert wav.with_suffix(".normalized.txt").read_text().strip()
            assert wav.with_suffix(".original.txt").is_file()
            info = sf.info(wav)
            assert info.samplerate == 16000 and info.channels == 1 and info.duration > 0.5
        speakers[subset] = {w.parent.parent.name for w in wavs}
        assert len(speakers[subset]) == spec["speakers"]
    assert not speakers["test-clean"] & speakers["train-clean-100"]
    assert not speakers["dev-clean"] & speakers["train-clean-100"]
    assert not speakers["dev-clean"] & speakers["test-clean"]


def test_phone_alignment_beside_each_wav(world):
    root, _, _ = world
    for wav in sorted((root / "corpus").glob("*/*/*/*.wav")):
        alignment = read_alignment(wav.with_suffix(ALIGNMENT_SUFFIX))
        ends = [end for _, end in alignment]
        assert ends == sorted(ends) and alignment[0][0] == "pau" and alignment[-1][0] == "pau"
        # Speech ends inside the audio; the final pause runs to its end (kal16 cuts its last pause short).
        duration = sf.info(wav).duration
        assert ends[-2] < duration and ends[-1] > duration - 0.03, wav


def test_tempo_scales_the_alignment():
    for tempo in (1.0, 1.5):
        wav, alignment = synthesize("bin blue at one now", ToySpeaker(1, "slt", 200, tempo))
        assert abs(alignment[-1][1] - len(wav) / 16000) < 0.03, tempo
    with pytest.raises(FileNotFoundError, match="no phone alignment"):
        read_alignment("/nonexistent/x.phones.txt")


def test_phone_state_labels():
    cfg = ToyCodecConfig()  # 100 Hz frames, 3 states per phone
    alignment = [("pau", 0.055), ("b", 0.125), ("pau", 0.2)]
    labels = phone_state_labels(alignment, 20, cfg, {"b": 0, "pau": 1}).numpy()
    phone, state = labels // 3, labels % 3
    assert phone.tolist() == [1] * 6 + [0] * 7 + [1] * 7
    for segment in (state[:6], state[6:13], state[13:]):
        assert segment[0] == 0 and segment[-1] == 2 and (np.diff(segment) >= 0).all()


def test_corpus_text_is_the_language(world):
    root, _, _ = world
    language = GridLanguage(json.loads((root / "corpus" / "language.json").read_text()))
    for txt in (root / "corpus").glob("*/*/*/*.normalized.txt"):
        language.parse(txt.read_text())  # raises unless one word per slot


def test_language_deterministic_and_structured():
    language = GridLanguage()
    assert [s.text for s in language.sample(20, seed=3)] == [s.text for s in language.sample(20, seed=3)]
    assert [s.text for s in language.sample(20, seed=3)] != [s.text for s in language.sample(20, seed=4)]
    assert language.slot_names == ("command", "colour", "preposition", "noun", "digit", "adverb")
    assert 40 <= len(language.words) <= 60
    ref = "place blue beside apple seven now"
    assert language.slot_correct(ref, "Place blue beside the apple 7 now.") == dict.fromkeys(
        language.slot_names, True
    )
    got = language.slot_correct(ref, "place green beside apple now")
    assert got["colour"] is False and got["digit"] is False and got["noun"] is True
    with pytest.raises(ValueError, match="not a colour"):
        language.parse("place pink beside apple seven now")


def test_phoneme_text_units(tmp_path):
    """tokens.text_units=phoneme: each word becomes the phones flite speaks for it, in an HF tokenizer."""
    from ssd.models.text_tokenizer import load_text_tokenizer, write_word_tokenizer

    words = ["kitten", "nine", "now"]
    lexicon = {w: flite_phones(w, "kal16") for w in words}
    assert lexicon["kitten"] == ["k", "ih", "t", "ax", "n"] and lexicon["nine"] == ["n", "ay", "n"]
    tok = load_text_tokenizer(write_word_tokenizer(words, tmp_path / "ph", lexicon=lexicon))
    ids = tok("Kitten nine bogus now", add_special_tokens=False).input_ids
    assert tok.convert_ids_to_tokens(ids) == ["k", "ih", "t", "ax", "n", "n", "ay", "n", "[UNK]", "n", "aw"]
    words_tok = load_text_tokenizer(write_word_tokenizer(words, tmp_path / "w"))
    assert len(words_tok("kitten nine now", add_special_tokens=False).input_ids) == 3  # the control: words
    with pytest.raises(ValueError, match="also words"):
        write_word_tokenizer(["now", "n"], tmp_path / "clash", lexicon={"now": ["n", "aw"], "n": ["eh", "n"]})


def test_codec_round_trip(world):
    root, cfg, _ = world
    codec = ToyCodec.load(root / "codec")
    assert codec.token_rate == 25 and codec.codebook_size == cfg["codec"]["codebook_size"]
    wavs = sorted((root / "corpus" / "test-clean").glob("*/*/*.wav"))
    wav, sr = sf.read(wavs[0], dtype="float32")
    tokens = codec.encode(wav, sr)
    assert tokens.dtype == np.int64 and tokens.ndim == 1
    assert abs(len(tokens) - len(wav) / sr * 25) <= 1
    assert tokens.min() >= 0 and tokens.max() < codec.codebook_size
    for n_samples, n_tokens in [(0, 0), (639, 0), (640, 1), (16000, 25)]:
        assert len(codec.encode(np.zeros(n_samples, np.float32) + 0.01, 16000)) == n_tokens
    # Resampled input gives the same number of tokens per second.
    wav8k = wav[::2]
    assert abs(len(codec.encode(wav8k, 8000)) - len(tokens)) <= 1
    audio = codec.decode(tokens)
    assert audio.dtype == np.float32 and np.isfinite(audio).all()
    assert len(audio) == len(tokens) * codec.sample_rate // 25
    assert audio.std() > 1e-4  # not silence
    prompt, _ = sf.read(wavs[1], dtype="float32")
    with_prompt = codec.decode(tokens, prompt_tokens=codec.encode(prompt, sr), prompt_wav=prompt)
    assert len(with_prompt) == len(audio) and np.isfinite(with_prompt).all()
    with pytest.raises(ValueError, match="strip EOS"):
        codec.decode(np.array([0, codec.codebook_size]))
    with pytest.raises(ValueError, match="mono"):
        codec.encode(np.zeros((2, 1600), np.float32), sr)


def test_codec_save_load_is_identical(world, tmp_path):
    root, _, _ = world
    codec = ToyCodec.load(root / "codec")
    codec.save(tmp_path / "copy")
    again = ToyCodec.load(tmp_path / "copy")
    wav, sr = sf.read(sorted((root / "corpus" / "dev-clean").glob("*/*/*.wav"))[0], dtype="float32")
    tokens = codec.encode(wav, sr)
    assert np.array_equal(tokens, again.encode(wav, sr))
    assert np.allclose(codec.decode(tokens), again.decode(tokens), atol=1e-5)
    with pytest.raises(FileNotFoundError, match="codec.json"):
        ToyCodec.load(tmp_path / "nothing")
    (tmp_path / "copy" / "encoder.pt").unlink()
    with pytest.raises(FileNotFoundError, match="encoder.pt"):
        ToyCodec.load(tmp_path / "copy")


def test_codec_decoder_training_is_step_based_and_deterministic(world):
    root, cfg, _ = world
    wavs = sorted((root / "corpus" / "train-clean-100").glob("*/*/*.wav"))
    codec_cfg = {**cfg["codec"], "decoder_max_steps": 6}
    first = fit_codec(wavs, codec_cfg, seed=0, progress=False)
    second = fit_codec(wavs, codec_cfg, seed=0, progress=False)
    assert first.fit_report["decoder_steps"] == 6
    assert first.fit_report["decoder_stopped_by_seconds_cap"] is False
    for name, weights in first.decoder.state_dict().items():
        assert torch.equal(weights, second.decoder.state_dict()[name]), name
    # The seconds value is only a safety cap, and the fit report says when it cut training short.
    capped = fit_codec(wavs, {**codec_cfg, "decoder_train_seconds": 0.0}, seed=0, progress=False)
    assert capped.fit_report["decoder_stopped_by_seconds_cap"] is True
    assert capped.fit_report["decoder_steps"] < 6


@pytest.mark.parametrize(
    "options",
    [{"decoder_target": "log_magnitude"}, {"features": "log_mel"}],
    ids=["log_magnitude", "log_mel"],
)
def test_codec_alternatives(world, tmp_path, options):
    root, cfg, _ = world
    wavs = sorted((root / "corpus" / "train-clean-100").glob("*/*/*.wav"))
    codec = fit_codec(wavs, {**cfg["codec"], **options}, seed=0, progress=False)
    assert (codec.encoder is None) == (options.get("features") == "log_mel")
    codec.save(tmp_path / "alt")
    again = ToyCodec.load(tmp_path / "alt")
    wav, sr = sf.read(wavs[0], dtype="float32")
    tokens = codec.encode(wav, sr)
    assert np.array_equal(tokens, again.encode(wav, sr))
    audio = again.decode(tokens, prompt_wav=wav)
    assert len(audio) == len(tokens) * codec.sample_rate // 25 and np.isfinite(audio).all()
    assert np.allclose(audio, codec.decode(tokens, prompt_wav=wav), atol=1e-5)
    with pytest.raises(ValueError, match="decoder_target"):
        fit_codec(wavs, {**cfg["codec"], "decoder_target": "mel"}, progress=False)
    with pytest.raises(ValueError, match="features must be one of"):
        fit_codec(wavs, {**cfg["codec"], "features": "mfcc"}, progress=False)


def _stamp(root: Path) -> dict[str, float]:
    return {d.name: (d / DONE_FILE).stat().st_mtime_ns for d in root.iterdir() if (d / DONE_FILE).exists()}


def test_rebuild_skips_redoes_and_propagates(world, tmp_path):
    root, cfg, first = world
    assert [r.status for r in first] == ["built"] * len(STAGES)
    # A private copy so the shared world stays intact for the other tests.
    root = Path(shutil.copytree(root, tmp_path / "toy"))
    before = _stamp(root)
    again = build_toy_world(cfg, root, progress=False)
    assert [r.status for r in again] == ["skipped"] * len(STAGES) and _stamp(root) == before

    # Interrupted codec stage: files but no DONE.json -> redone from scratch, corpus untouched.
    (root / "codec" / DONE_FILE).unlink()
    (root / "codec" / "leftover.tmp").write_text("half-written")
    statuses = {r.name: r.status for r in build_toy_world(cfg, root, progress=False)}
    downstream = [s.name for s in STAGES if s.name not in ("corpus", "codec")]
    # The codec refit is deterministic (step-based training), so later stages keep their hashes.
    assert statuses == {"corpus": "skipped", "codec": "built", **dict.fromkeys(downstream, "skipped")}
    assert not (root / "codec" / "leftover.tmp").exists()

    # A changed corpus config rebuilds the corpus and everything downstream.
    cfg["corpus"]["subsets"]["test-clean"]["utterances_per_speaker"] += 1
    statuses = {r.name: r.status for r in build_toy_world(cfg, root, progress=False)}
    assert statuses == dict.fromkeys([s.name for s in STAGES], "built")


def test_changed_stage_rebuilds_only_downstream(tmp_path):
    calls = []

    def make(name):
        def run(ctx):
            calls.append(name)
            (ctx.out_dir / "out.txt").write_text(json.dumps(ctx.config))
            return {"inputs": len(ctx.inputs)}

        return Stage(name, run)

    stages = [make("a"), make("b"), make("c")]
    cfg = {"seed": 0, "a": {"x": 1}, "b": {"y": 1}, "c": {}}
    build_toy_world(cfg, tmp_path, progress=False, stages=stages)
    assert calls == ["a", "b", "c"]
    calls.clear()
    cfg["b"]["y"] = 2
    build_toy_world(cfg, tmp_path, progress=False, stages=stages)
    assert calls == ["b", "c"]
    calls.clear()
    cfg["seed"] = 1  # the seed reaches every stage
    build_toy_world(cfg, tmp_path, progress=False, stages=stages)
    assert calls == ["a", "b", "c"]


def test_config_errors_name_the_key(tmp_path):
    cfg = micro_cfg()
    cfg["corpus"]["subsets"]["test-clean"]["speakers"] = 50
    with pytest.raises(ValueError, match="speaker bank"):
        build_toy_world(cfg, tmp_path, progress=False)
    cfg = micro_cfg()
    cfg["codec"]["codebok_size"] = 8
    with pytest.raises(ValueError, match="codebok_size"):
        build_toy_world(cfg, tmp_path, progress=False)
    assert (tmp_path / "corpus" / DONE_FILE).exists()
    assert not (tmp_path / "codec" / DONE_FILE).exists()


def test_a_changed_draft_recipe_rebuilds_the_draft_stage():
    """The draft checkpoint records its recipe, so the stage's hash must follow configs/draft/toy.yaml."""
    from ssd.toy_world.lm_stages import draft_fingerprint

    same = draft_fingerprint({"overrides": ["max_steps=300"]})
    assert same == draft_fingerprint({"overrides": ["max_steps=300"]})
    assert same != draft_fingerprint({"overrides": ["max_steps=300", "draft.trainable=[head]"]})
    assert same != draft_fingerprint({"overrides": ["max_steps=300", "draft.layers=[0,-1]"]})
