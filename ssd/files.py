"""Every file ssd writes or reads back, made safe against kills, links, mixed-up dirs and swapped models.

- `write_atomic`: the one way to write a file. A unique temp file (mkstemp: no predictable name, created
  with O_EXCL, so it never follows a link) in the target's dir, fsynced, then renamed over the target, so
  a reader (or a rerun after a kill) sees the old file or the new one, never half of one. A target that is
  a symbolic link, or in a dir that is one, is refused. Permissions are what the user's umask gives.
  `write_checkpoint` (torch.save), `write_tree` (a dir of files other libraries write) and `append_line`
  (the appended records of a run; O_NOFOLLOW) are built on the same rules.
- `RunDirLock`: one process at a time per run dir (an advisory `flock` on `.lock`, opened without
  following a link, released when the process dies). The lock also marks what the dir is (`KINDS`, in
  `.ssd_kind`): an evaluation run never writes into a training run's dir, nor a training into a sweep.
- `fingerprint` / `fingerprint_changes`: the identity of every file a run reads (size + SHA-256 of its
  first and last MiB: cheap for multi-GB checkpoints, and a changed file almost always changes its size or
  its ends), stored with a run and compared on resume.
- `read_checkpoint` / `read_safetensors`: weights only (nothing in a file runs code); a truncated,
  foreign or code-carrying file raises an error naming the file.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import pickle
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

EDGE_BYTES = 1 << 20  # bytes hashed at each end of a file
MAX_DIR_FILES = 64  # a larger dir (a source checkout) is fingerprinted by its listing (names + sizes)
LOCK_FILE = ".lock"
KIND_FILE = ".ssd_kind"


def _read_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_FILE_MODE = 0o666 & ~_read_umask()  # what open() gives a new file (mkstemp would give 0600)


class LinkRefused(ValueError):
    """A write that would go through a symbolic link."""


def refuse_links(path: str | Path) -> Path:
    """`path`, after checking that neither it nor the dir it lies in is a symbolic link (a write there would
    land in, or replace, a file outside the run)."""
    path = Path(path)
    for p in (path, path.parent):
        if p.is_symlink():
            raise LinkRefused(
                f"{p} is a symbolic link (to {os.readlink(p)}): ssd never writes through a link in a run dir. "
                "Remove the link (or point the run at a dir of its own)"
            )
    return path


def write_atomic(path: str | Path, data: str | bytes | Callable[[BinaryIO], Any]) -> Path:
    """Write `data` (text, bytes, or a function writing into a binary file) to `path`: temp file beside it,
    fsync, rename. Refuses a `path` that is a link or lies in a linked dir."""
    path = refuse_links(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    refuse_links(path)  # mkdir may have met a link made since
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, _FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_checkpoint(path: str | Path, payload: Any) -> Path:
    """torch.save `payload` to `path` through `write_atomic`: a kill mid-save leaves the old file whole."""
    import torch

    return write_atomic(path, lambda f: torch.save(payload, f))


def write_tree(path: str | Path, build: Callable[[Path], Any]) -> Path:
    """A dir of files written by code that takes a dir (HF's save_pretrained, ...): `build(staging)` fills a
    fresh temp dir beside `path`, then each file moves into `path` by an atomic rename (links refused)."""
    path = refuse_links(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        build(staging)
        for src in sorted(p for p in staging.rglob("*") if p.is_file()):
            dest = path / src.relative_to(staging)
            refuse_links(dest)
            dest.parent.mkdir(parents=True, exist_ok=True)
            refuse_links(dest)
            with src.open("rb") as f:
                os.fsync(f.fileno())
            os.chmod(src, _FILE_MODE)
            os.replace(src, dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def save_figure(fig: Any, path: str | Path, dpi: int = 120) -> Path:
    """A matplotlib figure as `path` (its format from the suffix), through `write_atomic`."""
    path = Path(path)
    return write_atomic(path, lambda f: fig.savefig(f, dpi=dpi, format=path.suffix.lstrip(".") or "png"))


def append_line(path: str | Path, line: str) -> None:
    """Append one line (fsynced) to `path`, never through a link."""
    path = refuse_links(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o666)
    except OSError as err:
        if err.errno == errno.ELOOP:
            refuse_links(path)  # raises, naming the link
        raise
    with os.fdopen(fd, "a", encoding="utf-8") as f:
        f.write(line if line.endswith("\n") else line + "\n")
        f.flush()
        os.fsync(f.fileno())


# --------------------------------------------------------------------------------------------------
# Run dirs: one writer at a time, and one kind of content
# --------------------------------------------------------------------------------------------------

# What a locked dir can be, with the files that show it in a dir made before dirs were marked.
KINDS = {
    "evaluation run": ("utterances.jsonl", "test_list.jsonl"),
    "training run": ("run.json", "checkpoints", "before_training.json"),
    "sweep": ("multirun.yaml", "baselines"),
    "AR baselines": (),
    "toy world": (),
    "toy-world stage": ("DONE.json", ".made_by_toy_world"),
}


def run_dir_path(path: str | Path) -> Path:
    """The absolute path of a run dir, links above it resolved; a run dir that is itself a link is refused."""
    path = Path(path).absolute()
    path = path.parent.resolve() / path.name
    return refuse_links(path / LOCK_FILE).parent


def dir_kind(path: str | Path) -> tuple[str | None, str]:
    """(what dir `path` holds, the evidence): its mark, else the files that show it, else (None, "")."""
    path = Path(path)
    mark = path / KIND_FILE
    if mark.is_file() and not mark.is_symlink():
        return mark.read_text().strip(), f"marked in {KIND_FILE}"
    for kind, signs in KINDS.items():
        found = [s for s in signs if (path / s).exists()]
        if found:
            return kind, f"it holds {', '.join(found)}"
    return None, ""


def _a(kind: str) -> str:
    return f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}"


def mark_kind(path: str | Path, kind: str) -> None:
    """Mark dir `path` as holding `kind`; refuse, naming the path and what it holds, a dir of another kind."""
    if kind not in KINDS:
        raise ValueError(f"unknown run dir kind {kind!r}: one of {list(KINDS)}")
    path = Path(path)
    held, evidence = dir_kind(path)
    if held is not None and held != kind:
        raise FileExistsError(
            f"{path} is {_a(held)} dir ({evidence}): {_a(kind)} must not write into it, it would overwrite "
            "what is there. Choose another dir (hydra.run.dir=... / hydra.sweep.dir=... / output_dir=...)"
        )
    if not (path / KIND_FILE).is_file():
        write_atomic(path / KIND_FILE, kind + "\n")


class RunDirLock:
    """`with RunDirLock(run_dir, kind):` holds `run_dir/.lock` and marks the dir as a `kind` (`KINDS`). A second
    holder fails at once, naming the first (`wait=True`: it says so and waits for the first to finish
    instead); a dir of another kind is refused."""

    def __init__(self, run_dir: str | Path, kind: str, wait: bool = False) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown run dir kind {kind!r}: one of {list(KINDS)}")
        self.dir = run_dir_path(run_dir)
        self.path = self.dir / LOCK_FILE
        self.kind = kind
        self.wait = wait
        self._fd: int | None = None

    def __enter__(self) -> RunDirLock:
        self.dir.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o666)
        except OSError as err:
            if err.errno == errno.ELOOP:
                refuse_links(self.path)
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            if not self.wait:
                os.close(fd)
                raise RuntimeError(
                    f"{self.dir} is in use by {holder}: two processes ({self.kind}) must not write one dir at "
                    "once (wait for it, or give this one its own dir)"
                ) from None
            print(f"{self.dir} is in use by {holder} ({self.kind}): waiting for it to finish", flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            mark_kind(self.dir, self.kind)
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {os.uname().nodename}".encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def _holder(fd: int) -> str:
    """Who holds a lock: the holder writes its pid just after taking it, so give it a moment to."""
    for _ in range(20):
        if holder := os.pread(fd, 200, 0).decode(errors="replace").strip():
            return holder
        time.sleep(0.05)
    return "another process"


def lock_holder(run_dir: str | Path) -> str | None:
    """Who holds `run_dir`'s lock now ("pid ... on ..."), or None (free, or no lock file)."""
    path = Path(run_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _holder(fd)
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------------
# Reading what a run depends on
# --------------------------------------------------------------------------------------------------


def read_checkpoint(path: str | Path, what: str, mmap: bool = False) -> Any:
    """torch.load (weights only) of a file the user points at. A file whose unpickling would run code, or an
    unreadable one (truncated, empty, another format), raises ValueError naming the file and what it should
    be, instead of torch's zip-reader error."""
    import torch

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path} does not exist")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        lines = [line for line in str(err).splitlines() if "GLOBAL" in line or "Unsupported" in line]
        why = lines[0].strip() if lines else str(err).splitlines()[0]  # torch's own first line says less
        raise ValueError(
            f"{path} was not loaded: a {what} holds tensors and plain data only, and this file holds objects "
            f"whose unpickling would run code ({why[:160]}). Use a file ssd wrote, or re-export it as a state dict"
        ) from None
    except Exception as err:  # torch raises RuntimeError, EOFError, ... for a bad file
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
