"""Scenario discovery.

A scenario is any module of ``kvcellar.bench`` that defines

- ``NAME: str`` — the sub-command (``kvcellar bench NAME``);
- ``add_arguments(parser)`` — its own options (``--out``, ``--fast``, ``--seed`` and
  ``--repeats`` are added for every scenario by ``cli.py``);
- ``run(args)`` — measures and returns its result: a dataclass with ``tables`` (see
  ``report.py``) whose fields are result.json's keys, written by ``report.to_json``;
  ``args.out`` is the output folder, already created;
- ``plot(result, out_dir) -> list[Path]`` — writes PNGs with matplotlib from that result.

Adding a scenario is adding a sibling module with those four names; nothing here changes.
Modules without them (the shared helpers) are ignored. Scenario modules import heavy
dependencies (torch, matplotlib, transformers) inside functions, so ``kvcellar --help``
stays fast.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

REQUIRED = ("NAME", "add_arguments", "run", "plot")


def discover() -> dict[str, ModuleType]:
    """Scenario modules by ``NAME``, in module-name order."""
    import kvcellar.bench as package

    found: dict[str, ModuleType] = {}
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        if info.ispkg or info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        if all(hasattr(module, attr) for attr in REQUIRED):
            found[str(module.NAME)] = module
    return found
