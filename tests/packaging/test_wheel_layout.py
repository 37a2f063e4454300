"""The built wheel installs every stage under the ``ragkv`` import package, and nothing else."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STAGES = ("dedup", "assembler", "cache_engine", "kernels", "integrations")


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory) -> list[str]:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(ROOT),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
        ],
        check=True,
        cwd=out,
    )
    (wheel,) = out.glob("ragkv-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        return zf.namelist()


def test_stages_install_as_ragkv_subpackages(wheel_names):
    for stage in STAGES:
        assert f"ragkv/{stage}/__init__.py" in wheel_names
    assert "ragkv/py.typed" in wheel_names


def test_no_top_level_stage_package_shadows_pypi_names(wheel_names):
    top_level = {name.split("/")[0] for name in wheel_names}
    assert not top_level & {*STAGES, "tests", "benchmarks", "notebooks"}
    assert {t for t in top_level if not t.endswith(".dist-info")} == {"ragkv"}


def test_every_module_is_in_the_wheel(wheel_names):
    for folder, prefix in [("ragkv", "ragkv"), *((s, f"ragkv/{s}") for s in STAGES)]:
        for source in (ROOT / folder).rglob("*.py"):
            relative = source.relative_to(ROOT / folder).as_posix()
            assert f"{prefix}/{relative}" in wheel_names, f"{folder}/{relative} is not packaged"
