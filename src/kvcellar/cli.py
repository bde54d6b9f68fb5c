"""The ``kvcellar`` command line: serve, generate, cache, models, bench."""

from __future__ import annotations

import argparse
import gc
import logging
import sys
from collections.abc import Callable
from typing import Any

import kvcellar  # noqa: F401  (sets OMP_WAIT_POLICY before torch loads)
from kvcellar.artifacts.cli import add_models_commands
from kvcellar.bench.cli import add_bench_commands
from kvcellar.engine.config import ENGINE_KINDS, SPECULATIVE_MODES, THREAD_SPINS, WEIGHT_MODES
from kvcellar.errors import KvcellarError
from kvcellar.server.cli import add_serve_args, server_cli_values
from kvcellar.settings import Settings, load_settings
from kvcellar.storage.disk.cli import add_cache_commands
from kvcellar.storage.disk.config import DURABILITIES, SSD_POLICIES
from kvcellar.storage.remote.cli import add_remote_args, remote_cli_values


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="a .gguf file, a HF-format directory or a HF model id in the local HF cache "
                        "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"],
                   help="compute and KV dtype (auto: bf16 where the CPU/GPU supports it, else fp32)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--block-size", type=int, default=None, help="tokens per KV block (default 16)")
    p.add_argument("--kv-cache-gb", type=float, default=None, help="RAM for the KV block pool, GiB (default 2)")
    p.add_argument("--kv-bits", type=int, default=None, choices=(16, 8, 4),
                   help="KV precision: 16 (the model's dtype, default) or quantized to 8 or 4 bits, 2x / 3.5x the "
                        "tokens per GB in RAM, on SSD and in Redis; another setting is another cache")
    p.add_argument("--kv-group-size", type=int, default=None,
                   help="values per scale and offset of quantized KV, along the head dimension (default 64)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="sequences in the running batch (default 32)")
    p.add_argument("--max-memory-gb", type=float, default=None,
                   help="refuse a model whose planned memory (weights + KV pool + 1 GB) is above this "
                        "(default: only the memory available is checked)")
    p.add_argument("--unhealthy-after-failed-steps", type=int, default=None,
                   help="engine steps failing in a row before /health answers 503 (default 3)")
    p.add_argument("--max-step-tokens", type=int, default=None,
                   help="token budget per engine step while sequences are decoding (default 512)")
    p.add_argument("--max-prefill-step-tokens", type=int, default=None,
                   help="token budget of a step with no sequence decoding (default 2048; 0: --max-step-tokens)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + completion (0: the model's trained context; larger is allowed with a "
                   "warning, and the KV pool grows to hold one such request)")
    p.add_argument("--max-completion-tokens", type=int, default=None,
                   help="most tokens one completion may generate: larger max_tokens are clamped to it, and it is "
                   "the default where a request sets none (0, the default: the room the context leaves)")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false", default=None,
                   help="compute every prompt from scratch (comparisons only); this also turns the SSD and "
                        "remote tiers off, whatever --ssd-policy and --remote-url say")
    p.add_argument("--weights", default=None, choices=list(WEIGHT_MODES),
                   help="full: weights in --dtype; int8 / int4: weight-only quantized linears (faster decode where "
                        "the CPU runs torch's kernels: bf16), used for steps up to a size measured at warm-up; "
                        "auto (default): int4 for a 4-bit GGUF where the kernel runs, else full")
    p.add_argument("--engine", default=None, choices=list(ENGINE_KINDS),
                   help="the framework computing the model: torch (default) or mlx (mlx-lm's models, the extra "
                        "kvcellar[mlx]; llama, mistral, qwen2/3 and gemma3)")
    p.add_argument("--speculative", default=None, choices=list(SPECULATIVE_MODES),
                   help="speculative decoding: draft tokens from the request's own text (ngram) or also from "
                        "recent outputs of every request (suffix), verified in one step; the output is the same. "
                        "auto (default): suffix on CPUs (kvcellar's attention kernel), off on GPUs")
    p.add_argument("--speculative-max-tokens", type=int, default=None,
                   help="the longest draft, in tokens (default 8)")
    p.add_argument("--thread-spin", default=None, choices=list(THREAD_SPINS),
                   help="whether the CPU kernels' threads spin between a decode step's loops instead of sleeping: "
                        "auto (default) spins while the machine has a CPU for every thread that wants one")
    p.add_argument("--no-warmup", dest="warmup", action="store_false", default=None,
                   help="serve without first running every code path once (faster start, slower first request)")


def add_cache_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache-dir", default=None,
                   help="cache root for KV blocks and prepared models (default: KVCELLAR_CACHE_DIR, "
                        "else ~/.cache/kvcellar)")
    p.add_argument("--cache-secret-file", default=None,
                   help="file holding a secret (>= 16 bytes) every replica shares: blocks written to the SSD and "
                        "remote tiers are sealed with it, and blocks without its seal are never served (also "
                        "KVCELLAR_CACHE_SECRET_FILE, or the secret itself in KVCELLAR_CACHE_SECRET)")
    p.add_argument("--cache-previous-secrets-file", default=None,
                   help="while rotating the secret: the secrets before it, one a line, whose seals are still "
                        "accepted on reads (blocks are sealed with --cache-secret-file's); also "
                        "KVCELLAR_CACHE_PREVIOUS_SECRETS_FILE")
    p.add_argument("--ssd-policy", default=None, choices=list(SSD_POLICIES),
                   help="SSD tier: write every new block through (default), write blocks RAM evicts, or off")
    p.add_argument("--ssd-durability", default=None, choices=list(DURABILITIES),
                   help="persistent: fsync before a block counts as stored (default best_effort)")
    p.add_argument("--ssd-persistent-retries", type=int, default=None,
                   help="with --ssd-durability persistent: retries of a failed write before the block is dropped "
                        "(default 3)")
    p.add_argument("--ssd-async", default=None, action=argparse.BooleanOptionalAction,
                   help="write blocks on the writer thread (default) or synchronously")
    p.add_argument("--ssd-queue-blocks", type=int, default=None, help="writer queue bound, in blocks (default 256)")
    p.add_argument("--ssd-evict-wait", dest="ssd_evict_wait_s", type=float, default=None,
                   help="seconds the engine waits for room in a full writer queue for a block RAM evicts that "
                        "is not on disk yet, before it is lost to the SSD (default 0.05; 0: never wait)")
    p.add_argument("--ssd-flush-interval", dest="ssd_flush_interval_s", type=float, default=None,
                   help="seconds between flushes of access times (default 1)")
    p.add_argument("--disk-cache-gb", type=float, default=None, help="SSD tier byte limit, GiB (default 20)")
    p.add_argument("--disk-min-free-gb", type=float, default=None,
                   help="free space the SSD tier always leaves on the filesystem, GiB (default: "
                        "min(1, 5%% of the filesystem's size)); if it leaves no room for a block, start-up "
                        "warns and /health shows the ssd state no_space")
    p.add_argument("--ssd-ttl-days", type=float, default=None, help="drop blocks unused this long (default 7)")
    add_remote_args(p)


def settings_from_args(args: argparse.Namespace) -> Settings:
    """The settings of a command: its flags over ``config.load_settings``' defaults, file and
    environment."""
    get: Callable[[str], Any] = lambda name: getattr(args, name, None)  # noqa: E731
    return load_settings(get("config"), model=get("model"), cache_dir=get("cache_dir"),
                         cache_secret_file=get("cache_secret_file"),
                         cache_previous_secrets_file=get("cache_previous_secrets_file"), flags={
        "engine": {
            # --dtype and --device default to "auto", which must not override the file
            "dtype": None if get("dtype") == "auto" else get("dtype"),
            "device": None if get("device") == "auto" else get("device"),
            **{k: get(k) for k in ("block_size", "kv_cache_gb", "kv_bits", "kv_group_size", "max_num_seqs",
                                   "max_step_tokens", "max_prefill_step_tokens", "max_model_len",
                                   "max_completion_tokens", "prefix_caching", "warmup",
                                   "weights", "unhealthy_after_failed_steps", "max_memory_gb", "speculative",
                                   "speculative_max_tokens", "engine", "thread_spin")},
        },
        "disk": {k: get(k) for k in ("ssd_policy", "ssd_durability", "ssd_persistent_retries", "ssd_async",
                                     "ssd_queue_blocks", "ssd_evict_wait_s", "ssd_flush_interval_s", "disk_cache_gb",
                                     "disk_min_free_gb", "ssd_ttl_days")},
        "remote": remote_cli_values(args),
        "server": server_cli_values(args),
    })


def cmd_serve(args: argparse.Namespace) -> int:
    from kvcellar.server.runner import serve

    return serve(settings_from_args(args), log_level=args.log_level)


def cmd_models_plan(args: argparse.Namespace) -> int:
    import json

    from kvcellar.engine.memory import available_bytes
    from kvcellar.runtime import memory_plan

    plan = memory_plan(settings_from_args(args))
    free = available_bytes()
    if args.json:
        print(json.dumps({**plan.as_dict(), "available_bytes": free}))
    else:
        print(f"{plan.describe()}" + (f"; available now: {free / (1 << 30):.1f} GB" if free is not None else ""))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from kvcellar.engine import SamplingParams
    from kvcellar.engine.tokenization import encode_chat
    from kvcellar.runtime import build_engine

    engine = build_engine(settings_from_args(args))
    messages = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    messages.append({"role": "user", "content": args.prompt})
    try:
        ids = encode_chat(engine.tokenizer, messages)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                seed=args.seed)
        handle = engine.submit(ids, params)
        engine.start()
        while True:
            ev = handle.stream.get_sync()
            sys.stdout.write(ev.text)
            sys.stdout.flush()
            if ev.finish_reason is not None:
                break
    finally:
        engine.shutdown(timeout=10)
    sys.stdout.write("\n")
    if args.verbose:
        print(f"[{ev.num_prompt_tokens} prompt tokens, {ev.num_cached_tokens} cached, "
              f"{ev.num_output_tokens} generated, finish: {ev.finish_reason}]", file=sys.stderr)
    if ev.finish_reason == "error":
        print(f"error: {ev.error}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcellar", description=__doc__)
    parser.add_argument("--log-level", default="WARNING", help="log level: WARNING, INFO, DEBUG")
    parser.add_argument("--config", default=None, help="TOML config file (also KVCELLAR_CONFIG)")
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="serve the OpenAI-compatible API (ready when GET /health answers 200)")
    # Also after the subcommand, where people put it (`kvcellar serve --log-level INFO`).
    s.add_argument("--log-level", default=argparse.SUPPRESS,
                   help="log level (default WARNING; INFO: a line per request)")
    add_model_args(s)
    add_cache_args(s)
    add_serve_args(s)
    s.set_defaults(func=cmd_serve)

    g = sub.add_parser("generate", help="print the completion of a one-turn chat")
    g.add_argument("--prompt", required=True)
    g.add_argument("--system", default=None, help="optional system message")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("-v", "--verbose", action="store_true", help="print token counts (cached ones too) to stderr")
    add_model_args(g)
    add_cache_args(g)
    g.set_defaults(func=cmd_generate)

    add_cache_commands(sub)
    models = add_models_commands(sub)
    m = models.add_parser("plan", help="the memory a model will need served (weights by mode + KV pool + "
                                       "overhead), from its headers, before anything loads")
    add_model_args(m)
    m.add_argument("--json", action="store_true", help="machine-readable output")
    m.set_defaults(func=cmd_models_plan)
    add_bench_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The command line (``argv``: the process's own when None, as the ``kvcellar`` script runs it)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except KvcellarError as exc:
        print(f"kvcellar: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # bad settings (config file, environment, flags)
        print(f"kvcellar: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        if argv is None:
            # The process exits next: its objects need no collecting, and the collections the
            # interpreter runs while finalizing took 2-3 s over torch's and transformers' modules.
            gc.freeze()


if __name__ == "__main__":
    sys.exit(main())
