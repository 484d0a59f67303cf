"""The ladder's layout: versions.toml matches the folders, and a file a rung does not claim to
add, change or remove is byte-identical to the previous rung's copy."""

import shutil
from pathlib import Path

import pytest

import torchlet
from torchlet.manifest import PACKAGE_DIR, VersionEntry, load_manifest, version_files


def manifest_violations(entries: list[VersionEntry], root: Path) -> list[str]:
    """Every way the folders under root disagree with the manifest entries."""
    problems = []
    first = entries[0]
    if version_files(root / first.name) != set(first.added):
        problems.append(f"{first.name}: its files differ from its `added` list")
    for previous, entry in zip(entries, entries[1:]):
        problems += rung_violations(root / previous.name, root / entry.name, entry)
    return problems


def rung_violations(previous_dir: Path, folder: Path, entry: VersionEntry) -> list[str]:
    before, after = version_files(previous_dir), version_files(folder)
    expected_after = (before - set(entry.removed)) | set(entry.added)
    problems = [f"{entry.name}: unlisted new file {f}" for f in sorted(after - expected_after)]
    problems += [f"{entry.name}: unlisted missing file {f}" for f in sorted(expected_after - after)]
    problems += [f"{entry.name}: 'added' {f} existed before" for f in entry.added if f in before]
    problems += [f"{entry.name}: 'removed' {f} absent" for f in entry.removed if f not in before]
    for name in sorted(before & after):
        same = (previous_dir / name).read_bytes() == (folder / name).read_bytes()
        if same and name in entry.changed:
            problems.append(f"{entry.name}: {name} is listed as changed but is identical")
        if not same and name not in entry.changed:
            problems.append(f"{entry.name}: {name} differs from {previous_dir.name}'s copy")
    problems += [f"{entry.name}: 'changed' {f} is not in both" for f in entry.changed
                 if f not in before or f not in after]
    return problems


def test_manifest_lists_the_versions_in_order():
    names = [entry.name for entry in load_manifest()]
    assert names == torchlet.VERSIONS
    folders = sorted(p.name for p in PACKAGE_DIR.glob("v[0-9]*") if p.is_dir())
    assert folders == sorted(torchlet.VERSIONS)
    assert all(entry.title and entry.summary for entry in load_manifest())


def test_unchanged_files_are_byte_identical_to_the_previous_version():
    assert manifest_violations(load_manifest(), PACKAGE_DIR) == []


def test_the_identity_check_catches_an_unlisted_change(tmp_path):
    entries = load_manifest()[:3]
    for entry in entries:
        ignore = shutil.ignore_patterns("__pycache__")
        shutil.copytree(entry.folder, tmp_path / entry.name, ignore=ignore)
    assert manifest_violations(entries, tmp_path) == []
    config = tmp_path / entries[2].name / "config.py"
    config.write_text(config.read_text() + "\n# an edit nobody listed\n")
    (tmp_path / entries[1].name / "extra.py").write_text("")
    problems = manifest_violations(entries, tmp_path)
    assert any("config.py differs" in p for p in problems)
    assert any("unlisted new file extra.py" in p for p in problems)


@pytest.mark.parametrize("version", torchlet.VERSIONS)
def test_each_version_says_what_it_adds(version):
    doc = (PACKAGE_DIR / version / "llm.py").read_text().split('"""')[1]
    assert doc.startswith(f"{version}: ")
    assert len(doc.splitlines()) >= 4  # a title line, a blank line, a few lines of why
