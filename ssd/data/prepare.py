"""LibriTTS-layout corpus -> filtered, tokenized parquet shards for draft training.

Stages (`prepare_corpus`): scan the tree (`ssd.data.libritts`) -> text tokens with the target's text
tokenizer -> filters (CosyVoice's LibriTTS recipe: 1-60 s of audio, 1-200 text tokens, plus the speech
tokenizer's own limit, 30 s for CosyVoice 2) -> speech tokens in worker processes -> parquet shards.

Output directory::

    plan.json             settings + the utterances of every shard (a rerun must match it)
    manifest.jsonl        every scanned utterance with `text_tokens` count and `drop_reason` ("" = kept)
    shard-00000.parquet   columns SHARD_COLUMNS; utterances that failed to decode listed in its metadata
    summary.json          the PrepareReport of the last run

Resumable: a shard is written atomically (`ssd.files.write_atomic`: a temp file renamed when complete), so
an existing shard is finished and skipped, and an interrupted one is redone.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ssd.audio.features import load_audio
from ssd.contracts import SpeechTokenizer
from ssd.data.libritts import save_table, scan_libritts
from ssd.files import write_atomic

SHARD_SCHEMA = pa.schema(
    [
        ("utt", pa.string()),
        ("speaker", pa.string()),
        ("subset", pa.string()),
        ("text", pa.string()),
        ("text_tokens", pa.list_(pa.int32())),
        ("speech_tokens", pa.list_(pa.int32())),
        ("duration", pa.float32()),
    ]
)
SHARD_COLUMNS = SHARD_SCHEMA.names
FAILED_KEY = b"ssd.failed"  # parquet metadata: utterances whose audio could not be decoded


def load_speech_tokenizer(node: Mapping[str, Any]) -> SpeechTokenizer:
    """A speech tokenizer from its config node (configs/speech_tokenizer/: `_target_` + `path`)."""
    from hydra.utils import instantiate

    path = node.get("path")
    if path is None or not Path(str(path)).exists():
        raise FileNotFoundError(
            f"speech tokenizer {node.get('_target_')} not found at speech_tokenizer.path={path}"
        )
    return instantiate(dict(node))


@dataclass
class PrepareReport:
    """What a `prepare_corpus` run did; also written to summary.json."""

    out_dir: str
    n_scanned: int = 0
    n_kept: int = 0
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> count, before tokenization
    corrupt: list[str] = field(default_factory=list)  # unreadable audio ("path: reason"), scan or decode
    shards_total: int = 0
    shards_written: int = 0
    shards_skipped: int = 0
    n_written_utts: int = 0  # utterances in all shards (this and earlier runs)
    audio_hours: float = 0.0
    speech_tokens: int = 0
    seconds: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def _drop_reasons(
    durations: np.ndarray,
    n_text_tokens: np.ndarray,
    min_sec: float,
    max_sec: float,
    min_text_tokens: int,
    max_text_tokens: int,
    tokenizer_max_sec: float | None,
) -> list[str]:
    """The first failed filter per utterance ("" when it passes), in the order the report lists them."""
    checks = [
        (durations < min_sec, f"audio shorter than {min_sec:g} s"),
        (durations > max_sec, f"audio longer than {max_sec:g} s"),
        (n_text_tokens < min_text_tokens, f"fewer than {min_text_tokens} text tokens"),
        (n_text_tokens > max_text_tokens, f"more than {max_text_tokens} text tokens"),
    ]
    if tokenizer_max_sec is not None and tokenizer_max_sec < max_sec:
        checks.append(
            (
                durations > tokenizer_max_sec,
                f"audio longer than the speech tokenizer's {tokenizer_max_sec:g} s",
            )
        )
    reasons = [""] * len(durations)
    for failed, reason in checks:
        for i in np.flatnonzero(failed):
            reasons[i] = reasons[i] or reason
    return reasons


def _tokenize_texts(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    return [list(ids) for ids in tokenizer(list(texts), add_special_tokens=False).input_ids] if texts else []


# One speech tokenizer per worker process, loaded once by the pool's initializer.
_worker_tokenizer: SpeechTokenizer | None = None


def _init_worker(node: dict) -> None:
    global _worker_tokenizer
    import torch

    torch.set_num_threads(1)  # parallelism comes from the processes
    _worker_tokenizer = load_speech_tokenizer(node)


def _write_shard(path: Path, rows: list[dict], tokenizer: SpeechTokenizer) -> tuple[int, int, list[str]]:
    """Tokenize a shard's audio and write it atomically; returns (rows written, speech tokens, failures)."""
    columns: dict[str, list] = {name: [] for name in SHARD_COLUMNS}
    failed = []
    for row in rows:
        try:
            wav, sr = load_audio(row["wav"], target_sr=None)
        except ValueError as err:
            failed.append(str(err))
            continue
        speech = tokenizer.encode(wav, sr)
        for name in ("utt", "speaker", "subset", "text", "text_tokens", "duration"):
            columns[name].append(row[name])
        columns["speech_tokens"].append(np.asarray(speech, dtype=np.int32))
    return write_shard(path, columns, failed)


def write_shard(path: Path, columns: dict[str, list], failed: list[str]) -> tuple[int, int, list[str]]:
    """One shard (columns SHARD_COLUMNS; `failed`: the utterances left out, in its metadata), written to a
    temporary name and renamed when complete; returns (rows, speech tokens, failures)."""
    table = pa.table(columns, schema=SHARD_SCHEMA).replace_schema_metadata({FAILED_KEY: json.dumps(failed)})
    write_atomic(path, lambda f: pq.write_table(table, f))
    return table.num_rows, int(sum(len(s) for s in columns["speech_tokens"])), failed


def _worker_write_shard(task: tuple[Path, list[dict]]) -> tuple[int, int, list[str]]:
    assert _worker_tokenizer is not None, "worker used before _init_worker"
    return _write_shard(task[0], task[1], _worker_tokenizer)


def finished_shard(path: Path) -> tuple[int, int, list[str]] | None:
    """(rows, speech tokens, failures) of a complete shard, or None when it must be (re)written."""
    if not path.is_file():
        return None
    try:
        parquet = pq.ParquetFile(path)
        speech = parquet.read(columns=["speech_tokens"]).column("speech_tokens")
        failed = json.loads((parquet.schema_arrow.metadata or {}).get(FAILED_KEY, b"[]"))
    except (pa.ArrowException, OSError, ValueError):
        return None  # unreadable: treated as unfinished
    return parquet.metadata.num_rows, int(pc.sum(pc.list_value_length(speech)).as_py() or 0), failed


def _shard_plan(settings: dict, kept: pd.DataFrame, shard_size: int) -> dict:
    shards = [
        {
            "name": f"shard-{i // shard_size:05d}.parquet",
            "utts": kept["utt"].iloc[i : i + shard_size].tolist(),
        }
        for i in range(0, len(kept), shard_size)
    ]
    return {"settings": settings, "shards": shards}


def check_or_write_plan(out_dir: Path, plan: dict) -> None:
    plan_path = out_dir / "plan.json"
    text = json.dumps(plan, indent=1, sort_keys=True)
    if plan_path.is_file():
        previous = json.loads(plan_path.read_text())
        if previous != json.loads(text):
            changed = sorted(
                k for k in plan["settings"] if previous.get("settings", {}).get(k) != plan["settings"][k]
            )
            what = f"settings {changed}" if changed else "the corpus contents (utterances per shard)"
            raise ValueError(
                f"{out_dir} holds shards prepared differently ({what} changed since plan.json was written): "
                "use a new out_dir, or delete the old one to start over"
            )
        return
    write_atomic(plan_path, text)


def _describe_tokenizer(tokenizer: Any) -> str:
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    vocab = getattr(tokenizer, "get_vocab", None)
    digest = hashlib.sha1(json.dumps(sorted(vocab().items())).encode()).hexdigest()[:12] if vocab else "?"
    return f"{name} (vocab sha1 {digest})"


def prepare_corpus(
    corpus_root: str | Path,
    out_dir: str | Path,
    *,
    text_tokenizer: str | Path | Any,
    speech_tokenizer: Mapping[str, Any],
    subsets: Iterable[str] | None = None,
    shard_size: int = 1000,
    num_workers: int = 2,
    min_sec: float = 1.0,
    max_sec: float = 60.0,
    min_text_tokens: int = 1,
    max_text_tokens: int = 200,
    progress: bool = True,
    log: Callable[[str], None] | None = print,
) -> PrepareReport:
    """Prepare a LibriTTS-layout corpus into token shards under `out_dir` (see the module doc).

    text_tokenizer: a tokenizer directory (loaded with `ssd.models.text_tokenizer.load_text_tokenizer`) or
        a loaded HF tokenizer; used as `tok(texts, add_special_tokens=False).input_ids`.
    speech_tokenizer: its config node, `{_target_, path}` (configs/speech_tokenizer/; resolved, plain); each
        worker builds its own from it.
    num_workers: speech-tokenizer processes (each loads the tokenizer once); 0 tokenizes in this process.
    log: prints the drop table and the summary (None: silent).
    Unreadable audio is skipped and listed in the report, never fatal.
    """
    started = time.perf_counter()
    out_dir = Path(out_dir)
    if shard_size < 1 or num_workers < 0:
        raise ValueError(f"shard_size must be >= 1 and num_workers >= 0, got {shard_size}, {num_workers}")
    speech_tokenizer = {**speech_tokenizer, "path": str(Path(str(speech_tokenizer.get("path"))).resolve())}
    tokenizer = load_speech_tokenizer(speech_tokenizer)  # here too: a wrong path fails before any work
    if isinstance(text_tokenizer, str | Path):
        from ssd.models.text_tokenizer import load_text_tokenizer

        text_tokenizer = load_text_tokenizer(text_tokenizer)

    scan = scan_libritts(corpus_root, subsets, skip_corrupt=True)
    manifest = scan.manifest
    text_tokens = _tokenize_texts(text_tokenizer, manifest["text"].tolist())
    manifest["text_tokens"] = [len(t) for t in text_tokens]
    from ssd.models.text_tokenizer import unknown_words

    unknown = set(unknown_words(text_tokenizer, manifest["text"].tolist()))
    manifest["drop_reason"] = _drop_reasons(
        manifest["duration"].to_numpy(),
        manifest["text_tokens"].to_numpy(),
        min_sec,
        max_sec,
        min_text_tokens,
        max_text_tokens,
        getattr(tokenizer, "max_seconds", None),
    )
    if unknown:  # a word the text tokenizer maps to its unknown token: the model would learn to say nothing
        for i, text in enumerate(manifest["text"]):
            if not manifest.at[i, "drop_reason"] and set(unknown_words(text_tokenizer, [text])):
                manifest.at[i, "drop_reason"] = "words the text tokenizer does not know"
    out_dir.mkdir(parents=True, exist_ok=True)
    settings = {
        "corpus_root": str(Path(corpus_root).resolve()),
        "subsets": sorted(manifest["subset"].unique().tolist()),
        "text_tokenizer": _describe_tokenizer(text_tokenizer),
        "speech_tokenizer": speech_tokenizer["_target_"],
        "speech_tokenizer_path": speech_tokenizer["path"],
        "filters": {
            "min_sec": min_sec,
            "max_sec": max_sec,
            "min_text_tokens": min_text_tokens,
            "max_text_tokens": max_text_tokens,
        },
        "shard_size": shard_size,
    }
    keep = manifest["drop_reason"] == ""
    plan = _shard_plan(settings, manifest[keep], shard_size)
    check_or_write_plan(out_dir, plan)
    save_table(manifest, out_dir / "manifest.jsonl")

    report = PrepareReport(
        out_dir=str(out_dir),
        n_scanned=len(manifest) + len(scan.corrupt),
        n_kept=int(keep.sum()),
        dropped=dict(Counter(r for r in manifest["drop_reason"] if r)),
        corrupt=list(scan.corrupt),
        shards_total=len(plan["shards"]),
    )
    if scan.corrupt:
        report.dropped["unreadable audio"] = len(scan.corrupt)

    rows_by_utt = {
        row["utt"]: {**row, "text_tokens": tokens}
        for row, tokens, kept in zip(manifest.to_dict(orient="records"), text_tokens, keep)
        if kept
    }
    pending = []
    for shard in plan["shards"]:
        path = out_dir / shard["name"]
        done = finished_shard(path)
        if done is None:
            pending.append((path, [rows_by_utt[u] for u in shard["utts"]]))
        else:
            report.shards_skipped += 1
            report.n_written_utts += done[0]
            report.speech_tokens += done[1]
            report.corrupt.extend(done[2])

    from tqdm.auto import tqdm

    bar = tqdm(
        total=sum(len(rows) for _, rows in pending), unit="utt", desc="speech tokens", disable=not progress
    )
    results: Iterable[tuple[int, int, list[str]]]
    if num_workers == 0 or not pending:
        results = (_write_shard(path, rows, tokenizer) for path, rows in pending)
        executor = None
    else:
        executor = ProcessPoolExecutor(
            max_workers=min(num_workers, len(pending)),
            mp_context=get_context("spawn"),  # fork after torch/onnxruntime threads start can deadlock
            initializer=_init_worker,
            initargs=(speech_tokenizer,),
        )
        results = executor.map(_worker_write_shard, pending)
    try:
        for (_, rows), (n_rows, n_speech, failed) in zip(pending, results):
            report.shards_written += 1
            report.n_written_utts += n_rows
            report.speech_tokens += n_speech
            report.corrupt.extend(failed)
            bar.update(len(rows))
    finally:
        bar.close()
        if executor is not None:
            executor.shutdown(cancel_futures=True)

    decode_failures = len(report.corrupt) - len(scan.corrupt)
    if decode_failures:
        report.dropped["unreadable audio"] = report.dropped.get("unreadable audio", 0) + decode_failures
    report.audio_hours = float(manifest.loc[keep, "duration"].sum() / 3600)
    report.seconds = time.perf_counter() - started
    write_atomic(out_dir / "summary.json", report.to_json())
    if log is not None:
        print_report(report, log)
    return report


def print_report(report: PrepareReport, log: Callable[[str], None] = print) -> None:
    """The drop table (reason, count) and a summary, as plain text (readable in logs and terminals)."""
    width = max([len(r) for r in report.dropped] + [len("kept")])
    lines = [f"{'reason':<{width}}  {'count':>8}", f"{'-' * width}  {'-' * 8}"]
    lines += [f"{reason:<{width}}  {count:>8}" for reason, count in sorted(report.dropped.items())]
    lines += [f"{'kept':<{width}}  {report.n_kept:>8}  of {report.n_scanned} scanned"]
    lines.append(
        f"shards: {report.shards_written} written, {report.shards_skipped} already done, {report.shards_total} in all; "
        f"{report.n_written_utts} utterances, {report.audio_hours:.2f} h of audio, {report.speech_tokens} speech tokens; "
        f"{report.seconds:.1f} s -> {report.out_dir}"
    )
    for item in report.corrupt[:20]:
        lines.append(f"unreadable: {item}")
    if len(report.corrupt) > 20:
        lines.append(f"... and {len(report.corrupt) - 20} more unreadable files (see summary.json)")
    log("\n".join(lines))
