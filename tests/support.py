"""Shared test helpers: tiny random-weight checkpoints and a locally trained tokenizer.

Nothing here downloads anything: configs are written in code, weights are random with a
fixed seed, and the tokenizer is a byte-level BPE trained on CPython's own docs.

The benchmark scripts import it too (``tests`` put on ``sys.path``), for the same tiny
model, tokenizer and cache-manager request.
"""

from __future__ import annotations

import importlib.util
import json
import math
import random
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

TINY_VOCAB = 512

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def training_text() -> list[str]:
    """A few hundred KB of real English text that ships with CPython."""
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)][:120]


def train_byte_level_bpe(corpus: Iterable[str], vocab_size: int):
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``corpus``, with the ChatML
    special tokens (``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    return tok


@cache
def _tokenizer_json() -> str:
    return train_byte_level_bpe(training_text(), TINY_VOCAB).to_str()


def tiny_tokenizer():
    """A byte-level BPE fast tokenizer (vocab 512) with a ChatML chat template."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json()),
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML,
    )


def tiny_config(family: str, **overrides):
    """A 2-layer config of the given family with GQA (4 heads, 2 KV heads, head_dim 16)."""
    from transformers import AutoConfig

    common = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    if family == "mistral":
        common["sliding_window"] = None
    common.update(overrides)
    return AutoConfig.for_model(family, **common)


def save_tiny_checkpoint(
    directory: Path, family: str = "llama", seed: int = 0, **overrides
) -> Path:
    """Write a random-weight checkpoint (config, safetensors, tokenizer) into ``directory``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides), dtype=torch.float32)
    # Random init gives near-uniform logits; scale the output layer so greedy decoding
    # has clear winners and exactness tests are not decided by float noise.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    return directory


@contextmanager
def tiny_engine(directory: Path, seed: int, **settings: Any) -> Iterator[Any]:
    """An in-process CPU ``Engine`` over a tiny llama checkpoint written into ``directory``
    (``settings``: ``Engine.from_pretrained`` keywords); closed on exit."""
    from ragkv.cache_engine import Engine

    path = save_tiny_checkpoint(directory, "llama", seed=seed)
    with Engine.from_pretrained(path, device="cpu", **settings) as engine:
        yield engine


def tiny_engine_fixture(directory_name: str, seed: int, **settings: Any) -> Any:
    """A module-scoped ``engine`` fixture: a :func:`tiny_engine` in a fresh directory
    (``engine = tiny_engine_fixture("name", seed, kv_cache_tokens=...)`` at module level)."""
    import pytest

    @pytest.fixture(scope="module")
    def engine(tmp_path_factory):
        with tiny_engine(tmp_path_factory.mktemp(directory_name), seed, **settings) as eng:
            yield eng

    return engine


@contextmanager
def running_servers(default_engine: Any) -> Iterator[Callable[..., tuple[str, Any]]]:
    """``start(engine=None, **create_app_kwargs) -> (base_url, app)``: a live ``ragkv serve``
    app on a free loopback port, over ``default_engine`` unless another ``engine`` is given;
    every server started stops on exit."""
    from ragkv.integrations.openai.server.app import create_app
    from ragkv.integrations.openai.server.thread import ServerThread

    running: list[Any] = []

    def start(engine: Any = None, **kwargs: Any) -> tuple[str, Any]:
        app = create_app(engine or default_engine, **kwargs)
        thread = ServerThread(app)
        running.append(thread)
        return thread.start(), app

    try:
        yield start
    finally:
        for thread in running:
            thread.stop()


def serve_in_thread(engine: Any, api_key: str, *, events: bool = True) -> tuple[str, Any, Any]:
    """Serve ``engine`` on a free loopback port in this process and, with ``events``, publish
    its KV events over ZMQ as ``ragkv serve --kv-events-endpoint`` does (free loopback PUB
    and replay ports): ``(url ending in /v1, server thread, publisher or None)``. The caller
    stops the thread, then closes the publisher."""
    from ragkv.integrations.kv_events.publisher import KVEventPublisher, SaltViews
    from ragkv.integrations.openai.server.app import create_app
    from ragkv.integrations.openai.server.thread import ServerThread

    publisher = None
    if events:
        publisher = KVEventPublisher(
            engine.kv_events(),
            "tcp://127.0.0.1:*",
            replay_endpoint="tcp://127.0.0.1:*",
            salt_views=SaltViews(),
        ).start()
    app = create_app(engine, api_key=api_key)
    if publisher is not None:
        app.state.ragkv.salt_views = publisher.salt_views
    thread = ServerThread(app)
    return thread.start() + "/v1", thread, publisher


def open_engine_fixture(scope: str, **settings: Any) -> Any:
    """An ``engine`` fixture of ``scope`` over the integration tests' ``open_engine``
    (``settings``: ``Engine.from_pretrained`` keywords); the engine closes when the scope
    ends (``serve_engine = open_engine_fixture("session", kv_cache_tokens=...)``)."""
    import pytest

    @pytest.fixture(scope=scope)
    def engine(open_engine):
        with open_engine(**settings) as eng:
            yield eng

    return engine


def ids(seed: int, n: int) -> list[int]:
    """``n`` random token ids of the tiny vocab, skipping the special ids 0-2 (same per seed)."""
    rng = random.Random(seed)
    return [rng.randrange(3, TINY_VOCAB) for _ in range(n)]


@torch.inference_mode()
def reference_logits(model, token_ids: list[int]) -> torch.Tensor:
    """The Hugging Face forward of ``token_ids``: fp32 logits, one row per position."""
    return model(torch.tensor([token_ids])).logits[0].float()


def sse_payloads(text: str) -> list:
    """Every ``data:`` payload of an SSE body, checking the framing on the way."""
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[len("data: ") :]) for e in events[:-1]]


def common_prefix(a, b) -> int:
    """How many leading items two sequences share (shared prompt prefixes in tests)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass
class CacheReq:
    """The request surface the KV cache manager reads, without an engine."""

    request_id: int
    token_ids: list[int]
    cache_salt: str | None = None
    num_prompt_tokens: int = field(init=False)
    block_hasher: Any = None  # set by the manager on first use, as on an engine Request

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.token_ids)

    @property
    def salt_digest(self) -> bytes | None:
        from ragkv.cache_engine.block_hash import digest_salt

        return None if self.cache_salt is None else digest_salt(self.cache_salt)


TIER_BLOCK_SHAPE = (2, 2, 4, 2, 8)  # a stored block: [layers, K/V, block_size, kv_heads, head_dim]


def tier_block(i: int, dtype=torch.float32) -> tuple[bytes, bytes, torch.Tensor]:
    """A block hash, its hash input and a payload for the KV tier stores, distinct per ``i``."""
    gen = torch.Generator().manual_seed(i)
    payload = torch.randn(TIER_BLOCK_SHAPE, generator=gen).to(dtype)
    hash_input = i.to_bytes(16, "little") + bytes(range(64)) + b"model:tiny"
    return i.to_bytes(16, "big"), hash_input, payload


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN payloads included)."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


@contextmanager
def benchmark_script(name: str) -> Iterator[ModuleType]:
    """``benchmarks/<name>.py`` imported as the module ``ragkv_<name>``; it stays in
    ``sys.modules`` while in use (dataclasses look their module up there)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"ragkv_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def paged_kv(
    seq_lens: Sequence[int],
    order: torch.Tensor,
    gen: torch.Generator,
    *,
    block_size: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """A paged KV cache as the engine leaves it: NaN everywhere but the sequences' tokens.

    Sequence ``i`` gets ``seq_lens[i]`` random K/V rows (drawn from ``gen``), stored through
    the torch ``store_kv`` into the next blocks of ``order`` (a permutation of the cache's
    blocks). Returns (k_cache, v_cache, block table with two padding columns, each
    sequence's unpaged (k, v)).
    """
    from ragkv.kernels import store_kv

    need = [math.ceil(seq_len / block_size) for seq_len in seq_lens]
    shape = (len(order), block_size, kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    table = torch.zeros(len(seq_lens), max(need) + 2, dtype=torch.int32)
    kv, used = [], 0
    for i, (seq_len, n) in enumerate(zip(seq_lens, need, strict=True)):
        table[i, :n] = order[used : used + n]
        used += n
        k = torch.randn(seq_len, kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(seq_len, kv_heads, head_dim, generator=gen).to(dtype)
        pos = torch.arange(seq_len)
        slots = table[i, pos // block_size].long() * block_size + pos % block_size
        store_kv(k, v, k_cache, v_cache, slots, backend="torch")
        kv.append((k, v))
    return k_cache, v_cache, table, kv


def race(write: Callable[[int], None], read: Callable[[], None], timeout_s: float) -> None:
    """``write(0)``, ``write(1)`` and ``read()`` twice, on four threads at once; joined."""
    threads = [threading.Thread(target=write, args=(k,)) for k in (0, 1)]
    threads += [threading.Thread(target=read) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
