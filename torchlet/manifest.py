"""Read versions.toml: for each rung, the files it adds, changes and removes (for the byte-identity
test and for tools that render the diff between neighbouring rungs)."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

PACKAGE_DIR = Path(__file__).parent


@dataclass(frozen=True)
class VersionEntry:
    name: str
    title: str
    summary: str
    added: tuple[str, ...]
    changed: tuple[str, ...]
    removed: tuple[str, ...]

    @property
    def folder(self) -> Path:
        return PACKAGE_DIR / self.name


def load_manifest(path: Path = PACKAGE_DIR / "versions.toml") -> list[VersionEntry]:
    raw = tomllib.loads(Path(path).read_text())
    return [
        VersionEntry(
            name=entry["name"],
            title=entry["title"],
            summary=entry["summary"],
            added=tuple(entry.get("added", ())),
            changed=tuple(entry.get("changed", ())),
            removed=tuple(entry.get("removed", ())),
        )
        for entry in raw["version"]
    ]


def version_files(folder: Path) -> set[str]:
    """The files of a rung, as paths relative to its folder (caches left out)."""
    return {
        str(path.relative_to(folder))
        for path in folder.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    }
