"""The README's Quick start, LangChain and LlamaIndex examples run as written, on the embedded model."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def snippet(heading: str) -> str:
    """The fenced python block of the README section titled ``heading``."""
    text = README.read_text()
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, f"expected one python block under '## {heading}'"
    return blocks[0]


def run_snippet(heading: str, framework: str) -> dict:
    """Execute the README section's python block; returns its namespace."""
    pytest.importorskip(framework)
    namespace: dict = {}
    exec(compile(snippet(heading), f"README.md#{heading.lower()}", "exec"), namespace)
    return namespace


@pytest.mark.slow
def test_readme_langchain_example_runs(capsys):
    out = run_snippet("LangChain", "langchain_core")["out"]
    assert len(out["documents"]) == 2  # three stored passages, one byte-identical copy
    assert len(out["plan"].spans("chunk")) == 2
    assert out["answer"] and out["answer"] in capsys.readouterr().out


@pytest.mark.slow
def test_readme_llama_index_example_runs(capsys):
    response = run_snippet("LlamaIndex", "llama_index.core")["response"]
    assert len(response.source_nodes) == 2
    assert response.metadata["dedup"]["chunks_out"] == 2
    assert str(response) and str(response) in capsys.readouterr().out


@pytest.mark.slow
def test_readme_quick_start_runs(capsys):
    namespace: dict = {}
    exec(compile(snippet("Quick start"), "README.md#quick-start", "exec"), namespace)
    ans = namespace["ans"]
    assert ans.dedup.duplicates_dropped == 1 and ans.usage.completion_tokens <= 32
    out = capsys.readouterr().out
    assert ans.text in out and ans.prompt_text in out


@pytest.mark.slow
def test_readme_batch_example_runs(capsys):
    namespace: dict = {}
    exec(compile(snippet("Batch jobs"), "README.md#batch-jobs", "exec"), namespace)
    assert namespace["answer"].text in capsys.readouterr().out
    assert namespace["pipe"].engine.stats().prefill_tokens_reused > 0  # France's chunk, reused
