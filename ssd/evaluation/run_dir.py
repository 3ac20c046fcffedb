"""The one owner of an evaluation run dir: who may write it, what it holds, and how it resumes.

    config.yaml         the resolved config + `run_inputs`: the fingerprint of every model file the run read
    test_list.jsonl     the zero-shot pairs
    utterances.jsonl    one record per utterance, appended (fsynced) as each finishes
    utterances.bad.jsonl  lines set aside on resume: unparsable (a killed writer) or a second record of an utterance
    metrics.json        the summary; error.json when the job failed in a multirun

A sweep dir holds one run dir per job and `baselines/<key>/`: the AR runs its jobs measure speedup and
ΔWER against (`ssd.evaluation.baselines.ensure_baseline`).

Every file is written through `ssd.files` (temp + rename; records appended, never through a link). A run
holds `.lock` while it writes, so a second process (two sweeps into one dir, a joblib sweep with a repeated
value) fails at once instead of doubling records, and the lock marks the dir as an evaluation run, so a
training or a sweep never writes into it (nor it into theirs). Resume refuses a dir computed with another
configuration, other input files or another test list, and never counts an utterance twice.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from ssd.files import RunDirLock, append_line, fingerprint, fingerprint_changes, write_atomic

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
# Config nodes whose path values name files the results depend on (the corpus is checked through the test
# list's content instead).
INPUT_NODES = ("target.model", "draft", "acceptance", "groups", "decoding", "speech_tokenizer", "vocoder", "asr",
               "sim", "mos", "perturb")  # fmt: skip
# A string value is a path when it holds a '/' or a '.', or its key is named like one (a relative
# `draft.checkpoint=mydraft.pt` and `model_dir=mymodel` count as much as an absolute path).
PATH_KEY_ENDINGS = ("dir", "path", "checkpoint", "root", "repo", "file", "python")
# What a test list entry is: a change in any of these between a run and its resume is refused.
TEST_LIST_CONTENT = ("utt", "text", "prompt_utt", "prompt_text", "prompt_audio")


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
        for b in bad:
            append_line(quarantine, json.dumps(b))
        write_atomic(path, "".join(json.dumps(r) + "\n" for r in records))
        log.warning("%s: %d line(s) set aside in %s (%s); %d records kept",
                    path, len(bad), quarantine, bad[0]["reason"], len(records))  # fmt: skip
    return records


def append_record(path: Path, record: dict) -> None:
    append_line(path, json.dumps(record))


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix.rstrip("."): d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}{k}."))
    return out


def _is_path(key: str, value: Any) -> bool:
    if not isinstance(value, str) or not value or key.rsplit(".", 1)[-1] in ("_target_", "name"):
        return False
    named = key.rsplit(".", 1)[-1].lower().endswith(PATH_KEY_ENDINGS)
    return (named or "/" in value or "." in value) and Path(value).exists()


def run_inputs(config: dict) -> dict[str, dict]:
    """{config key: fingerprint} of every existing file or dir that a string value of a run's part nodes
    names, relative (from the working dir) or absolute (config: the resolved config, as plain data)."""
    flat = _flatten(config)
    return {
        key: fingerprint(value)
        for key, value in sorted(flat.items())
        if key.startswith(tuple(f"{node}." for node in INPUT_NODES)) and _is_path(key, value)
    }


def with_prompt_audio(pairs):
    """The test list with `prompt_audio`: the identity of each prompt wav (`ssd.files.fingerprint`), so a
    prompt file replaced under the same name is seen on resume."""
    identity = {path: json.dumps(fingerprint(path), sort_keys=True) for path in set(pairs["prompt_wav"])}
    return pairs.assign(prompt_audio=[identity[p] for p in pairs["prompt_wav"]])


def test_list_changes(saved, now) -> list[str]:
    """What differs between a run's saved test list and the one built now (content, not only ids): entries
    added or dropped, and per utterance the fields of `TEST_LIST_CONTENT` that changed."""
    columns = [c for c in TEST_LIST_CONTENT if c in saved.columns and c in now.columns]
    before = {r["utt"]: r for r in saved[columns].to_dict(orient="records")}
    after = {r["utt"]: r for r in now[columns].to_dict(orient="records")}
    changes = []
    if list(before) != list(after):
        gone, new = sorted(set(before) - set(after)), sorted(set(after) - set(before))
        changes.append(
            f"utterances {gone[:3]} dropped, {new[:3]} added" if gone or new else "the order changed"
        )
    for utt in (u for u in before if u in after):
        for column in columns:
            if before[utt][column] != after[utt][column]:
                was, is_ = (str(x[utt][column])[:60] for x in (before, after))
                changes.append(f"utterance {utt}: {column} {was!r} then, {is_!r} now")
    return changes


class RunDir:
    """`with RunDir(path) as run:` — the lock is held inside the block; `run.path` is the run dir's absolute
    path (links above it resolved; a run dir that is itself a link is refused)."""

    def __init__(self, path: str | Path) -> None:
        self._lock = RunDirLock(path, "evaluation run")
        self.path = self._lock.dir

    def __enter__(self) -> RunDir:
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
        recorded = (
            saved.get(INPUTS_KEY) or {}
        )  # a key an older ssd did not fingerprint is compared by its value
        changes = fingerprint_changes(recorded, {k: v for k, v in inputs.items() if k in recorded})
        if changes:
            raise ValueError(
                f"run dir {self.path} holds results computed with other input files: {'; '.join(changes)}. "
                "Resuming would mix two models in one table: choose a new output dir, or restore the files"
            )

    def write_config(self, config: dict, inputs: dict[str, dict]) -> None:
        write_atomic(
            self.path / CONFIG_FILE, OmegaConf.to_yaml(OmegaConf.create({**config, INPUTS_KEY: inputs}))
        )

    def check_test_list(self, pairs) -> None:
        """Refuse a test list whose content (ids, texts, prompts, prompt audio) differs from the one this run
        dir was computed on; write it otherwise. `pairs`: `with_prompt_audio` of the list built now."""
        from ssd.data.libritts import load_table, save_table

        path = self.path / TEST_LIST_FILE
        if path.is_file():
            changes = test_list_changes(load_table(path), pairs)
            if changes:
                raise ValueError(
                    f"{path} differs from the test list the eval config builds now: {'; '.join(changes[:5])}"
                    f"{f' (and {len(changes) - 5} more)' if len(changes) > 5 else ''}. Resuming would decode "
                    "another list under the same results: restore the corpus (eval.corpus_root), or choose a new "
                    "output dir"
                )
            return
        save_table(pairs, path)

    def write_metrics(self, metrics: dict) -> None:
        write_atomic(self.path / METRICS_FILE, json.dumps(metrics, indent=1))
        (self.path / ERROR_FILE).unlink(missing_ok=True)


def write_error(run_dir: Path, error: str, traceback_text: str) -> None:
    """error.json of a failed multirun job (outside the lock: the failure may be the lock itself)."""
    write_atomic(
        Path(run_dir) / ERROR_FILE, json.dumps({"error": error, "traceback": traceback_text}, indent=1)
    )
