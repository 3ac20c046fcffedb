"""The one owner of an evaluation run dir: who may write it, what it holds, and how it resumes.

    config.yaml         the resolved config + `run_inputs`: the fingerprint of every model file the run read
    test_list.jsonl     the zero-shot pairs
    utterances.jsonl    one record per utterance, appended (fsynced) as each finishes
    utterances.bad.jsonl  lines set aside on resume: unparsable (a killed writer) or a second record of an utterance
    metrics.json        the summary; error.json when the job failed in a multirun

A sweep dir holds one run dir per job and `baselines/<key>/`: the AR runs its jobs measure speedup and
ΔWER against (`ssd.evaluation.baselines.ensure_baseline`).

Every file but the appended records is written atomically (temp + rename). A run holds `.lock` while it
writes, so a second process (two sweeps into one dir, a joblib sweep with a repeated value) fails at once
instead of doubling records. Resume refuses a dir computed with another configuration or other model
files, and never counts an utterance twice.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from ssd.files import RunDirLock, fingerprint, fingerprint_changes, write_atomic

log = logging.getLogger(__name__)

RESULTS_FILE = "utterances.jsonl"
QUARANTINE_FILE = "utterances.bad.jsonl"
METRICS_FILE = "metrics.json"
TEST_LIST_FILE = "test_list.jsonl"
CONFIG_FILE = "config.yaml"
ERROR_FILE = "error.json"
AUDIO_DIR = "audio"
BASELINES_DIR = "baselines"  # below a sweep dir: the AR runs its jobs are compared with (one per fingerprint)
INPUTS_KEY = "run_inputs"
# Keys that do not change what a run computes: a resumed run may differ in them.
NON_RESULT_KEYS = ("logger", "baseline_dir", "auto_baseline", "progress", "output_dir", INPUTS_KEY)
# Config nodes whose path values are model files the results depend on (the corpus is checked through the
# test list instead).
INPUT_NODES = ("target.model", "draft", "speech_tokenizer", "vocoder", "asr", "sim", "mos")


def read_records(path: str | Path, repair: bool = True) -> list[dict]:
    """Every complete record of a results file, the first one per utterance. Anything else (a half-written
    line of a killed run, a line that is not a record, a second record of an utterance) is skipped; with
    `repair` (the run that owns the dir, under its lock) it is moved to the quarantine file beside it,
    never deleted, and the results file is rewritten without it."""
    path = Path(path)
    if not path.is_file():
        return []
    records, bad, seen = [], [], set()
    for number, line in enumerate(path.read_bytes().splitlines(keepends=True), start=1):
        try:
            record = json.loads(line) if line.endswith(b"\n") else None
        except (json.JSONDecodeError, UnicodeDecodeError):
            record = None
        if not isinstance(record, dict) or "utt" not in record:
            reason = "not a complete record" if line.strip() else None
        elif record["utt"] in seen:
            reason = f"second record of utterance {record['utt']}"
        else:
            seen.add(record["utt"])
            records.append(record)
            continue
        if reason:
            bad.append(
                {"line": number, "reason": reason, "text": line.decode("utf-8", "replace").rstrip("\n")}
            )
    if bad and repair:
        quarantine = path.with_name(QUARANTINE_FILE)
        with quarantine.open("a", encoding="utf-8") as f:
            f.writelines(json.dumps(b) + "\n" for b in bad)
        write_atomic(path, "".join(json.dumps(r) + "\n" for r in records))
        log.warning("%s: %d line(s) set aside in %s (%s); %d records kept",
                    path, len(bad), quarantine, bad[0]["reason"], len(records))  # fmt: skip
    return records


def append_record(path: Path, record: dict) -> None:
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix.rstrip("."): d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}{k}."))
    return out


def run_inputs(config: dict) -> dict[str, dict]:
    """{config key: fingerprint} of every existing file or dir that a run's model nodes name (config: the
    resolved config, as plain data)."""
    flat = _flatten(config)
    return {
        key: fingerprint(value)
        for key, value in sorted(flat.items())
        if key.startswith(tuple(f"{node}." for node in INPUT_NODES))
        and isinstance(value, str)
        and "/" in value
        and Path(value).exists()
    }


class RunDir:
    """`with RunDir(path) as run:` — the lock is held inside the block."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = RunDirLock(self.path, "evaluation run")

    def __enter__(self) -> RunDir:
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._lock.__exit__(*exc)

    @property
    def results(self) -> Path:
        return self.path / RESULTS_FILE

    def check_config(self, config: dict, inputs: dict[str, dict]) -> None:
        """Refuse to mix results of two configurations (the resolved config, as plain data), or of other model
        files (`inputs`, from `run_inputs`), in one run dir (before any model loads)."""
        saved_path = self.path / CONFIG_FILE
        if not self.results.is_file() or not saved_path.is_file():
            return
        saved = OmegaConf.to_container(OmegaConf.load(saved_path))
        now = config
        flat = [_flatten({k: v for k, v in c.items() if k not in NON_RESULT_KEYS}) for c in (saved, now)]
        differ = sorted(k for k in set(flat[0]) | set(flat[1]) if flat[0].get(k) != flat[1].get(k))
        if differ:
            raise ValueError(
                f"run dir {self.path} holds results of a different configuration (keys {differ[:8]} differ); "
                "rerun with the same settings to resume, or choose a new output dir (hydra.run.dir / hydra.sweep.dir)"
            )
        changes = fingerprint_changes(saved.get(INPUTS_KEY) or {}, inputs)
        if changes:
            raise ValueError(
                f"run dir {self.path} holds results computed with other model files: {'; '.join(changes)}. "
                "Resuming would mix two models in one table: choose a new output dir, or restore the files"
            )

    def write_config(self, config: dict, inputs: dict[str, dict]) -> None:
        write_atomic(
            self.path / CONFIG_FILE, OmegaConf.to_yaml(OmegaConf.create({**config, INPUTS_KEY: inputs}))
        )

    def check_test_list(self, pairs) -> None:
        from ssd.data.libritts import load_table, save_table

        path = self.path / TEST_LIST_FILE
        if path.is_file():
            saved = load_table(path)
            if (
                saved["utt"].tolist() != pairs["utt"].tolist()
                or saved["prompt_utt"].tolist() != pairs["prompt_utt"].tolist()
            ):
                raise ValueError(
                    f"{path} differs from the test list the eval config builds now (corpus changed?)"
                )
            return
        tmp = path.with_name(f".tmp.{path.name}")  # same suffix: save_table picks the format by it
        save_table(pairs, tmp)
        tmp.replace(path)

    def write_metrics(self, metrics: dict) -> None:
        write_atomic(self.path / METRICS_FILE, json.dumps(metrics, indent=1))
        (self.path / ERROR_FILE).unlink(missing_ok=True)


def write_error(run_dir: Path, error: str, traceback_text: str) -> None:
    """error.json of a failed multirun job (outside the lock: the failure may be the lock itself)."""
    write_atomic(
        Path(run_dir) / ERROR_FILE, json.dumps({"error": error, "traceback": traceback_text}, indent=1)
    )
