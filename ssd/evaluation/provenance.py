"""Where a result came from: the machine (machine.txt), the commit (git_commit.txt) and the exact commands
(command.txt) of an experiment's results dir."""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ssd.files import write_atomic


def machine_description() -> str:
    """CPU and the vector unit torch's CPU kernels use (float rounding differs between them, so results
    trained or decoded on an AVX2 and an AVX-512 machine differ a little), cores, torch threads and
    version, device, python, platform."""
    import torch

    cpu = platform.processor() or "unknown"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                 if line.startswith("model name")]  # fmt: skip
        cpu = names[0] if names else cpu
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (no CUDA device)"
    return (
        f"cpu: {cpu}\ncpu capability (torch kernels): {torch.backends.cpu.get_cpu_capability()}\n"
        f"cores: {os.cpu_count()}\ntorch threads: {torch.get_num_threads()}\n"
        f"torch: {torch.__version__}\ndevice: {device}\npython: {platform.python_version()}\n"
        f"platform: {platform.platform()}\n"
    )


def git_description(repo: Path) -> str:
    """The commit of the checkout at `repo`, and its uncommitted changes to tracked files."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    commit = git("rev-parse", "HEAD") or "unknown (not a git checkout)"
    dirty = [line for line in git("status", "--porcelain", "--untracked-files=no").splitlines() if line]
    text = f"{commit}\n"
    if dirty:
        text += f"uncommitted changes to {len(dirty)} tracked files:\n" + "\n".join(dirty) + "\n"
    return text


@dataclass
class CommandLog:
    """The exact commands of one experiment, as run from `cwd` (command.txt, rewritten after each)."""

    path: Path
    cwd: Path
    lines: list[str] = field(default_factory=list)

    def add(self, argv: Sequence[str]) -> str:
        """Record `argv`; returns it as one shell-quoted line."""
        self.lines.append(" ".join(shlex.quote(a) for a in argv))
        write_atomic(
            self.path, f"# run from {self.cwd} (python = {sys.executable})\n" + "\n".join(self.lines) + "\n"
        )
        return self.lines[-1]
