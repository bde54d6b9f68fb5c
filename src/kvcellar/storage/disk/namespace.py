"""One namespace directory as an open DiskTier holds it, and what the tier's parts share.

``OpenNamespace`` owns: opening the directory (private dirs, this process's session,
``namespace.json``), the block geometry (``file_size``), the ``ssd_`` counters, the block
table, the capacity guard, the fault trackers of both directions, the suspect keys, and
the file operations every part needs: temp names of this session, shard directories,
deleting a block, deleting a corrupt one. The facade (tier.py), write admission
(admission.py) and the upkeep thread (upkeep.py) each hold the same instance.

Who may call what: every method is thread-safe. ``open`` runs from the constructor and,
while the namespace could not be opened, from the upkeep thread's probe only; ``session``
goes from None to a session once and stays.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvcellar.storage.base import BlockSpec
from kvcellar.storage.block_format import FORMAT_VERSION, BlockSeal, CacheSecret, header_size_for
from kvcellar.storage.disk.capacity import CapacityGuard
from kvcellar.storage.disk.config import DiskConfig
from kvcellar.storage.disk.keys import KeyRecord
from kvcellar.storage.disk.layout import NamespaceLayout
from kvcellar.storage.disk.sessions import Session, StaleSession, open_session, scan_sessions, unclean_summary
from kvcellar.storage.disk.stats import DiskStats
from kvcellar.storage.disk.table import BlockTable
from kvcellar.storage.disk.writer import fsync_dir, write_block_file
from kvcellar.storage.faults import FaultTracker

_log = logging.getLogger("kvcellar.storage.disk")

def mkdir_private(path: Path) -> bool:
    """Create ``path`` and missing parents with mode 0700. True if created."""
    if path.is_dir():
        return False
    mkdir_private(path.parent)
    try:
        os.mkdir(path, 0o700)
        return True
    except FileExistsError:
        return False


class OpenNamespace:
    """``<root>/<namespace>-v<FORMAT_VERSION>/`` opened by this process. The constructor
    does no I/O; call ``open``."""

    def __init__(self, root: Path, namespace: str, spec: BlockSpec, config: DiskConfig,
                 descriptor: dict[str, Any] | None, secret: bytes | CacheSecret | None = None) -> None:
        self.spec = spec
        # Blocks are sealed when written and unsealed ones are corrupt when read (block_format).
        self.seal = BlockSeal(secret, namespace) if secret is not None else None
        self.config = config
        self.layout = NamespaceLayout(root, namespace)  # validates the namespace
        self._descriptor = descriptor
        self.header_size = header_size_for(spec.block_size)
        self.file_size = self.header_size + spec.nbytes
        self.counters = DiskStats()
        self.table = BlockTable()
        where = str(self.layout.dir)
        self.wfault = FaultTracker("write", self.counters, _log, where,
                                   config.fault_backoff_initial_s, config.fault_backoff_max_s)
        self.rfault = FaultTracker("read", self.counters, _log, where)
        self.capacity = CapacityGuard(self.table, root, config.capacity_bytes, config.min_free_bytes,
                                      config.ttl_s, self._unlink_dropped, self.counters)
        # Called with each key the capacity rules deleted (``DiskTier.drops_with_its_blocks``).
        self.on_dropped: Callable[[bytes], object] | None = None
        self.suspects = KeyRecord(1 << 14)  # files to check when stored again (keys.py)
        # _misc_lock protects _leftovers and _known_dirs.
        self._misc_lock = threading.Lock()
        self._leftovers: set[Path] = set()
        self._known_dirs: set[Path] = set()
        self._seq = itertools.count()
        self.opened_ns = time.time_ns()
        self.session: Session | None = None
        self.stale: list[StaleSession] = []
        self.last_shutdown_clean = True
        self.last_shutdown_reason: str | None = None

    # ------------------------------------------------------------------ opening
    def open(self, *, probe: bool = False) -> bool:
        """Directories, session, descriptor. On an OS error the tier stays
        degraded and the upkeep thread retries as its probe."""
        try:
            mkdir_private(self.layout.blocks_dir)
            mkdir_private(self.layout.sessions_dir)
            scan = scan_sessions(self.layout.sessions_dir, remove_stale=True)
            self.session = open_session(self.layout.sessions_dir)
            self.stale = scan.stale
            self.last_shutdown_clean = not scan.stale
            self.last_shutdown_reason = unclean_summary(scan.stale)
            if scan.stale:
                self.counters.recovered_unclean_sessions.add(len(scan.stale))
                _log.warning("disk tier %s: %d previous session(s) ended without a clean shutdown (%s)",
                             self.layout.dir, len(scan.stale), self.last_shutdown_reason)
            self.write_descriptor()
            return True
        except OSError as e:
            self.wfault.failure(e, "opening the namespace directory", probe=probe)
            return False

    def write_descriptor(self) -> None:
        doc = {
            "namespace": self.layout.namespace,
            "format_version": FORMAT_VERSION,
            "spec": {
                "dtype": str(self.spec.dtype).removeprefix("torch."),
                "shape": list(self.spec.shape),
                "block_size": self.spec.block_size,
                "kv_bits": self.spec.kv_bits,
                "kv_group_size": self.spec.kv_group_size,
                "block_nbytes": self.spec.nbytes,
                "file_nbytes": self.file_size,
            },
            "descriptor": self._descriptor,
        }
        path = self.layout.descriptor_path
        try:
            old = json.loads(path.read_text())
            if {k: old.get(k) for k in doc} == doc:
                return
            doc["created"] = old.get("created")
        except (OSError, ValueError):
            pass
        doc["created"] = doc.get("created") or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        data = json.dumps(doc, indent=2, sort_keys=True, default=str).encode() + b"\n"
        write_block_file(path, self.tmp_path(path), [data], fsync=False, on_leftover=self.add_leftover)

    # ------------------------------------------------------------------ shared file operations
    def tmp_path(self, final: Path) -> Path:
        """A fresh temp name beside ``final``, owned by this session (recovery.py
        removes it only once the session is dead)."""
        assert self.session is not None
        return NamespaceLayout.tmp_path(final, self.session.token, next(self._seq))

    def ensure_dir(self, d: Path, *, fsync_parent: bool) -> None:
        with self._misc_lock:
            if d in self._known_dirs:
                return
        if mkdir_private(d) and fsync_parent:
            fsync_dir(d.parent)
        with self._misc_lock:
            self._known_dirs.add(d)

    def forget_dir(self, d: Path) -> None:
        """``d`` vanished (cache clear): the next write creates it again."""
        with self._misc_lock:
            self._known_dirs.discard(d)

    def add_leftover(self, path: Path) -> None:
        """A temp file a failed write could not remove; ``remove_leftovers`` retries."""
        with self._misc_lock:
            self._leftovers.add(path)

    def remove_leftovers(self) -> None:
        with self._misc_lock:
            leftovers, self._leftovers = self._leftovers, set()
        for p in leftovers:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
            except OSError:
                self.add_leftover(p)

    def forget_missing(self, key: bytes) -> None:
        """A known block's file was found gone (``cache clear``, another process's eviction):
        drop the stale entry now rather than at the next rescan, and count it."""
        if self.table.discard_if_known(key):
            self.counters.stale_dropped.add()

    def unlink_block(self, key: bytes) -> bool:
        """Delete a block's file (eviction, TTL, remove). A failure (EROFS, EIO, EACCES)
        is a fault of the write direction like a failed write: without room, writes
        cannot succeed either (a full disk remounted read-only must not say "ok")."""
        path = self.layout.block_path(key)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            self.wfault.failure(e, f"deleting {path.name}", counter="delete")
            return False
        return True

    def _unlink_dropped(self, key: bytes) -> bool:
        """``unlink_block`` for eviction and TTL, telling ``on_dropped``."""
        done = self.unlink_block(key)
        if done and self.on_dropped is not None:
            self.on_dropped(key)
        return done

    def corrupt(self, path: Path, key: bytes, reason: str, ino: int, dev: int) -> None:
        """Count, forget and delete a block that failed a check. Its chain's later
        blocks become suspects (see keys.py) where the caller knows them."""
        c = self.counters
        total = c.failed(reason)
        self.table.discard(key)
        self.suspects.add([key])  # marks the load batch's failure as a corruption (DiskTier._batch_done)
        try:
            st = os.stat(path)
            # A writer may have renamed a good copy over it since we opened it.
            if (st.st_ino, st.st_dev) == (ino, dev):
                os.unlink(path)
                c.corrupt_deleted.add()
        except FileNotFoundError:
            pass
        except OSError as e:
            self.wfault.failure(e, f"deleting corrupt {path.name}", counter="delete")
        if total & (total - 1) == 0:  # 1, 2, 4, 8, ...: bounded logging
            _log.warning("disk tier %s: deleted a block that failed its %s check (%d so far)",
                         self.layout.dir, reason, total)
