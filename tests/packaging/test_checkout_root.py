"""Running Python in the checkout's root puts `kernels/` (ragkv.kernels' source) on sys.path
as a top-level `kernels`, which shadows Hugging Face's package of that name."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_source_directory_refuses_to_stand_in_for_a_top_level_kernels_package():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    done = subprocess.run(
        [sys.executable, "-c", "import kernels"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode != 0
    assert "found ragkv's source directory" in done.stderr
    assert "python -P" in done.stderr


def test_the_test_session_keeps_the_checkout_root_off_sys_path():
    assert all(Path(p or ".").resolve() != ROOT for p in sys.path)
    import ragkv.kernels  # still imports, as the installed package

    assert ragkv.kernels.__name__ == "ragkv.kernels"
