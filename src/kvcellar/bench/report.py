"""Output of a bench run: the folder, plain-text tables, the JSON file, machine facts.

A scenario's result is a dataclass with at least ``tables``: a list of
``{"title", "columns", "rows", "notes"}`` whose cells are already formatted strings. The
figures themselves are dataclasses too (``stats.Summary`` for repeated measurements), read
by attribute; their field names are result.json's keys, and ``to_json`` turns them into
JSON once, when the file is written.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvcellar.bench.stats import Summary


def default_out_dir(scenario: str) -> Path:
    return Path("bench-results") / f"{scenario}-{time.strftime('%Y%m%d-%H%M%S')}"


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]],
          notes: Sequence[str] = ()) -> dict[str, Any]:
    return {"title": title, "columns": list(columns), "rows": [[str(c) for c in r] for r in rows],
            "notes": list(notes)}


def format_table(t: dict[str, Any]) -> str:
    """A Markdown table (pastes into notes and READMEs as is)."""
    cols = t["columns"]
    rows = t["rows"]
    widths = [max(len(str(c)), *(len(r[i]) for r in rows)) if rows else len(str(c)) for i, c in enumerate(cols)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=False)) + " |"

    out = [f"### {t['title']}", "", line(cols), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in rows]
    out += [""] + [f"- {n}" for n in t.get("notes", ())] if t.get("notes") else []
    return "\n".join(out)


def format_tables(tables: Sequence[dict[str, Any]]) -> str:
    return "\n\n".join(format_table(t) for t in tables)


def save_json(result: dict[str, Any], out_dir: Path, name: str = "result.json") -> Path:
    path = out_dir / name
    path.write_text(json.dumps(result, indent=1, sort_keys=False, default=str, allow_nan=False))
    return path


# ---- result.json ------------------------------------------------------------------------------

# Keys of a result field's metadata that ``to_json`` honours, e.g.
# ``field(default=None, metadata={OMIT_IF_NONE: True})``.
OMIT_IF_NONE = "omit_if_none"  # result.json leaves the key out while the value is None, as it always has
JSON_KEY = "json_key"  # the key in result.json where it is not a Python name (``pass``)


def to_json(value: Any) -> Any:
    """Strict JSON of a result: dataclasses as objects of their fields (see ``OMIT_IF_NONE`` and
    ``JSON_KEY``), dict keys as strings, NaN/inf as null, paths and other objects as their ``str``."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out: dict[str, Any] = {}
        for f in dataclasses.fields(value):
            v = getattr(value, f.name)
            if not (v is None and f.metadata.get(OMIT_IF_NONE)):
                out[f.metadata.get(JSON_KEY, f.name)] = to_json(v)
        return out
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_json(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, bool | int | str):
        return value
    return str(value)


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def grouped_bars(ax: Any, names: Sequence[str], groups: Sequence[tuple[str, Sequence[float], Any]]) -> None:
    """One group of bars per name, a bar per ``(label, values, yerr)`` of ``groups`` in each
    (``yerr`` as matplotlib takes it, or None), with the names under the groups."""
    width = 0.8 / max(1, len(groups))
    for j, (label, values, yerr) in enumerate(groups):
        ax.bar([i + j * width for i in range(len(names))], values, width, yerr=yerr,
               capsize=4 if yerr is not None else 0, label=label)
    ax.set_xticks([i + width * (len(groups) - 1) / 2 for i in range(len(names))], names, fontsize=8)
    ax.legend()
    ax.grid(True, axis="y", alpha=0.3)


def save_figure(fig: Any, out_dir: Path, name: str) -> list[Path]:
    """Write ``fig`` as ``out_dir/name`` and free it; the list a scenario's ``plot`` returns."""
    path = out_dir / name
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return [path]


# ---- cell formatting -----------------------------------------------------------------------


def ms(summary: Summary | float | None, digits: int = 0) -> str:
    """``median (min–max)`` of seconds, shown in milliseconds; ``-`` when missing."""
    return _fmt(summary, 1000.0, digits)


def num(summary: Summary | float | None, digits: int = 1) -> str:
    return _fmt(summary, 1.0, digits)


def _fmt(summary: Summary | float | None, scale: float, digits: int) -> str:
    if summary is None:
        return "-"
    if isinstance(summary, Summary):
        med, lo, hi = (v * scale for v in (summary.median, summary.min, summary.max))
        if summary.n <= 1 or math.isclose(lo, hi):
            return f"{med:.{digits}f}"
        return f"{med:.{digits}f} ({lo:.{digits}f}–{hi:.{digits}f})"
    return f"{summary * scale:.{digits}f}"


def x(value: float | None, digits: int = 2) -> str:
    """A ratio: ``1.23x``."""
    return "-" if value is None else f"{value:.{digits}f}x"


def pct(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{100.0 * value:.{digits}f}%"


# ---- the machine a run was taken on ------------------------------------------------------------


# The CPU flags that decide which of kvcellar's kernels and llama.cpp's run (and so the ratios
# between them): recorded with every run.
KERNEL_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "avx512_bf16",
                "amx_tile", "amx_int8", "amx_bf16")


def cpu_info() -> dict[str, Any]:
    """Where a figure ran: the CPU's name, vendor, family and model numbers (a Zen 4 and a Zen 5
    share a name's pattern), the kernel-deciding flags it lists, and the forms of kvcellar's
    kernels it runs."""
    info: dict[str, Any] = {}
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if not key.strip() and fields:
                    break  # the first CPU's fields
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    flags = set(fields.get("flags", "").split())
    info["cpu"] = fields.get("model name")
    info["cpu_vendor"] = fields.get("vendor_id")
    info["cpu_family"] = int(fields["cpu family"]) if fields.get("cpu family", "").isdigit() else None
    info["cpu_model"] = int(fields["model"]) if fields.get("model", "").isdigit() else None
    info["cpu_flags"] = [f for f in KERNEL_FLAGS if f in flags]
    try:
        from kvcellar.engine import native

        info["cpu_kernels"] = native.cpu_kernels()
    except (ImportError, OSError, RuntimeError):
        info["cpu_kernels"] = None
    return info


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_avg_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    info.update(cpu_info())
    try:
        with open("/proc/meminfo") as f:
            info["mem_gib"] = round(int(f.readline().split()[1]) / (1 << 20), 1)
    except (OSError, StopIteration, ValueError, IndexError):
        pass
    try:
        import kvcellar

        info["kvcellar"] = kvcellar.__version__
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(kvcellar.__file__).parent)
        if rev.returncode == 0:
            info["git"] = rev.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def machine_line(m: dict[str, Any]) -> str:
    """One line saying where a run took its figures (``machine_info``'s record)."""
    kernels = m.get("cpu_kernels") or {}
    forms = ("none (torch's)" if not kernels.get("native") else
             f"{kernels.get('vectors')}, {kernels.get('int4_panels_at_once')} int4 panels at once, "
             f"AMX tiles {'yes' if kernels.get('amx') else 'no'}")
    return (f"machine: {m.get('cpu')} ({m.get('cpu_vendor')} family {m.get('cpu_family')} model "
            f"{m.get('cpu_model')}), {m.get('cpus')} CPUs, {m.get('mem_gib')} GiB; flags "
            f"{' '.join(m.get('cpu_flags') or []) or '-'}; kvcellar kernels: {forms}; load at start "
            f"{m.get('load_avg_at_start')}; kvcellar {m.get('git', m.get('kvcellar'))}")
