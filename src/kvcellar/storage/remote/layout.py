"""Where blocks live in the store: ``kvc:<namespace>:<block key hex>``.

``namespace`` is the engine's fingerprint (weights, tokenizer and template, dtypes, block
size) plus the block format version, the same string that names the disk tier's
directory: a replica of another model, dtype or block size uses other keys and can never
read these. A value under one of our keys that is not exactly the block asked for (planted,
truncated, of an older format) fails the block format's checks and is a counted miss.
"""

from __future__ import annotations

import re

from kvcellar.storage.block_format import FORMAT_VERSION

KEY_PREFIX = "kvc"
_NAMESPACE_OK = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


class RemoteLayout:
    def __init__(self, fingerprint: str) -> None:
        if not _NAMESPACE_OK.match(fingerprint):
            raise ValueError(f"namespace fingerprint must match {_NAMESPACE_OK.pattern}, got {fingerprint!r}")
        self.namespace = f"{fingerprint}-v{FORMAT_VERSION}"
        self._prefix = f"{KEY_PREFIX}:{self.namespace}:".encode()

    def key(self, block_key: bytes) -> bytes:
        return self._prefix + block_key.hex().encode()

    @property
    def pattern(self) -> bytes:
        """A SCAN/KEYS pattern matching every block of this namespace."""
        return self._prefix + b"*"
