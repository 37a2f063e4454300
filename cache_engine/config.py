"""One engine configuration: every setting, its default, its check and its flag, in one place.

``EngineConfig`` is validated once, when it is built, so a bad setting fails before a
model is loaded. Everything that sizes or loads an engine reads its defaults from
:data:`DEFAULTS` (the CLI's ``ragkv bench`` and ``ragkv demo`` included), and the one
dtype rule, :func:`resolve_dtype`, is shared by the engine and the bench, so every entry
point loads a model the same way. Each field's :class:`Flag` (help text, option name,
type, choices) is how ``ragkv serve`` and ``ragkv bench`` offer it
(:mod:`ragkv.cache_engine.engine_flags`). Importing this module does not import torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ragkv.defaults import DEFAULT_BLOCK_SIZE
from ragkv.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from ragkv.kernels.dispatch import Backend

SchedulePolicy = Literal["fcfs", "longest-prefix"]
SCHEDULE_POLICIES: tuple[str, ...] = ("fcfs", "longest-prefix")
HASH_ALGOS: tuple[str, ...] = ("xxh3_128", "blake3")
BACKENDS: tuple[str, ...] = ("auto", "triton", "torch")
DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16")
DEFAULT_CPU_KV_BYTES = 1 << 30
KV_TIER_WRITE_POLICIES: tuple[str, ...] = ("write-back", "write-through")
DEFAULT_KV_STORE_BYTES = 8 << 30  # disk tier, when kv_store_dir is set
# A block load takes milliseconds (one 0.7 MB file); seconds means a stuck filesystem.
DEFAULT_KV_LOAD_TIMEOUT_S = 10.0
MAX_KV_STORE_BYTES = 1 << 50  # a typo guard (1 PiB), not a real limit
CUDA_KV_SHARE = 0.4  # of the free device memory, when no pool size is given


_DTYPE_ALIASES = {
    "float": "float32",
    "half": "float16",
    "fp32": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
}


def _dtype_name(dtype: Any) -> str:
    """Normalize None, a torch.dtype or a name ("torch.float16", "half") to a name in DTYPES."""
    if dtype is None:
        return "auto"
    name = str(dtype).removeprefix("torch.")
    return _DTYPE_ALIASES.get(name, name)


@dataclass(frozen=True, slots=True)
class Flag:
    """How one :class:`EngineConfig` field appears on a command line (its ``metadata["flag"]``).

    ``name``: the option (default ``--`` + the field's name with dashes); a bool field's
    flag flips its default (``--no-...`` for a setting on by default). ``help`` may use argparse's ``%(default)s``. ``type``
    converts the text (None: kept as a string); ``choices`` are checked after conversion.
    :mod:`ragkv.cache_engine.engine_flags` turns these into parser options.
    """

    help: str
    name: str | None = None
    type: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None


def _setting(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    type: Callable[[str], Any] | None = None,
    choices: tuple[str, ...] | None = None,
) -> Any:
    """A field with its default and its command-line :class:`Flag`."""
    return field(default=default, metadata={"flag": Flag(help, flag, type, choices)})


@dataclass(slots=True)
class EngineConfig:
    """Everything that decides how an :class:`~ragkv.cache_engine.Engine` is built.

    ``model``: a local Hugging Face checkpoint directory (None: the embedded default).
    ``dtype``: "auto" (see :func:`resolve_dtype`), "float32", "bfloat16" or "float16".
    The KV pool is allocated once: ``kv_cache_tokens`` tokens, or ``kv_cache_bytes`` bytes
    (neither: 1 GiB on CPU, 40 % of free memory on CUDA). ``max_model_len`` caps the
    context below the model's own (None: the model's). ``max_num_seqs`` requests run at
    once, ``max_num_batched_tokens`` tokens per step. ``hash_algo`` names the block hash.
    ``schedule_policy``: "fcfs", or "longest-prefix" (admit the waiting request with the
    longest cached prefix first). ``backend``: the kernels' backend ("auto": Triton on CUDA).
    ``prepack_linear``: on CPU in float32, the linear layers run through oneDNN over
    weights packed once (:mod:`~ragkv.cache_engine.packed_linear`; twice the weights'
    memory). ``compile``: the model forward compiled by TorchInductor when the engine starts
    (:mod:`~ragkv.cache_engine.compiled_forward`; linears stay BLAS).

    KV tiers (off by default): blocks that leave the pool are kept in host memory
    (``host_cache_bytes``, 0 = off) and, with ``kv_store_dir``, on disk (at most
    ``kv_store_bytes``), and come back verified (Invariant 7). A store directory survives
    restarts. ``kv_store_salted=False`` keeps salted (per-tenant) requests' blocks out of
    the disk tier. ``kv_tier_write_policy``: "write-back" (host evictions go to disk) or
    "write-through" (blocks seen twice go to disk at once); see docs/benchmarks.md.
    ``kv_load_timeout_s``: the longest a request waits for its tier loads; past it the
    request computes those blocks instead, and while one block load runs longer no
    request is parked behind the loader (``Engine.health().kv_loader`` shows it).
    """

    model: str | Path | None = _setting(
        None, "local Hugging Face checkpoint directory (default: the embedded SmolLM2-135M)"
    )
    device: str = _setting("auto", "auto (the default: CUDA when available), cpu or cuda[:N]")
    dtype: str = _setting(
        "auto",
        "auto: the engine's rule (bf16 on CUDA, float32 on CPU)",
        type=_dtype_name,
        choices=DTYPES,
    )
    kv_cache_tokens: int | None = _setting(None, "KV pool size in tokens", type=int)
    kv_cache_bytes: int | None = _setting(
        None,
        "KV pool size in bytes (neither this nor --kv-cache-tokens: 1 GiB on CPU, "
        f"{CUDA_KV_SHARE:.0%}% of the free memory on CUDA)",
        type=int,
    )
    block_size: int = _setting(
        DEFAULT_BLOCK_SIZE, "tokens per KV block (default %(default)s)", type=int
    )
    max_model_len: int | None = _setting(
        None, "context cap below the model's own (default: the model's)", type=int
    )
    max_num_seqs: int = _setting(64, "requests run at once (default %(default)s)", type=int)
    max_num_batched_tokens: int = _setting(
        4096, "tokens computed per engine step (default %(default)s)", type=int
    )
    hash_algo: str = _setting("xxh3_128", "block hash (default %(default)s)", choices=HASH_ALGOS)
    enable_prefix_caching: bool = _setting(
        True, "recompute every prompt: no prefix cache", flag="--no-prefix-caching"
    )
    schedule_policy: SchedulePolicy = _setting(
        "fcfs",
        "fcfs, or longest-prefix: admit the waiting request with the longest cached prefix first",
        choices=SCHEDULE_POLICIES,
    )
    backend: Backend = _setting(
        "auto", "kernels: auto (Triton on CUDA), triton or torch", choices=BACKENDS
    )
    prepack_linear: bool = _setting(
        True,
        "use BLAS linears: no weights packed once for oneDNN (CPU, float32 only)",
        flag="--no-prepack-linear",
    )
    compile: bool = _setting(
        False,
        "compile the model forward with torch.compile (TorchInductor) when the engine starts",
        flag="--compile",
    )
    host_cache_bytes: int = _setting(
        0, "KV tier in host memory for blocks evicted from the pool (default 0: off)", type=int
    )
    kv_store_dir: str | Path | None = _setting(
        None, "KV tier on disk: a directory that keeps cached prefixes across restarts"
    )
    kv_store_bytes: int = _setting(
        DEFAULT_KV_STORE_BYTES,
        f"bytes the disk tier may hold (default {DEFAULT_KV_STORE_BYTES >> 30} GiB)",
        type=int,
    )
    kv_store_salted: bool = _setting(
        True,
        "keep salted (per-tenant) requests' blocks in host memory only, never on disk",
        flag="--no-kv-store-salted",
    )
    kv_tier_write_policy: str = _setting(
        "write-back",
        "write-back (default: blocks host memory evicts, and what it holds at shutdown, go to "
        "disk) or write-through (blocks seen twice go to disk at once)",
        choices=KV_TIER_WRITE_POLICIES,
    )
    kv_load_timeout_s: float = _setting(
        DEFAULT_KV_LOAD_TIMEOUT_S,
        "longest a request waits for its KV tier loads before computing instead "
        f"(default {DEFAULT_KV_LOAD_TIMEOUT_S:g}; /health shows a stalled loader)",
        type=float,
    )

    @property
    def tiers_enabled(self) -> bool:
        """Whether any KV tier below the pool is configured (and prefix caching is on)."""
        return self.enable_prefix_caching and (
            self.host_cache_bytes > 0 or self.kv_store_dir is not None
        )

    def __post_init__(self) -> None:
        self.dtype = _dtype_name(self.dtype)
        self.validate()

    def validate(self) -> None:
        """Raise :class:`~ragkv.errors.ConfigError` (with ``param``) for an impossible setting."""
        _check(
            self.block_size >= 8 and self.block_size % 8 == 0,
            "block_size",
            f"block_size must be a positive multiple of 8, got {self.block_size}",
        )
        if self.kv_cache_tokens is not None:
            _check(
                self.kv_cache_tokens >= self.block_size,
                "kv_cache_tokens",
                f"kv_cache_tokens must be at least block_size ({self.block_size})",
            )
        if self.kv_cache_bytes is not None:
            _check(self.kv_cache_bytes > 0, "kv_cache_bytes", "kv_cache_bytes must be positive")
        if self.max_model_len is not None:
            _check(
                self.max_model_len >= 2,
                "max_model_len",
                f"max_model_len must be at least 2, got {self.max_model_len}",
            )
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            _check(getattr(self, name) >= 1, name, f"{name} must be positive")
        _one_of(self, "dtype", DTYPES)
        _one_of(self, "hash_algo", HASH_ALGOS)
        _one_of(self, "schedule_policy", SCHEDULE_POLICIES)
        _one_of(self, "backend", BACKENDS)
        self._validate_tiers()
        device = self.device.split(":")[0]
        _check(
            device in ("auto", "cpu", "cuda"),
            "device",
            f"unknown device {self.device!r}; use 'auto', 'cpu' or 'cuda[:N]'",
        )

    def _validate_tiers(self) -> None:
        _check(
            isinstance(self.host_cache_bytes, int) and self.host_cache_bytes >= 0,
            "host_cache_bytes",
            f"host_cache_bytes must be an int >= 0 (0 = off), got {self.host_cache_bytes!r}",
        )
        _check(
            isinstance(self.kv_store_bytes, int) and 0 < self.kv_store_bytes <= MAX_KV_STORE_BYTES,
            "kv_store_bytes",
            f"kv_store_bytes must be an int between 1 and {MAX_KV_STORE_BYTES}, "
            f"got {self.kv_store_bytes!r}",
        )
        if self.kv_store_dir is not None:
            _check(
                isinstance(self.kv_store_dir, str | Path) and str(self.kv_store_dir) != "",
                "kv_store_dir",
                f"kv_store_dir must be a directory path, got {self.kv_store_dir!r}",
            )
            path = Path(self.kv_store_dir).expanduser()
            _check(
                not path.exists() or path.is_dir(),
                "kv_store_dir",
                f"kv_store_dir {str(path)!r} exists and is not a directory",
            )
        _check(
            isinstance(self.kv_store_salted, bool),
            "kv_store_salted",
            "kv_store_salted must be True or False",
        )
        _one_of(self, "kv_tier_write_policy", KV_TIER_WRITE_POLICIES)
        timeout = self.kv_load_timeout_s
        _check(
            isinstance(timeout, int | float) and not isinstance(timeout, bool) and timeout > 0,
            "kv_load_timeout_s",
            f"kv_load_timeout_s must be a positive number of seconds, got {timeout!r}",
        )

    def replace(self, **changes: Any) -> EngineConfig:
        """A copy with some settings changed (validated again)."""
        return dataclasses.replace(self, **changes)


def resolve_device(device: str) -> torch.device:
    """ "auto" → CUDA when available, else CPU; an explicit CUDA device must exist."""
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "device='cuda' requested but CUDA is not available; use device='cpu'", param="device"
        )
    return resolved


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The one dtype rule: "auto" is bf16 on CUDA (fp16 where bf16 is unsupported), fp32 on CPU.

    CPU stays fp32 even where it runs bf16 natively (AMX): the engine's default output is
    exact against a plain Hugging Face forward (Invariant 1), and bf16 GEMMs round
    differently for different batch shapes. Ask for "bfloat16" to trade that for speed.
    """
    import torch

    name = _dtype_name(dtype)
    if name == "auto":
        if device.type == "cpu":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return getattr(torch, name)


def default_kv_bytes(device: torch.device) -> int:
    """Pool size when none is given: 1 GiB on CPU, a share of the free memory on CUDA."""
    if device.type == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info(device)
        return int(free * CUDA_KV_SHARE)
    return DEFAULT_CPU_KV_BYTES


def _one_of(config: EngineConfig, name: str, allowed: tuple[str, ...]) -> None:
    value = getattr(config, name)
    _check(
        value in allowed, name, f"unknown {name} {value!r}; use {' or '.join(map(repr, allowed))}"
    )


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise ConfigError(message, param=param)


# The defaults every entry point reads (CLI flags, the bench, the scheduler's own).
DEFAULTS = EngineConfig()
