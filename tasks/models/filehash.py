"""Files' SHA-256 digests (a model file's identity: the embedded endpoint's ``model_sha256``, its
converted folder's name), kept per file so that a command does not hash the same file again."""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path


def sha256_file(path: Path, chunk_bytes: int = 1 << 20) -> str:
    """The SHA-256 of a file's bytes, hex (FIPS 180-4), read in blocks of ``chunk_bytes``."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def cached_sha256(path: Path, memo_dir: Path) -> str:
    """:func:`sha256_file` of ``path``, kept in ``memo_dir`` (a file per path and stat) for as
    long as the file's device, inode, size and modification time in nanoseconds stay the same
    (git's index trusts the same stat fields): hashing the 135 MB default GGUF cost every
    command 0.27 s.

    Raises:
        OSError: ``path`` cannot be read.
    """
    st = path.stat()
    key = hashlib.sha256(
        f"{path.resolve()}\0{st.st_dev}\0{st.st_ino}\0{st.st_size}\0{st.st_mtime_ns}".encode()
    )
    memo = memo_dir / key.hexdigest()[:32]
    with contextlib.suppress(OSError):
        digest = memo.read_text().strip()
        if len(digest) == 64:
            return digest
    digest = sha256_file(path)
    with contextlib.suppress(OSError):  # a read-only cache only costs the next command the hash
        memo.parent.mkdir(parents=True, exist_ok=True)
        staging = memo.with_name(f"{memo.name}.{os.getpid()}")
        staging.write_text(digest)
        os.replace(staging, memo)
    return digest
