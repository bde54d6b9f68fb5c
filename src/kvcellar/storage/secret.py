"""Where the deployment secret comes from: ``--cache-secret-file`` (or the config file's
``cache_secret_file``), else ``KVCELLAR_CACHE_SECRET_FILE``, else ``KVCELLAR_CACHE_SECRET`` (the
secret itself); and, during a rotation, ``--cache-previous-secrets-file`` /
``KVCELLAR_CACHE_PREVIOUS_SECRETS_FILE``: the secrets before it, one a line, whose seals are
still accepted on reads. The server (``kvcellar.settings``) and the offline ``kvcellar cache``
commands read them the same way.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from kvcellar.storage.block_format import MIN_SECRET_BYTES, CacheSecret

log = logging.getLogger(__name__)


def resolve_cache_secret(secret_file: str | os.PathLike[str] | None = None,
                         previous_file: str | os.PathLike[str] | None = None,
                         file_secret: str | None = None, file_previous: str | None = None,
                         ) -> tuple[Path | None, CacheSecret | None]:
    """The secret file's path (None where the secret came from the environment or is unset)
    and the secret. Flags first, then the environment, then the config file's values
    (``file_secret``, ``file_previous``). ``ValueError`` with what is wrong."""
    path: Path | None = None
    current: bytes | None = None
    named = secret_file or os.environ.get("KVCELLAR_CACHE_SECRET_FILE")
    if not named and "KVCELLAR_CACHE_SECRET" in os.environ:
        current = checked_secret(os.environ["KVCELLAR_CACHE_SECRET"].encode(), "KVCELLAR_CACHE_SECRET")
    elif named or file_secret:
        path = Path(named or file_secret or "").expanduser()
        current = read_cache_secret(path)
    previous_path = previous_file or os.environ.get("KVCELLAR_CACHE_PREVIOUS_SECRETS_FILE") or file_previous
    previous = read_previous_secrets(Path(previous_path).expanduser()) if previous_path else ()
    if previous and current is None:
        raise ValueError("previous cache secrets are given but no current one (--cache-secret-file): a rotation "
                         "seals with the new secret and reads with both")
    return path, CacheSecret(current, previous) if current is not None else None


def read_cache_secret(path: Path) -> bytes:
    """The secret in the file at ``path``, whitespace around it stripped. A file others can
    read is used, with a warning: secrets mounted into containers often are."""
    raw = _read(path, "cache secret file")
    return checked_secret(raw, f"cache secret file {path}")


def read_previous_secrets(path: Path) -> tuple[bytes, ...]:
    """The secrets in the file at ``path``, one a line (blank lines skipped)."""
    raw = _read(path, "previous cache secrets file")
    return tuple(checked_secret(line, f"previous cache secrets file {path}, line {i}")
                 for i, line in enumerate(raw.splitlines(), 1) if line.strip())


def checked_secret(raw: bytes, where: str) -> bytes:
    secret = raw.strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"{where}: a cache secret must be at least {MIN_SECRET_BYTES} bytes "
                         f"(got {len(secret)}); e.g. `head -c 32 /dev/urandom | base64 > FILE`")
    return secret


def _read(path: Path, what: str) -> bytes:
    try:
        raw = path.read_bytes()
        mode = path.stat().st_mode
    except OSError as exc:
        raise ValueError(f"{what} {path}: {exc.strerror or exc}") from exc
    if mode & 0o077:
        log.warning("%s %s can be read by other users (mode %o); chmod 600 it", what, path, mode & 0o777)
    return raw
