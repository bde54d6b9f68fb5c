"""The MLX engine backend (``--engine mlx``): mlx-lm's models computing a step's logits over
kvcellar's paged KV blocks, under the same scheduler, prefix cache and tiers as the torch engine.

``loader.py`` loads an mlx-lm model from the folder the torch engine would load (a GGUF's
prepared artifact-cache entry, or the model's own folder); ``paged.py`` is the per-layer cache
object mlx-lm's attention layers write a step's K/V into and read its context from, backed by
the engine's block pool; ``runner.py`` turns a step plan into mlx-lm forward calls. The block
pool stays the torch engine's (``cache/kv_pool.py``, host memory): blocks are the same bytes in
every tier, and the namespace fingerprint names the engine, so MLX and torch blocks never mix.

Only this package imports ``mlx``; it is an extra (``pip install 'kvcellar[mlx]'``).
"""

from __future__ import annotations

from typing import Any

from kvcellar.errors import ModelLoadError

ENGINES = ("torch", "mlx")
EXTRA_HINT = "pip install 'kvcellar[mlx]' (mlx-lm[cpu] on Linux, mlx-lm on macOS)"


def require_mlx() -> tuple[Any, Any]:
    """``mlx.core`` and ``mlx_lm``, or a ``ModelLoadError`` naming the extra that installs them."""
    try:
        import mlx.core as mx
        import mlx_lm
    except (ImportError, OSError) as exc:  # OSError: an mlx without its native library
        raise ModelLoadError(f"--engine mlx needs MLX and mlx-lm, which are not installed ({exc}): "
                             f"{EXTRA_HINT}") from exc
    return mx, mlx_lm
