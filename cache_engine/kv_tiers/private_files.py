"""The disk tier's trust boundary on the file system (Invariant 11, docs/invariants.md).

A store directory holds every tenant's prompts and outputs as token ids, so only the
server's own user may read or write it:

- the root is created ``0700`` and refused (``ConfigError``) when it is a symbolic link,
  not a directory, owned by another user, or writable by group or others;
- every directory below it is ``0700`` and every file ``0600``, whatever the umask;
- nothing is followed: files are opened with ``O_NOFOLLOW`` (a link planted in the store is
  refused, never written through), temporary files with ``O_CREAT | O_EXCL``, and a read
  takes only a regular file, opened non-blocking (a FIFO in the store cannot hang a load);
- the store's secret, the key of every entry's MAC, is ``<root>/secret``: 32 random bytes
  created on first use, or refused if anyone but the owner could read or change it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from pathlib import Path

from ragkv.errors import ConfigError

SECRET_NAME = "secret"
SECRET_LEN = 32
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


def private_root(root: Path) -> None:
    """Create ``root`` (``0700``) or check that an existing one is this user's alone."""
    root.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(root, 0o700)
    info = os.lstat(root)
    where = f"kv_store_dir {str(root)!r}"
    if stat.S_ISLNK(info.st_mode):
        raise ConfigError(
            f"{where} is a symbolic link; pass the real directory", param="kv_store_dir"
        )
    if not stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"{where} is not a directory", param="kv_store_dir")
    if info.st_uid != os.geteuid():
        raise ConfigError(
            f"{where} belongs to uid {info.st_uid}, not to this process (uid {os.geteuid()}): "
            "a KV store holds every tenant's prompts; use a directory of the server's own",
            param="kv_store_dir",
        )
    if info.st_mode & 0o022:
        raise ConfigError(
            f"{where} is writable by group or others (mode {oct(info.st_mode & 0o777)}); "
            "another user could plant or remove entries: chmod 700 it",
            param="kv_store_dir",
        )


def private_dir(path: Path) -> None:
    """Create ``path`` as a ``0700`` directory, or make an existing one (ours) ``0700``;
    a link or another user's directory is refused."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise OSError(f"{path} is not a directory of this store (a link or a file)")
    if info.st_uid != os.geteuid():
        raise OSError(f"{path} belongs to another user")
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(path, 0o700)


def create_private(path: Path) -> int:
    """A new file at ``path`` (``0600``, never an existing one, never through a link)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
    os.fchmod(fd, 0o600)
    return fd


def open_private(path: Path) -> int:
    """An existing regular file of the store for reading; ``OSError`` for anything else
    (a link, a FIFO, a device), without blocking on it."""
    fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise IsADirectoryError(f"{path} is not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def store_secret(root: Path) -> bytes:
    """The store's MAC key: read from ``<root>/secret``, or created there on first use."""
    path = root / SECRET_NAME
    try:
        fd = create_private(path)
    except FileExistsError:
        pass
    else:
        key = secrets.token_bytes(SECRET_LEN)
        with os.fdopen(fd, "wb") as file:
            file.write(key)
        return key
    where = f"the KV store's secret {str(path)!r}"
    try:
        fd = open_private(path)
    except OSError as exc:
        raise ConfigError(f"{where} cannot be read: {exc}", param="kv_store_dir") from exc
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(file.fileno())
        if info.st_uid != os.geteuid() or info.st_mode & 0o077:
            raise ConfigError(
                f"{where} must be this user's and mode 600 (is uid {info.st_uid}, mode "
                f"{oct(stat.S_IMODE(info.st_mode))})",
                param="kv_store_dir",
            )
        key = file.read(SECRET_LEN + 1)
    if len(key) != SECRET_LEN:
        raise ConfigError(f"{where} is not {SECRET_LEN} bytes", param="kv_store_dir")
    return key
