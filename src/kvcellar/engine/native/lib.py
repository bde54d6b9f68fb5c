"""The kernels' shared library: built from the C files beside this module on first use, loaded
with ctypes, and called by name.

The C files are compiled once per source, compiler and flags with the system C compiler (one
process at a time: the others wait on a lock file and load its result) into
``native/`` under the default cache directory (``paths.resolve_cache_dir``: one build per
user, whatever ``--cache-dir`` a server is given). A build records its file's SHA-256 beside
it, and a library that does not match its record (changed, half written, planted) is built
again before it is loaded; a folder that another user owns or others may write to is refused
(loading code from it would run whatever they put there). The library runs on the OpenMP runtime torch
has loaded already, so its threads are torch's; ctypes drops the GIL around each call. Each
exported function is bound from its prototype in ``kvc.h`` (argument names and types read
from there, so the header is the one statement of them) and called with keyword arguments
(``call``), a missing or unknown one an error before anything runs. Where the library cannot
be built (another CPU, no compiler, ``KVCELLAR_NATIVE_KERNELS=0``) ``library()`` is None and
torch's kernels run instead.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcellar.paths import resolve_cache_dir

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
HEADER = HERE / "kvc.h"
SOURCES = tuple(HERE / f"{name}.c" for name in ("quantize", "int4", "amx", "int8", "linear", "norm", "layer", "mxfp4",
                                                "moe", "kv", "crc32", "recurrent", "router", "pool", "logits"))
CPU_FLAGS = frozenset({"avx2", "fma", "f16c"})
COMPILE_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC")
ENV_SWITCH = "KVCELLAR_NATIVE_KERNELS"
# "0": the kernels' AVX2 forms on a CPU with AVX-512 (kvc.h's avx512_cpu), which give the same bits.
AVX512_SWITCH = "KVCELLAR_AVX512"

_CTYPES = {"int64_t": ctypes.c_int64, "int": ctypes.c_int, "float": ctypes.c_float, "uint32_t": ctypes.c_uint32}
_PROTOTYPE = re.compile(r"^(void|int|uint32_t) (kvc_\w+)\(([^)]*)\);", re.MULTILINE)


@dataclass(frozen=True)
class Signature:
    """An exported function as ``kvc.h`` declares it: its arguments' names and ctypes types
    (every pointer a ``c_void_p``), and its result's type (None: void)."""

    name: str
    params: tuple[tuple[str, type], ...]
    result: type | None


@functools.cache
def signatures() -> dict[str, Signature]:
    """The exported functions, read from ``kvc.h``."""
    found = {}
    for result, name, params in _PROTOTYPE.findall(HEADER.read_text()):
        args = []
        for param in [] if params.strip() == "void" else " ".join(params.split()).split(", "):
            pointer = "*" in param
            ctype_name, _, arg = param.replace("const ", "").replace("*", " ").rpartition(" ")
            args.append((arg.strip(), ctypes.c_void_p if pointer else _CTYPES[ctype_name.strip()]))
        found[name] = Signature(name, tuple(args), None if result == "void" else _CTYPES[result])
    return found


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@functools.cache
def library() -> ctypes.CDLL | None:
    """The kernels, built and loaded once per process; None where they cannot run here."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    if platform.machine().lower() not in ("x86_64", "amd64") or not cpu_flags() >= CPU_FLAGS:
        return None
    cc = _compiler()
    if cc is None:
        log.info("no C compiler found: torch's quantized kernels run instead of kvcellar's")
        return None
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True, timeout=30).stdout
        texts = [path.read_text() for path in (HEADER, *SOURCES)]
        digest = hashlib.sha256("\0".join([*texts, cc, version, *COMPILE_FLAGS]).encode()).hexdigest()
        folder = resolve_cache_dir() / "native"
        target = folder / f"kvc-{digest[:16]}.so"
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        _check_private(folder)
        if not _recorded(target):
            with open(folder / f"kvc-{digest[:16]}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # processes starting together compile once
                if not _recorded(target):
                    if target.exists():
                        log.warning("%s does not match its recorded SHA-256: building it again", target)
                    _compile(cc, folder, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("kvcellar's CPU kernels could not be built (%s); torch's run instead", detail)
        return None
    for signature in signatures().values():
        fn = getattr(lib, signature.name)
        fn.argtypes = [ctype for _, ctype in signature.params]
        fn.restype = signature.result
    _bound.clear()
    return lib


def _check_private(folder: Path) -> None:
    """Raise PermissionError unless ``folder`` is this user's and only this user may write to it."""
    st = folder.stat()
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise PermissionError(f"{folder} is owned by uid {st.st_uid} with mode {st.st_mode & 0o777:o}: only its "
                              "owner may write where the kernels are loaded from (chmod 700 it)")


def _record_of(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


def _recorded(target: Path) -> bool:
    """Whether ``target`` is the library a build here recorded (its SHA-256 in the record beside it)."""
    try:
        return _record_of(target).read_text().strip() == hashlib.sha256(target.read_bytes()).hexdigest()
    except OSError:
        return False


def _compile(cc: str, folder: Path, target: Path) -> None:
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".so.tmp")
    os.close(fd)
    try:
        subprocess.run([cc, *COMPILE_FLAGS, f"-I{HERE}", "-o", tmp, *map(str, SOURCES)], capture_output=True,
                       text=True, check=True, timeout=300)
        digest = hashlib.sha256(Path(tmp).read_bytes()).hexdigest()
        os.replace(tmp, target)  # atomic: a process that does not take the lock loads a whole file
        Path(tmp).write_text(digest + "\n")
        os.replace(tmp, _record_of(target))  # after the library: a build cut between them is built again
    finally:
        Path(tmp).unlink(missing_ok=True)


# Per exported function, a Python function with its arguments as keyword-only parameters, made
# once a library is loaded: Python itself refuses a missing or unknown argument, at no cost.
_bound: dict[str, Callable[..., Any]] = {}


def _keywords(name: str, lib: ctypes.CDLL) -> Callable[..., Any]:
    params = [arg for arg, _ in signatures()[name].params]
    namespace: dict[str, Any] = {"fn": getattr(lib, name)}
    keywords = f"*, {', '.join(params)}" if params else ""
    exec(f"def {name}({keywords}):\n    return fn({', '.join(params)})\n", namespace)
    made: Callable[..., Any] = namespace[name]
    return made


def available() -> bool:
    return library() is not None


def call(name: str, **args: object) -> int | None:
    """Exported function ``name`` with its arguments by their names in ``kvc.h``."""
    fn = _bound.get(name)
    if fn is None:
        lib = library()
        if lib is None:
            raise RuntimeError("kvcellar's CPU kernels are not available here")
        fn = _bound[name] = _keywords(name, lib)
    result: int | None = fn(**args)
    return result
