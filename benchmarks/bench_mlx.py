"""kvcellar's MLX engine beside mlx-lm's own server (and oMLX where given), on one model, for
Apple Silicon: time to first token cold, from RAM and after a restart, decode tokens/s with 1
and 8 streams, and each server's resident memory. Figures only, no asserts.

Each server gets the same OpenAI chat requests (streamed, ``temperature`` 0):

  ttft_cold      a ``--prompt-tokens`` document and a question, on a fresh server
  ttft_ram       the same document, another question (the document is a cached prefix)
  ttft_restart   the server stopped and started again (kvcellar: the same --cache-dir, so its
                 SSD tier; mlx_lm.server keeps its prompt cache in RAM only), another question
  decode_b1      tokens/s of one stream of ``--decode-tokens`` tokens
  decode_b8      tokens/s summed over 8 concurrent streams
  rss_gb         the server's resident memory after the runs (``ps -o rss``)

    .venv/bin/python benchmarks/bench_mlx.py                       # the embedded model
    .venv/bin/python benchmarks/bench_mlx.py --model ~/models/Qwen3-8B --prompt-tokens 8000
    .venv/bin/python benchmarks/bench_mlx.py --omlx-cmd "omlx serve --port {port} --model {model}"

``--model`` is a HF folder (or a GGUF, which kvcellar prepares; mlx-lm gets that prepared folder).
mlx-lm 0.32 reads ``rope_theta`` where transformers 5 writes ``rope_parameters``: its server gets a
copy of the folder whose ``config.json`` has both (kvcellar's engine passes them itself), so both
compute the same model. Results: ``bench-results/mlx-<time>/results.json``.

On Linux MLX runs on its CPU backend with a reference BLAS, ~100x slower than on a Mac's GPU:
run there only as a smoke test (``--prompt-tokens 200 --decode-tokens 16``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
FILLER = ("Runbook, storage team. Disk pressure: check df -h and the largest directories first; never delete "
          "snapshots without a ticket. Replication lag: compare the primary's LSN with each replica's before "
          "failing over; a failover with lag loses writes. Certificates: renew 14 days ahead. ")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A server process answering OpenAI chat completions on 127.0.0.1."""

    def __init__(self, name: str, command: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.name, self.command, self.log, self.env = name, command, log, env
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    def start(self, timeout: float = 900) -> float:
        self.port = free_port()
        cmd = [part.replace("{port}", str(self.port)) for part in self.command]
        t0 = time.perf_counter()
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: see {self.log}")
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=2).status_code == 200:
                    return time.perf_counter() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not ready in {timeout} s: see {self.log}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def rss_gb(self) -> float:
        assert self.proc is not None
        out = subprocess.run(["ps", "-o", "rss=", "-p", str(self.proc.pid)], capture_output=True, text=True)
        return int(out.stdout.strip() or 0) / (1 << 20)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None

    def stream(self, model: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, float]:
        """One streamed request: seconds to the first content token, total, tokens received."""
        body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
        t0 = time.perf_counter()
        first, tokens = None, 0
        with httpx.stream("POST", f"{self.url}/v1/chat/completions", json=body, timeout=3600) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                delta = (json.loads(line[6:]).get("choices") or [{}])[0].get("delta", {})
                if delta.get("content"):
                    first = first if first is not None else time.perf_counter() - t0
                    tokens += 1
        total = time.perf_counter() - t0
        return {"ttft_s": first if first is not None else total, "total_s": total, "tokens": tokens}


def document(tokens: int) -> str:
    return FILLER * max(1, tokens // 50)  # ~50 tokens a filler for Llama/Qwen BPEs


def run_server(server: Server, model: str | None, args: argparse.Namespace, restartable: bool) -> dict[str, Any]:
    """The figures of one server; ``model``: the name to request (None: the first it lists)."""
    doc = document(args.prompt_tokens)
    ask = lambda q: [{"role": "system", "content": doc}, {"role": "user", "content": q}]  # noqa: E731
    figures: dict[str, Any] = {"start_s": server.start()}
    model = model or httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
    figures["ttft_cold_s"] = server.stream(model, ask("Disk is full on db-3. First step?"), 4)["ttft_s"]
    figures["ttft_ram_s"] = server.stream(model, ask("Replica lag is 40 MB. Fail over?"), 4)["ttft_s"]
    one = server.stream(model, [{"role": "user", "content": "Write a long story about a lighthouse."}],
                        args.decode_tokens)
    figures["decode_b1_tok_s"] = one["tokens"] / max(one["total_s"] - one["ttft_s"], 1e-9)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        t0 = time.perf_counter()
        runs = list(pool.map(lambda i: server.stream(
            model, [{"role": "user", "content": f"Story {i}: a lighthouse keeper's long night."}],
            args.decode_tokens), range(8)))
        figures["decode_b8_tok_s"] = sum(r["tokens"] for r in runs) / (time.perf_counter() - t0)
    figures["rss_gb"] = server.rss_gb()
    if restartable:
        server.stop()
        figures["restart_start_s"] = server.start()
        figures["ttft_restart_s"] = server.stream(model, ask("Renew the certificate now?"), 4)["ttft_s"]
    server.stop()
    return figures


def mlx_lm_folder(folder: Path, into: Path) -> Path:
    """``folder`` with a ``config.json`` that mlx-lm 0.32 reads as transformers means it."""
    sys.path.insert(0, str(ROOT / "src"))
    from kvcellar.engine.mlx.loader import mlx_model_config

    into.mkdir(parents=True, exist_ok=True)
    for item in folder.iterdir():
        if item.name != "config.json":
            (into / item.name).symlink_to(item.resolve())
    config = json.loads((folder / "config.json").read_text())
    (into / "config.json").write_text(json.dumps({**config, **mlx_model_config(config)}, indent=1))
    return into


def prepared_folder(model: str | None, cache_dir: Path) -> Path:
    """A HF folder of ``model``: itself, or the artifact-cache entry kvcellar prepares a GGUF into."""
    if model and Path(model).expanduser().is_dir():
        return Path(model).expanduser()
    sys.path.insert(0, str(ROOT / "src"))
    from kvcellar.engine.mlx.loader import load_mlx
    from kvcellar.runtime import open_artifacts
    from kvcellar.settings import Settings

    loaded = load_mlx(model, artifacts=open_artifacts(Settings(cache_dir=cache_dir)))
    assert loaded.artifact is not None
    return Path(loaded.artifact.path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF folder or GGUF (default: the embedded model)")
    p.add_argument("--prompt-tokens", type=int, default=4000)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--omlx-cmd", default=None,
                   help="a command starting oMLX's OpenAI server; {port} and {model} are filled in")
    p.add_argument("--skip-mlx-lm", action="store_true")
    p.add_argument("--out", type=Path, default=ROOT / "bench-results" / f"mlx-{time.strftime('%Y%m%d-%H%M%S')}")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kvcellar-bench-mlx-"))
    try:
        folder = prepared_folder(args.model, work / "prep")
        theirs = mlx_lm_folder(folder, work / "mlx-lm-model")
        kv_cmd = [str(Path(sys.executable).parent / "kvcellar"), "serve", "--engine", "mlx",
                  "--model", args.model or str(folder), "--port", "{port}", "--cache-dir", str(work / "prep"),
                  "--no-warmup"]
        results: dict[str, Any] = {
            "machine": {"platform": platform.platform(), "processor": platform.processor(),
                        "python": platform.python_version()},
            "args": {k: str(v) for k, v in vars(args).items()},
        }
        kvcellar = Server("kvcellar --engine mlx", kv_cmd, args.out / "kvcellar.log")
        results["kvcellar"] = run_server(kvcellar, None, args, restartable=True)
        print("kvcellar --engine mlx", json.dumps(results["kvcellar"], indent=1), flush=True)
        if not args.skip_mlx_lm:
            mlx_lm = Server("mlx_lm.server", [sys.executable, "-m", "mlx_lm", "server", "--model", str(theirs),
                                              "--port", "{port}"], args.out / "mlx_lm.log")
            results["mlx_lm"] = run_server(mlx_lm, str(theirs), args, restartable=True)
            print("mlx_lm.server", json.dumps(results["mlx_lm"], indent=1), flush=True)
        if args.omlx_cmd:
            cmd = [part.replace("{model}", str(theirs)) for part in args.omlx_cmd.split()]
            results["omlx"] = run_server(Server("oMLX", cmd, args.out / "omlx.log"), str(theirs), args,
                                         restartable=True)
            print("oMLX", json.dumps(results["omlx"], indent=1), flush=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
        print(f"results: {args.out / 'results.json'}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
