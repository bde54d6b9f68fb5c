"""Separate processes for the artifact-cache tests.

    python -m tests.artifacts.child load GGUF CACHE_DIR
        import everything, print "ready", wait for a line on stdin, then load GGUF through
        the artifact cache under CACHE_DIR (progress bars on), decode greedily, print one
        JSON line (hit/built, identities, tokens, timings) and exit.
    python -m tests.artifacts.child hold MODELS_ROOT KEY
        acquire the existing entry KEY the way a server does (shared use lock), print
        "held", keep it until stdin closes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def load(gguf: str, cache_dir: str) -> None:
    import kvcellar  # noqa: F401
    from kvcellar.artifacts import ArtifactCache
    from kvcellar.runtime import prepare_and_load
    from tests.artifacts.helpers import greedy

    print("ready", flush=True)
    sys.stdin.readline()
    loaded = prepare_and_load(gguf, artifacts=ArtifactCache.open(cache_dir), progress=True, weights="full")
    lease = loaded.artifact
    print(json.dumps({
        "hit": lease.hit, "built": lease.built, "seconds": lease.seconds, "key": lease.key,
        "weights_id": loaded.weights_id, "tokenizer_id": loaded.tokenizer_id, "tokens": greedy(loaded),
    }), flush=True)


def hold(models_root: str, key: str) -> None:
    from kvcellar.artifacts import ArtifactCache, ArtifactDescriptor

    cache = ArtifactCache(Path(models_root))
    row = cache.index.get(key)
    assert row is not None, f"no entry {key}"

    def must_not_build(out_dir: Path) -> None:
        raise AssertionError("the held entry should exist")

    lease = cache.acquire(ArtifactDescriptor.from_dict(row.descriptor), must_not_build)
    print("held", flush=True)
    sys.stdin.read()
    lease.release()


if __name__ == "__main__":
    {"load": load, "hold": hold}[sys.argv[1]](*sys.argv[2:])
