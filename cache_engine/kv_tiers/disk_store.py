"""The disk KV tier: one verified file per block in a directory that survives restarts.

Layout of a store directory (``0700``, files ``0600``: see :mod:`.private_files`)::

    <kv_store_dir>/
      secret                        the key of every entry's MAC (32 random bytes)
      ns-<namespace digest>/        one per model setup (StoreNamespace)
        namespace.json              the namespace in clear, for people; never trusted
        lock                        held (shared, flock) by every store open on it
        blocks/<block hash hex>.kv  one entry (entry_file.py), renamed into place whole
        blocks/<hex>.<pid>.<n>.tmp  a write in progress (removed at open if its writer died
                                    or it is older than TMP_STALE_S)

There is no index file to lose or tear: the index is the directory listing, read at open
(LRU order from file modification times, refreshed on every hit). One file per block was
measured against segment files in docs/benchmarks.md ("KV tiers lanes"): a block of the default model is
~0.7 MB, so per-file overhead is small next to the read, and eviction is an ``unlink``.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import re
import shutil
import threading
import time
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path

import torch

from ragkv.cache_engine.kv_tiers.block_store import TierListener
from ragkv.cache_engine.kv_tiers.entry_file import (
    DamagedEntry,
    EntryHeader,
    entry_size,
    read_header,
    read_payload,
    storable,
    write_entry,
)
from ragkv.cache_engine.kv_tiers.namespace import StoreNamespace
from ragkv.cache_engine.kv_tiers.payload import check_payload
from ragkv.cache_engine.kv_tiers.private_files import (
    create_private,
    open_private,
    private_dir,
    private_root,
    store_secret,
)
from ragkv.cache_engine.kv_tiers.tier_stats import TierStats
from ragkv.errors import ConfigError, InvalidInputError

try:
    import fcntl

    _HAS_FLOCK = True
except ImportError:  # not POSIX: namespaces in use are not protected from trimming
    _HAS_FLOCK = False

logger = logging.getLogger(__name__)

ENTRY_SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"
NAMESPACE_PREFIX = "ns-"
LOCK_NAME = "lock"
# A temporary file this old is never a write in progress (a block takes milliseconds): its
# writer died, possibly under a PID now reused (containers restart as PID 1).
TMP_STALE_S = 600.0
# The only names this store creates (and so the only ones it ever removes).
_NAMESPACE_NAME = re.compile(r"ns-[0-9a-f]{32}")
_TMP_NAME = re.compile(r"[0-9a-f]+\.\d+\.\d+\.tmp")


class DiskStore:
    """Disk tier: blocks as files under ``directory``, LRU, bounded by ``capacity_bytes``.

    The bound covers this store's entries plus what other namespaces (other models or
    checkpoints) held when it opened; at open the least recently opened of those that no
    open store holds (each store keeps a shared ``flock`` on its namespace) are removed until
    they take at most half of it, so a new setup always has room. A write error (a full
    disk, a read-only directory) is counted and costs that block's disk copy, never a
    request; a read error other than damage is a miss that keeps the file. Several engines
    may open the same directory: files appear and disappear whole, and a file another engine
    removed is a plain miss; each bounds only its own writes, so engines sharing one
    namespace together may use up to their bounds' sum.
    """

    name = "disk"

    def __init__(
        self, directory: str | Path, capacity_bytes: int, namespace: StoreNamespace
    ) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
            raise ConfigError(
                f"capacity_bytes must be an int, got {type(capacity_bytes).__name__}",
                param="capacity_bytes",
            )
        if capacity_bytes <= 0:
            raise ConfigError(
                f"capacity_bytes must be > 0, got {capacity_bytes}", param="capacity_bytes"
            )
        if not isinstance(namespace, StoreNamespace):
            raise ConfigError("namespace must be a StoreNamespace", param="namespace")
        root = Path(directory).expanduser()
        self.root = root
        self.directory = root / f"{NAMESPACE_PREFIX}{namespace.digest()}"
        self.blocks = self.directory / "blocks"
        try:
            private_root(root)
            self._make_dirs()
            self._key = store_secret(root)
        except OSError as exc:
            raise ConfigError(
                f"kv_store_dir {str(root)!r} cannot be used: {exc}", param="kv_store_dir"
            ) from exc
        self._layout = _expected_layout(namespace)
        self.namespace = namespace
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._entries: OrderedDict[bytes, int] = OrderedDict()  # hash -> file size, LRU first
        self._reserved = 0  # bytes of writes in progress
        self._tmp_names = itertools.count()
        self._stats = TierStats(name=self.name, capacity_bytes=capacity_bytes)
        self._listener: TierListener | None = None
        self._lock_fd = _lock_namespace(self.directory, exclusive=False)
        self._write_namespace_file()
        self._budget = capacity_bytes - self._trim_other_namespaces()
        self._scan()

    # -- BlockStore --------------------------------------------------------------------------

    def contains(self, block_hash: bytes) -> bool:
        """Whether the index lists ``block_hash`` (unverified; no I/O)."""
        return block_hash in self._entries

    def get(self, block_hash: bytes, hash_input: bytes) -> torch.Tensor | None:
        """Read and verify the entry; ``None`` (counted) if absent, damaged or another block's."""
        start = time.perf_counter()
        with self._lock:
            if block_hash not in self._entries:
                self._stats.misses += 1
                return None
            self._entries.move_to_end(block_hash)
        path = self._path(block_hash)
        try:
            with os.fdopen(open_private(path), "rb") as file:
                header = read_header(file)
                if header.block_hash != block_hash or header.hash_input != hash_input:
                    raise DamagedEntry("the file holds another block's entry")
                self._check_layout(header)  # before allocating the payload
                payload = read_payload(file, header, self._key)
        except FileNotFoundError:  # removed by another engine sharing the directory
            self._forget(block_hash, corrupt=False)
            return None
        except (DamagedEntry, ValueError) as exc:
            logger.warning("KV disk tier: dropping %s (%s)", path.name, exc)
            self._forget(block_hash, corrupt=True)
            return None
        except OSError as exc:  # EMFILE, EACCES, EIO...: this read failed, not the entry
            logger.warning("KV disk tier: cannot read %s (%s)", path.name, exc)
            with self._lock:
                self._stats.misses += 1
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # LRU order survives a restart
        with self._lock:
            self._stats.hits += 1
            self._stats.loaded_bytes += payload.nbytes
            self._stats.load_seconds += time.perf_counter() - start
        return payload

    def put(self, block_hash: bytes, hash_input: bytes, payload: torch.Tensor) -> bool:
        """Write ``payload`` as a new entry (atomically), evicting LRU entries to make room."""
        check_payload(payload)
        reason = storable(block_hash, hash_input, payload)
        if reason is not None:
            raise InvalidInputError(f"cannot store this entry on disk: {reason}", param="payload")
        payload = payload.detach().to("cpu").contiguous()
        size = entry_size(block_hash, hash_input, payload)
        with self._lock:
            if block_hash in self._entries:
                self._entries.move_to_end(block_hash)
                return True
            victims = self._make_room(size)
            if victims is None:
                self._stats.write_errors += 1
                return False
            self._reserved += size
            if victims and self._listener is not None:
                self._listener.removed(victims)
        for victim in victims:
            self._unlink(self._path(victim))
        path = self._path(block_hash)
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.{next(self._tmp_names)}{TMP_SUFFIX}")
        try:
            try:
                written = self._write(tmp, path, block_hash, hash_input, payload)
            except FileNotFoundError:  # the tree was removed under this store: recreate it
                self._make_dirs()
                self._write_namespace_file()
                written = self._write(tmp, path, block_hash, hash_input, payload)
        except OSError as exc:
            logger.warning("KV disk tier: cannot write %s (%s)", path.name, exc)
            self._abandon(tmp, size, write_error=True)
            return False
        except BaseException:
            self._abandon(tmp, size, write_error=False)
            raise
        assert written == size
        with self._lock:
            self._reserved -= size
            self._entries[block_hash] = size
            self._stats.bytes_used += size
            self._stats.puts += 1
            self._stats.stored_bytes += payload.nbytes
            if self._listener is not None:
                self._listener.stored([(block_hash, hash_input)])
        return True

    def discard(self, block_hash: bytes) -> None:
        """Remove the entry stored under ``block_hash``, if any (its file too)."""
        self._forget(block_hash, corrupt=False, count=False)

    def set_listener(self, listener: TierListener | None) -> None:
        """Tell ``listener`` every change from now on; None stops. Entries stored before are
        not told: their hash inputs are in their files, read only to load a block."""
        with self._lock:
            self._listener = listener

    def stats(self) -> TierStats:
        """A snapshot of the counters and the contents now (this namespace's)."""
        with self._lock:
            return replace(self._stats, entries=len(self._entries))

    def close(self) -> None:
        """Release the namespace (entries are closed files already); idempotent."""
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)  # drops the flock

    # -- internals ---------------------------------------------------------------------------

    def _write(
        self, tmp: Path, path: Path, block_hash: bytes, hash_input: bytes, payload: torch.Tensor
    ) -> int:
        """Write the entry to ``tmp`` (new, ``0600``) and rename it to ``path``; its size."""
        with os.fdopen(create_private(tmp), "wb") as file:
            written = write_entry(file, block_hash, hash_input, payload, self._key)
        os.replace(tmp, path)
        return written

    def _make_dirs(self) -> None:
        private_dir(self.directory)
        private_dir(self.blocks)

    def _check_layout(self, header: EntryHeader) -> None:
        """An entry of another dtype or shape than this engine's blocks is refused unread."""
        if self._layout is not None and (header.dtype, header.shape) != self._layout:
            raise DamagedEntry(
                f"a {header.dtype} {header.shape} payload, not this engine's block layout"
            )

    def _abandon(self, tmp: Path, size: int, *, write_error: bool) -> None:
        """A write that did not happen: remove its temporary file, release its room."""
        self._unlink(tmp)
        with self._lock:
            self._reserved -= size
            self._stats.write_errors += write_error

    def _path(self, block_hash: bytes) -> Path:
        return self.blocks / f"{block_hash.hex()}{ENTRY_SUFFIX}"

    def _make_room(self, size: int) -> list[bytes] | None:
        """Under the lock: drop LRU entries until ``size`` more bytes fit; their hashes."""
        if self._reserved + size > self._budget:
            return None  # even an empty index would not make room: evict nothing
        victims: list[bytes] = []
        while self._stats.bytes_used + self._reserved + size > self._budget and self._entries:
            victim, victim_size = self._entries.popitem(last=False)
            self._stats.bytes_used -= victim_size
            self._stats.evictions += 1
            victims.append(victim)
        return victims

    def _forget(self, block_hash: bytes, *, corrupt: bool, count: bool = True) -> None:
        with self._lock:
            size = self._entries.pop(block_hash, None)
            if size is not None:
                self._stats.bytes_used -= size
                if self._listener is not None:
                    self._listener.removed([block_hash])
            if count:
                self._stats.misses += 1
                self._stats.corrupt += corrupt
        if size is not None:
            self._unlink(self._path(block_hash))

    @staticmethod
    def _unlink(path: Path) -> None:
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            logger.warning("KV disk tier: cannot remove %s (%s)", path, exc)

    def _scan(self) -> None:
        """Rebuild the index from the directory listing, oldest first; trim to the budget."""
        found: list[tuple[int, bytes, int]] = []
        for entry in os.scandir(self.blocks):
            name = entry.name
            try:
                if name.endswith(TMP_SUFFIX):
                    if not _TMP_NAME.fullmatch(name):
                        continue  # not a name this store makes: never removed
                    age = time.time() - entry.stat(follow_symlinks=False).st_mtime
                    if age > TMP_STALE_S or not _writer_alive(name):
                        os.unlink(entry.path)  # a write cut short (kill -9): never renamed
                    continue
                if not name.endswith(ENTRY_SUFFIX) or not entry.is_file(follow_symlinks=False):
                    continue
                block_hash = bytes.fromhex(name[: -len(ENTRY_SUFFIX)])
                info = entry.stat(follow_symlinks=False)
            except (OSError, ValueError):
                continue
            found.append((info.st_mtime_ns, block_hash, info.st_size))
        found.sort()
        for _, block_hash, size in found:
            self._entries[block_hash] = size
            self._stats.bytes_used += size
        victims = self._make_room(0) or []
        for victim in victims:
            self._unlink(self._path(victim))

    def _write_namespace_file(self) -> None:
        target = self.directory / "namespace.json"
        tmp = target.with_name(f"namespace.{os.getpid()}.{next(self._tmp_names)}{TMP_SUFFIX}")
        try:
            with os.fdopen(create_private(tmp), "w") as file:
                file.write(self.namespace.to_json())
            os.replace(tmp, target)  # also marks this namespace as the most recently opened
        except OSError as exc:
            logger.warning("KV disk tier: cannot write %s (%s)", target, exc)

    def _trim_other_namespaces(self) -> int:
        """Remove other namespaces, least recently opened first, until they use at most half
        of the capacity; the bytes they still use."""
        others: list[tuple[float, int, Path]] = []
        for path in self.root.iterdir():
            if path == self.directory or not _NAMESPACE_NAME.fullmatch(path.name):
                continue
            if path.is_symlink() or not path.is_dir():
                continue  # not a namespace this store made: never removed
            opened = _mtime(path / "namespace.json") or _mtime(path)
            others.append((opened, _tree_bytes(path), path))
        others.sort()
        used = sum(size for _, size, _ in others)
        for _, size, path in others:
            if used <= self.capacity_bytes // 2:
                break
            fd = _lock_namespace(path, exclusive=True)
            if fd is None and _HAS_FLOCK:
                continue  # an open store holds it: never pull a live engine's tier away
            shutil.rmtree(path, ignore_errors=True)
            if fd is not None:
                os.close(fd)
            used -= size
        return used


def _lock_namespace(directory: Path, *, exclusive: bool) -> int | None:
    """Lock a namespace's lock file; the open fd holding the lock, or None.

    Shared (``exclusive=False``): what every open store holds for its lifetime (waits out a
    trim in progress). Exclusive: taken without waiting, so it fails while any store holds
    the namespace. None also where ``flock`` does not exist or the file cannot be opened.
    """
    if not _HAS_FLOCK:
        return None
    path = directory / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
    except OSError as exc:
        logger.warning("KV disk tier: cannot open %s (%s)", path, exc)
        return None
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX | fcntl.LOCK_NB) if exclusive else fcntl.LOCK_SH)
    except OSError as exc:
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            logger.warning("KV disk tier: cannot lock %s (%s)", path, exc)
        return None
    return fd


def _writer_alive(tmp_name: str) -> bool:
    """Whether the process that named this temporary file still runs."""
    try:
        pid = int(tmp_name.split(".")[-3])
    except (IndexError, ValueError):
        return False
    if pid == os.getpid():
        return True  # another store of this process may be writing it
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _tree_bytes(path: Path) -> int:
    total = 0
    for file in path.rglob("*"):
        try:
            if file.is_file():
                total += file.stat().st_size
        except OSError:
            continue
    return total


def _expected_layout(namespace: StoreNamespace) -> tuple[torch.dtype, tuple[int, ...]] | None:
    """(dtype, shape) of this namespace's payloads when its layout names them
    (``"LKVBHD:28x2x16x3x64"``), else None (only the format's own bounds apply)."""
    kind, _, dims = namespace.layout.partition(":")
    dtype = getattr(torch, namespace.dtype.removeprefix("torch."), None)
    if kind != "LKVBHD" or not isinstance(dtype, torch.dtype):
        return None
    try:
        return dtype, tuple(int(d) for d in dims.split("x"))
    except ValueError:
        return None
