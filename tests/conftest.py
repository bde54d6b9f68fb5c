"""Fixtures shared by every test package.

``server`` is one real ``kvcellar serve`` subprocess for the whole session (embedded model,
fp32, small KV pool, temporary cache dir), started lazily by the first test that asks for
it and stopped (SIGTERM, graceful) at the end. ``KVCELLAR_TEST_SERVER_URL=http://127.0.0.1:PORT``
reuses a server started by hand instead (quick iteration). Tests that need other flags start their own
``ServerProcess`` (see tests/helpers.py), sparingly: each start loads the model.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from kvcellar.engine.torch_math import settle as settle_torch_math
from tests._models import embedded, shared_models_dir, uncached_runner
from tests.helpers import MODEL, ServerProcess


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (``-n N``): the controller makes the one prepared-model folder
    before the workers start, so they inherit it and the model is prepared once; each
    worker, and every server it starts, gets its share of the cores for torch's threads
    (N processes each running as many threads as cores is slower on 2 cores)."""
    settle_torch_math()  # a test's transformers reference, run before any engine, takes no odd first call
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:
        shared_models_dir()
        return
    threads = max(1, (os.cpu_count() or 1) // int(workerinput["workercount"]))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


# The files that take 20 s or more, longest first (from a full run). pytest-xdist hands each
# worker whole files (``--dist loadfile``, in collection order with ``--no-loadscope-reorder``), so a long file
# collected late runs alone at the end while the other core idles; started first, the rest
# of the suite fills the other worker around it.
LONGEST_FIRST = (
    "tests/engine/test_speculative.py",
    "tests/engine/test_quantization.py",
    "tests/integration/test_server_ssd.py",
    "tests/bench/test_bench.py",
    "tests/engine/test_constraints.py",
    "tests/server/test_anthropic.py",
    "tests/engine/test_lean_forward.py",
    "tests/integration/test_coding_agents.py",
    "tests/remote/test_server_remote.py",
    "tests/engine/test_engine_correctness.py",
    "tests/integration/test_step_invariance.py",
    "tests/remote/test_mlx_servers.py",
    "tests/engine/test_mlx_engine.py",
    "tests/server/test_floods.py",
    "tests/engine/test_kv_quantized.py",
    "tests/remote/test_engine_remote.py",
    "tests/integration/test_server_disk_faults.py",
    "tests/integration/test_qwen35.py",
    "tests/server/test_tool_schemas.py",
    "tests/remote/test_qwen35_agent.py",
    "tests/integration/test_qwen35_tiers.py",
    "tests/artifacts/test_settings.py",
    "tests/server/test_lifecycle.py",
    "tests/integration/test_engine_ssd.py",
    "tests/engine/test_loader.py",
    "tests/artifacts/test_gguf_streamed.py",
    "tests/cache/test_tier_contract.py",
    "tests/cache/test_prefix_reuse.py",
    "tests/server/test_harmony.py",
    "tests/server/test_agent_frameworks.py",
    "tests/server/test_warmup.py",
    "tests/server/test_responses.py",
    "tests/integration/test_gemma4.py",
    "tests/artifacts/test_embedded.py",
    "tests/integration/test_moe_agent.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.partition("::")[0], len(rank)))  # stable


@pytest.fixture(scope="session")
def models_dir() -> Path:
    """Prepared model artifacts shared by every server and in-process model of the session
    (``KVCELLAR_TEST_MODELS_DIR`` keeps them across sessions)."""
    return shared_models_dir()


@pytest.fixture(scope="session")
def model() -> Any:
    """The embedded model in float32, loaded in process once (greedy outputs compare
    exactly across runs). A module that needs another one defines its own ``model``."""
    return embedded("float32")


@pytest.fixture(scope="module")
def uncached(request: pytest.FixtureRequest, model: Any) -> Callable[[Sequence[int]], Any]:
    """``uncached(prompt)``: the cache-disabled result of ``prompt`` under the test module's
    ``GREEDY`` sampling params (memoised), which every cached run of it must equal. ``model``
    is the module's own where it defines one (e.g. int8)."""
    return uncached_runner(model, request.module.GREEDY)


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Iterator[ServerProcess]:
    external = os.environ.get("KVCELLAR_TEST_SERVER_URL")
    if external:  # a server started by hand with tests.helpers.DEFAULT_SERVE_ARGS
        yield ServerProcess.attach(external)
        return
    cache_dir: Path = tmp_path_factory.mktemp("kvcellar-server-cache")
    proc = ServerProcess(cache_dir, models_dir=models_dir, warmup=True).start()
    try:
        yield proc
    finally:
        code = proc.stop()
        if code not in (0, None):
            print(f"session server exited with {code}; log tail:\n{proc.log_tail()}")


@pytest.fixture(scope="session")
def client(server: ServerProcess) -> Any:
    """The official ``openai`` client pointed at the session server."""
    return server.client()


@pytest.fixture(scope="session")
def model_name() -> str:
    return MODEL
