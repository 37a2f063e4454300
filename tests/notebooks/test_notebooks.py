"""Every notebook in notebooks/ executes top to bottom, offline, within its timeout.

Notebooks are committed without outputs; this test runs them in a fresh kernel. Their
figures come from real runs on the embedded model; here they run at their CI scale on a
tiny random-weight model with the embedded model's tokenizer (``$RAGKV_DEFAULT_MODEL``),
so each stays well under a minute on a slow 2-core machine. ``RAGKV_NOTEBOOKS_REAL=1``
runs them on the embedded model instead.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))
TIMEOUT_S = 600  # per cell; whole notebooks take well under this on 2 cores


@pytest.fixture(scope="module")
def tiny_default_model(tmp_path_factory):
    """The embedded model's tokenizer and chat template on a 2-layer random-weight llama."""
    import torch
    from support import tiny_config
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ragkv.cache_engine import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    config = tiny_config(
        "llama",
        vocab_size=len(tokenizer),
        max_position_embeddings=8192,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=None,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = tmp_path_factory.mktemp("tiny-default-model")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path: Path, monkeypatch, tiny_default_model):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("RAGKV_NOTEBOOK_CI", "1")  # notebooks keep their sweeps small
    if os.environ.get("RAGKV_NOTEBOOKS_REAL") != "1":
        monkeypatch.setenv("RAGKV_DEFAULT_MODEL", str(tiny_default_model))
    nb = nbformat.read(path, as_version=4)
    first = nb.cells[0]
    assert first.cell_type == "markdown" and "How long" in first.source, (
        "each notebook starts with a cell saying what it shows and how long it takes"
    )
    client = nbclient.NotebookClient(
        nb,
        timeout=TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute()  # raises at the first failing cell, except in one tagged raises-exception
    code = [cell for cell in nb.cells if cell.cell_type == "code" and cell.source.strip()]
    assert code, f"{path.name} has no code cell to run"
    errors = [out for cell in code for out in cell.outputs if out.output_type == "error"]
    assert not errors, f"{path.name}: cells tagged raises-exception failed: {errors}"
    # nbclient passes over cells tagged skip-execution without a word: top to bottom means
    # every code cell ran once, in order, in the fresh kernel.
    counts = [cell.execution_count for cell in code]
    assert counts == list(range(1, len(code) + 1)), (
        f"{path.name}: not every code cell ran in order (execution counts {counts})"
    )


def test_the_notebooks_are_found():
    """An empty NOTEBOOKS would turn the test above into a single silent skip."""
    assert [p.name for p in NOTEBOOKS][:1] == ["01_quickstart.ipynb"]
