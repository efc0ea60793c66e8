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


def test_every_folder_of_modules_is_a_package_the_install_finds():
    """pyproject finds packages with setuptools' find_packages, which skips a folder without ``__init__.py``
    (its modules would be missing from a non-editable install)."""
    from setuptools import find_packages

    found = set(find_packages(str(PACKAGE.parent), include=["iterserve*"]))
    folders = {".".join(p.parent.relative_to(PACKAGE.parent).parts) for p in PACKAGE.rglob("*.py")
               if "_build" not in p.parts and "__pycache__" not in p.parts}
    assert folders <= found, f"folders of modules without __init__.py: {sorted(folders - found)}"
