"""Files a run writes and reads, made safe against kills, concurrent writers and swapped models.

- `write_atomic`: temp file in the same dir + rename, so a reader (or a rerun after a kill) sees the
  old file or the new one, never half of one.
- `RunDirLock`: one process at a time per run dir (an advisory `flock`, released when the process
  dies, so a killed run never leaves a stale lock behind).
- `fingerprint` / `fingerprint_changes`: the identity of every model file a run reads (size + SHA-256
  of its first and last MiB: cheap for multi-GB checkpoints, and a changed file almost always changes
  its size or its ends), stored with a run and compared on resume.
- `read_checkpoint` / `read_safetensors`: a truncated or foreign file raises an error naming the file.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile
import time
from pathlib import Path
from typing import Any

EDGE_BYTES = 1 << 20  # bytes hashed at each end of a file
MAX_DIR_FILES = 64  # a larger dir (a source checkout) is fingerprinted by its listing (names + sizes)


def write_atomic(path: str | Path, data: str | bytes) -> Path:
    """Write `data` to `path` by a temp file in the same dir and an atomic rename (fsynced first)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


class RunDirLock:
    """`with RunDirLock(run_dir):` holds `run_dir/.lock`; a second holder fails at once, naming the first
    (`wait=True`: it says so and waits for the first to finish instead)."""

    def __init__(self, run_dir: str | Path, what: str = "run", wait: bool = False) -> None:
        self.path = Path(run_dir) / ".lock"
        self.what = what
        self.wait = wait
        self._file = None

    def __enter__(self) -> RunDirLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = open(self.path, "a+")  # noqa: SIM115  (held open for the lock's lifetime)
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._holder(f)
            if not self.wait:
                f.close()
                raise RuntimeError(
                    f"{self.path.parent} is in use by {holder}: two {self.what}s must not write one dir at once "
                    "(wait for it, or give this one its own dir)"
                ) from None
            print(
                f"{self.path.parent} is in use by {holder} ({self.what}): waiting for it to finish",
                flush=True,
            )
            fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {os.uname().nodename}")
        f.flush()
        self._file = f
        return self

    @staticmethod
    def _holder(f: Any) -> str:
        """Who holds the lock: the holder writes its pid just after taking it, so give it a moment to."""
        for _ in range(20):
            f.seek(0)
            if holder := f.read().strip():
                return holder
            time.sleep(0.05)
        return "another process"

    def __exit__(self, *exc: Any) -> None:
        if self._file is not None:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None


def write_checkpoint(path: str | Path, payload: Any) -> Path:
    """torch.save `payload` to `path` atomically (`write_atomic`): a kill mid-save leaves the old file whole."""
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return write_atomic(path, buffer.getvalue())


def read_checkpoint(path: str | Path, what: str, mmap: bool = False) -> Any:
    """torch.load (weights only) of a file the user points at; an unreadable one (truncated, empty, another
    format) raises ValueError naming the file and what it should be, instead of torch's zip-reader error."""
    import torch

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path} does not exist")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as err:  # torch raises RuntimeError, EOFError, UnpicklingError, ... for a bad file
        raise ValueError(
            f"{path} ({path.stat().st_size} bytes) is not a readable {what}: {str(err).splitlines()[0][:160]}. "
            "Was it copied completely? Re-download or re-export it"
        ) from err


def read_safetensors(path: str | Path, what: str) -> dict:
    """safetensors' load_file with the same kind of error as `read_checkpoint`."""
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as err:  # SafetensorError, OSError
        raise ValueError(f"{path} is not a readable {what}: {err}. Was it copied completely?") from err


def _file_identity(path: Path) -> dict[str, Any]:
    size = path.stat().st_size
    digest = hashlib.sha256()
    with path.open("rb") as f:
        digest.update(f.read(EDGE_BYTES))
        if size > 2 * EDGE_BYTES:
            f.seek(size - EDGE_BYTES)
        digest.update(f.read(EDGE_BYTES))
    return {"size": size, "sha256_edges": digest.hexdigest()}


def fingerprint(path: str | Path) -> dict[str, Any]:
    """{relative file: identity} for a file or a dir (a big dir: its listing), {} when it does not exist."""
    path = Path(path)
    if path.is_file():
        return {path.name: _file_identity(path)}
    if not path.is_dir():
        return {}
    files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
    if len(files) > MAX_DIR_FILES:
        return {"listing": hashlib.sha256("".join(f"{p.relative_to(path)}:{p.stat().st_size};"
                                                  for p in files).encode()).hexdigest()}  # fmt: skip
    return {str(p.relative_to(path)): _file_identity(p) for p in files}


def fingerprint_changes(saved: dict[str, dict], now: dict[str, dict]) -> list[str]:
    """Human-readable differences between two {input name: fingerprint} maps (empty: the same inputs)."""
    changes = []
    for name in sorted(set(saved) | set(now)):
        before, after = saved.get(name, {}), now.get(name, {})
        if before == after:
            continue
        differ = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
        changes.append(f"{name} ({', '.join(differ[:4])}{', ...' if len(differ) > 4 else ''} changed)")
    return changes
