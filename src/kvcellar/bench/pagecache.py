"""Dropping the page cache, so a "disk hit" reads the disk and not RAM.

``drop_page_cache`` first tries the whole-machine way (``sync; echo 3 >
/proc/sys/vm/drop_caches``, needs root); where that is refused it drops the cached pages of
every file under the given folders with ``posix_fadvise(POSIX_FADV_DONTNEED)``. It returns
which one worked, and benchmarks report it next to their disk figures.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

DROP_CACHES = "/proc/sys/vm/drop_caches"


def drop_page_cache(paths: Iterable[str | os.PathLike[str]] = ()) -> str:
    """``"drop_caches"``, ``"fadvise_dontneed"`` (with the file count) or ``"none"``."""
    os.sync()
    try:
        with open(DROP_CACHES, "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        pass
    if not hasattr(os, "posix_fadvise"):
        return "none"
    files = 0
    for root in paths:
        for dirpath, _dirs, names in os.walk(Path(root), followlinks=False):
            for name in names:
                try:
                    fd = os.open(os.path.join(dirpath, name), os.O_RDONLY | os.O_CLOEXEC)
                except OSError:
                    continue
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    files += 1
                except OSError:
                    pass
                finally:
                    os.close(fd)
    return f"fadvise_dontneed ({files} files)"


def method_name(result: str) -> str:
    """The method without its details: ``drop_caches``, ``fadvise_dontneed`` or ``none``."""
    return result.split(" ", 1)[0]
