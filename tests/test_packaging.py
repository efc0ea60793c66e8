"""Every data file the package reads ships in a non-editable install: pyproject's package-data names it."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

import iterserve

PACKAGE = Path(iterserve.__file__).resolve().parent
PYPROJECT = PACKAGE.parent / "pyproject.toml"


def test_package_data_covers_every_data_file():
    globs = tomllib.loads(PYPROJECT.read_text())["tool"]["setuptools"]["package-data"]
    data_files = [p for p in PACKAGE.rglob("*") if p.is_file() and p.suffix not in (".py", ".pyc")
                  and "_build" not in p.relative_to(PACKAGE).parts and "__pycache__" not in p.parts]
    assert any(p.suffix == ".json" for p in data_files)
    for path in data_files:
        covered = False
        for package, patterns in globs.items():
            root = PACKAGE.parent.joinpath(*package.split("."))
            if root in path.parents:
                rel = path.relative_to(root)
                covered |= any(fnmatch.fnmatch(rel.as_posix(), pattern) for pattern in patterns)
        assert covered, f"{path.relative_to(PACKAGE.parent)} is not in pyproject's package-data"
