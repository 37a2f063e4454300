"""Type-check the `ragkv` package with mypy, as it installs: `make lint` and CI run this.

The distribution maps top-level folders (assembler/, cache_engine/, ...) into the `ragkv`
package (`[tool.setuptools] package-dir` in pyproject.toml). An editable install serves that
through an import hook, which mypy cannot follow, and mypy run on the folders themselves would
name their modules `assembler.*` instead of `ragkv.assembler.*`. So this lays the package out
as a tree of symlinks under build/typecheck/, runs mypy on it (configured by `[tool.mypy]`),
and writes reported paths back as the repository's own, so that editors can jump to them.

Usage: python tools/typecheck.py [extra mypy arguments]
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREE = Path("build") / "typecheck"  # relative to ROOT, so that mypy reports short paths


def package_dirs() -> dict[str, str]:
    """Package name -> folder, from pyproject.toml (the one place the layout is written)."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]["package-dir"]


def build_tree(mapping: dict[str, str]) -> dict[str, str]:
    """Lay the package out under TREE; return tree path prefix -> repository path prefix."""
    tree = ROOT / TREE
    shutil.rmtree(tree, ignore_errors=True)
    prefixes: dict[str, str] = {}
    for package, folder in sorted(mapping.items(), key=lambda kv: kv[0].count(".")):
        dest = tree / package.replace(".", "/")
        source = ROOT / folder
        prefixes[f"{TREE / package.replace('.', '/')}/"] = f"{folder}/"
        if "." not in package:
            # The top-level package is a real folder, so its mapped subpackages fit inside
            # it; its own files and subfolders are linked one by one.
            dest.mkdir(parents=True)
            for entry in source.iterdir():
                if entry.name != "__pycache__":
                    (dest / entry.name).symlink_to(entry)
        else:
            if dest.is_symlink() or dest.exists():
                dest.unlink()
            dest.symlink_to(source, target_is_directory=True)
    return prefixes


def main(argv: list[str]) -> int:
    prefixes = build_tree(package_dirs())
    # The deepest prefix first: `ragkv/dedup/` before `ragkv/`.
    ordered = sorted(prefixes.items(), key=lambda kv: -len(kv[0]))
    tops = sorted({package.split(".")[0] for package in package_dirs()})
    cmd = [sys.executable, "-m", "mypy", *(str(TREE / top) for top in tops), *argv]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    for stream, text in ((sys.stdout, proc.stdout), (sys.stderr, proc.stderr)):
        for line in text.splitlines(keepends=True):
            for tree_prefix, repo_prefix in ordered:
                if line.startswith(tree_prefix):
                    line = repo_prefix + line[len(tree_prefix) :]
                    break
            stream.write(line)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
