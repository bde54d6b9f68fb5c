"""The ``kvcellar`` command line."""

from __future__ import annotations

import argparse
import logging
import sys

import kvcellar  # noqa: F401  (sets OMP_WAIT_POLICY before torch loads)
from kvcellar.artifacts.cli import add_models_commands
from kvcellar.errors import KvcellarError
from kvcellar.server.cli import add_serve_args, cmd_serve


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="a .gguf file, a HF-format directory or a HF model id in the local HF cache "
                        "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"],
                   help="compute and KV dtype (auto: bf16 where the CPU/GPU supports it, else fp32)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--block-size", type=int, default=None, help="tokens per KV block")
    p.add_argument("--kv-cache-gb", type=float, default=None, help="RAM for the KV block pool, GiB")


def _engine_config(args: argparse.Namespace):
    from kvcellar.config import EngineConfig, build_section, read_config_file

    file_values = read_config_file(getattr(args, "config", None)).get("engine", {})
    return build_section(EngineConfig, file_values, {
        "dtype": None if args.dtype == "auto" else args.dtype,
        "device": None if args.device == "auto" else args.device,
        "block_size": args.block_size,
        "kv_cache_gb": args.kv_cache_gb,
    })


def cmd_generate(args: argparse.Namespace) -> int:
    from kvcellar.config import resolve_cache_dir
    from kvcellar.engine import Engine, SamplingParams
    from kvcellar.engine.loader import load_model
    from kvcellar.engine.tokenization import encode_chat

    cfg = _engine_config(args)
    loaded = load_model(args.model, dtype=cfg.dtype, device=cfg.device,
                        cache_dir=resolve_cache_dir(getattr(args, "cache_dir", None)))
    engine = Engine(loaded, cfg)
    messages = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    messages.append({"role": "user", "content": args.prompt})
    ids = encode_chat(loaded.tokenizer, messages)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed)
    handle = engine.submit(ids, params)
    engine.start()
    try:
        while True:
            ev = handle.stream.get_sync()
            sys.stdout.write(ev.text)
            sys.stdout.flush()
            if ev.finish_reason is not None:
                break
    finally:
        engine.shutdown(timeout=5)
    sys.stdout.write("\n")
    if ev.finish_reason == "error":
        print(f"error: {ev.error}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcellar", description=__doc__)
    parser.add_argument("--log-level", default="WARNING")
    parser.add_argument("--config", default=None, help="TOML config file (also KVCELLAR_CONFIG)")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="print the completion of a one-turn chat")
    g.add_argument("--prompt", required=True)
    g.add_argument("--system", default=None, help="optional system message")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    _add_model_args(g)
    g.set_defaults(func=cmd_generate)
    add_models_commands(sub)

    s = sub.add_parser("serve", help="serve the OpenAI-compatible API (ready when GET /health answers 200)")
    _add_model_args(s)
    add_serve_args(s)
    s.set_defaults(func=lambda args: cmd_serve(args, _engine_config(args)))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except KvcellarError as exc:
        print(f"kvcellar: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
