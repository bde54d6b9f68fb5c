"""The package layout is the architecture: no import cycles between kvcellar's modules, no
import that points up a floor, and package ``__init__`` files that stay light where callers
depend on it.

Every import statement counts, including the ones inside functions and ``TYPE_CHECKING``
blocks: a cycle hidden behind a deferred import is still a cycle.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import kvcellar

SRC = Path(kvcellar.__file__).parent


# The floors of the import picture, lowest first: a module imports from its own floor and
# those below, never above. A module is on the floor of the longest name here it starts with.
FLOORS = {
    # leaves
    "kvcellar": 1, "kvcellar.paths": 1, "kvcellar.units": 1, "kvcellar.errors": 1, "kvcellar.stats": 1,
    "kvcellar.pages": 1,
    # the storage tiers; model files and their identities
    "kvcellar.storage": 2, "kvcellar.gguf_info": 2, "kvcellar.model_source": 2, "kvcellar.identity": 2,
    "kvcellar.quantization": 2,
    # the RAM prefix cache over the tiers; the prepared-model cache
    "kvcellar.cache": 3, "kvcellar.artifacts": 3,
    "kvcellar.engine": 4,
    "kvcellar.server": 5,
    # the assembly: settings from every section, parts built from them, and the commands that
    # load or take the assembled settings
    "kvcellar.settings": 6, "kvcellar.runtime": 6, "kvcellar.cli": 6, "kvcellar.bench": 6,
    "kvcellar.server.runner": 6, "kvcellar.artifacts.cli": 6,
}


def floor_of(name: str) -> int:
    prefix = name
    while prefix not in FLOORS or (prefix == "kvcellar" and name != "kvcellar"):
        assert "." in prefix, f"{name} is on no floor: add it to FLOORS"
        prefix = prefix.rpartition(".")[0]
    return FLOORS[prefix]


def module_names() -> dict[str, Path]:
    names = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The kvcellar modules ``name`` imports: ``from pkg import sub`` is an import of
    ``pkg.sub`` when that is a module, of ``pkg`` otherwise."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    # Importing ``a.b.c`` runs the ``__init__`` of ``a`` and ``a.b`` first: those count too,
    # except the packages ``name`` itself sits in (they are being imported already).
    own = {name.rsplit(".", i)[0] for i in range(1, name.count(".") + 1)} | {name}
    for target in list(found):
        parts = target.split(".")
        found.update(p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if p in modules and p not in own)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path that starts and ends at the same module, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_find_cycle_reports_the_modules_on_it() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles_between_modules() -> None:
    modules = module_names()
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    assert "kvcellar.settings" in graph["kvcellar.runtime"]  # the scan sees imports at all
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_import_points_up_a_floor() -> None:
    modules = module_names()
    up = [f"{name} (floor {floor_of(name)}) -> {target} (floor {floor_of(target)})"
          for name, path in sorted(modules.items()) for target in sorted(imports_of(name, path, modules))
          if floor_of(target) > floor_of(name)]
    assert not up, "imports pointing up a floor:\n" + "\n".join(up)


def test_reading_settings_does_not_load_the_engine() -> None:
    code = "import json, sys, kvcellar.settings; print(json.dumps(sorted(sys.modules)))"
    env = {**os.environ, "PYTHONPATH": str(SRC.parent)}
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                       env=env).stdout)
    assert [m for m in loaded if m.startswith("kvcellar.engine")] == ["kvcellar.engine", "kvcellar.engine.config"]
    assert "transformers" not in loaded


def test_the_command_line_loads_the_engine_only_for_commands_that_run_it() -> None:
    """``kvcellar cache ...`` and ``--help`` build the whole parser (the bench scenarios
    included) and must not pay for transformers."""
    code = ("import json, sys, kvcellar.cli; kvcellar.cli.build_parser(); "
            "print(json.dumps(sorted(sys.modules)))")
    env = {**os.environ, "PYTHONPATH": str(SRC.parent)}
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                       env=env).stdout)
    assert "kvcellar.engine.engine" not in loaded and "transformers" not in loaded


def test_importing_storage_does_not_import_the_disk_tier() -> None:
    code = "import json, sys, kvcellar.storage; print(json.dumps([m for m in sys.modules if 'kvcellar.' in m]))"
    env = {**os.environ, "PYTHONPATH": str(SRC.parent)}  # the kvcellar under test, in a fresh interpreter
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    loaded = json.loads(out)
    assert "kvcellar.storage.base" in loaded
    assert not [m for m in loaded if m.startswith("kvcellar.storage.disk")], loaded


def test_shared_storage_modules_import_no_tier() -> None:
    """What both tiers build on (the block format, the bounded writer, faults) sits
    below them: it imports neither ``storage.disk`` nor ``storage.remote``."""
    modules = module_names()
    for name in ("kvcellar.storage.block_format", "kvcellar.storage.writer", "kvcellar.storage.faults"):
        tiers = [m for m in imports_of(name, modules[name], modules)
                 if m.startswith(("kvcellar.storage.disk", "kvcellar.storage.remote"))]
        assert not tiers, f"{name} imports {tiers}"
