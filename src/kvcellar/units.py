"""Small formatting helpers shared by the command-line tools."""

from __future__ import annotations


def format_bytes(n: float) -> str:
    """``1536`` -> ``1.5 KiB``; whole bytes below 1 KiB, TiB at most."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
