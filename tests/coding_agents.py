"""Running the real coding agents (Claude Code, Codex CLI, opencode) against a local server.

``make agents`` installs the pinned npm packages into ``.agents/`` (see agents/package.json). Each
``run_<agent>(base_url, model, prompt, tmp_dir)`` runs one prompt non-interactively and returns the
``subprocess.CompletedProcess`` (text stdout/stderr). Everything the agent reads or writes lives
under ``tmp_dir`` (its HOME, XDG folders, config and the working directory ``tmp_dir/work``), its
environment is built from scratch (nothing of ours leaks in: no API keys, no proxies), and it talks
to ``base_url`` only: no login, telemetry, update check, model-list or plugin download (each
invocation below was checked with strace and in a network namespace with only loopback; see
tests/server/fixtures/agents/README.md). ``continue_session=True`` with the same ``tmp_dir`` runs a
second turn of the conversation the previous call started.

A run is bounded: on ``timeout`` the agent's whole process group (and anything it spawned that
left it) is killed and ``subprocess.TimeoutExpired`` is raised, with the output so far; after a
normal exit, stragglers are killed too, so no process outlives the call.

``skip_reason(name)`` is None when the agent is installed, else a one-line reason to skip with;
``agent_binary(name)`` is its executable under ``.agents/`` or None.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
AGENTS_DIR = Path(os.environ.get("KVCELLAR_AGENTS_DIR", REPO / ".agents"))
AGENTS = ("claude", "codex", "opencode")
PACKAGES = {"claude": "@anthropic-ai/claude-code", "codex": "@openai/codex", "opencode": "opencode-ai"}
DEFAULT_API_KEY = "sk-kvcellar-test"
DEFAULT_TIMEOUT = 180.0
# The variable an agent reads its key from (Codex and opencode are told its name in their config).
API_KEY_ENV = "KVCELLAR_API_KEY"
# Marks every process of one run, so that ones which left the process group are found too.
_RUN_MARK = "KVCELLAR_AGENT_RUN"


# -- installation -------------------------------------------------------------------------------

def agent_binary(name: str) -> Path | None:
    """The agent's executable in ``.agents/node_modules/.bin`` (None when not installed)."""
    if name not in PACKAGES:
        raise ValueError(f"unknown agent {name!r}; one of {AGENTS}")
    path = AGENTS_DIR / "node_modules" / ".bin" / name
    ok = path.exists() and os.access(path, os.X_OK) and (AGENTS_DIR / f"{name}.version").exists()
    return path if ok else None


def agent_version(name: str) -> str | None:
    """What ``<agent> --version`` printed at install time (None when not installed)."""
    try:
        return (AGENTS_DIR / f"{name}.version").read_text().strip()
    except OSError:
        return None


def skip_reason(name: str) -> str | None:
    """None when ``name`` can run here, else why not (for ``pytest.skip``)."""
    if agent_binary(name) is not None:
        return None
    if (AGENTS_DIR / ".installed").exists():
        return f"{PACKAGES[name]} was installed in {AGENTS_DIR} but `{name} --version` failed there (see make agents)"
    if name == "codex" and shutil.which("node") is None:
        return ("node is not installed (the codex launcher is a node script): "
                "apt-get install nodejs npm, then make agents")
    if shutil.which("npm") is None:
        return (f"{PACKAGES[name]} is not installed and npm is missing: install Node.js >= 20 with npm "
                f"(e.g. apt-get install nodejs npm), then run make agents")
    return f"{PACKAGES[name]} is not installed in {AGENTS_DIR}: run make agents"


# -- running ------------------------------------------------------------------------------------

def _base_env(home: Path, extra_env: Mapping[str, str] | None) -> dict[str, str]:
    env = {
        "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
        "HOME": str(home),
        "LANG": os.environ.get("LANG", "C.UTF-8"),
        "TERM": "dumb",
        "NO_COLOR": "1",
        "TMPDIR": os.environ.get("TMPDIR", "/tmp"),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_DATA_HOME": str(home / ".local" / "share"),
        "XDG_STATE_HOME": str(home / ".local" / "state"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        _RUN_MARK: uuid.uuid4().hex,
    }
    env.update(extra_env or {})
    return env


def _dirs(tmp_dir: Path) -> tuple[Path, Path]:
    home, work = Path(tmp_dir) / "home", Path(tmp_dir) / "work"
    home.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    return home, work


def _marked_pids(mark: str) -> list[int]:
    needle = f"{_RUN_MARK}={mark}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def _kill_all(proc: subprocess.Popen[str], mark: str, group: bool = True) -> None:
    """SIGKILL the run's process group (``group``: only while its leader is not reaped, so that
    the id cannot have been reused) and every process that carries the run's mark."""
    if group:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if Path("/proc/self/environ").exists():
        for pid in _marked_pids(mark):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def run_bounded(cmd: Sequence[str], *, env: Mapping[str, str], cwd: Path,
                timeout: float = DEFAULT_TIMEOUT, input: str | None = None,
                ) -> subprocess.CompletedProcess[str]:
    """``subprocess.run`` in its own session (stdin: ``input``, else closed) that leaves no
    process behind."""
    mark = env.get(_RUN_MARK) or uuid.uuid4().hex
    env = {**env, _RUN_MARK: mark}
    proc = subprocess.Popen(list(cmd), env=env, cwd=cwd,
                            stdin=subprocess.DEVNULL if input is None else subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_all(proc, mark)
        try:
            stdout, stderr = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:  # a process outside the group holds the pipes open
            stdout, stderr = "", ""
            proc.wait()
        raise subprocess.TimeoutExpired(list(cmd), timeout, output=stdout, stderr=stderr) from None
    except BaseException:
        _kill_all(proc, mark)
        proc.wait()
        raise
    _kill_all(proc, mark, group=False)  # background helpers it may have left
    return subprocess.CompletedProcess(list(cmd), proc.returncode, stdout, stderr)


def _binary(name: str) -> Path:
    path = agent_binary(name)
    if path is None:
        raise FileNotFoundError(skip_reason(name))
    return path


# -- Claude Code --------------------------------------------------------------------------------

def claude_env(base_url: str, model: str, home: Path, api_key: str = DEFAULT_API_KEY) -> dict[str, str]:
    """Claude Code on ``base_url`` (``/v1/messages`` is appended): key as ``x-api-key``, every
    model alias (main, background/haiku, subagents) mapped to ``model``, no other traffic."""
    return {
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": api_key,
        "ANTHROPIC_MODEL": model,
        "ANTHROPIC_SMALL_FAST_MODEL": model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
        "CLAUDE_CODE_SUBAGENT_MODEL": model,
        "CLAUDE_CONFIG_DIR": str(home / ".claude"),
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_UPDATES": "1",
        "DISABLE_BUG_COMMAND": "1",
        "CLAUDE_CODE_DISABLE_TERMINAL_TITLE": "1",
        # Its default is 10 retries with backoff (minutes on a 5xx): a failure shows at once.
        "CLAUDE_CODE_MAX_RETRIES": "0",
    }


def run_claude(base_url: str, model: str, prompt: str, tmp_dir: Path, *,
               timeout: float = DEFAULT_TIMEOUT, continue_session: bool = False,
               api_key: str = DEFAULT_API_KEY, max_turns: int | None = 3,
               extra_args: Sequence[str] = (), extra_env: Mapping[str, str] | None = None,
               ) -> subprocess.CompletedProcess[str]:
    """``claude -p PROMPT`` (``--continue`` for a second turn). Its default tools are sent; in the
    ``dontAsk`` permission mode a tool call that would need a person's approval (Bash, edits) is
    refused instead of waiting, read-only ones run in ``tmp_dir/work``. ``max_turns`` bounds
    model requests per run (``None``: Claude Code's default); reaching it exits 1 with
    "Error: Reached max turns (N)"."""
    home, work = _dirs(tmp_dir)
    env = _base_env(home, {**claude_env(base_url, model, home, api_key), **(extra_env or {})})
    cmd = [str(_binary("claude")), "-p", "--model", model, "--permission-mode", "dontAsk"]
    if max_turns is not None:
        cmd += ["--max-turns", str(max_turns)]
    if continue_session:
        cmd.append("--continue")
    cmd += [*extra_args, "--", prompt]
    return run_bounded(cmd, env=env, cwd=work, timeout=timeout)


# -- Codex CLI ----------------------------------------------------------------------------------

def codex_config(base_url: str, model: str) -> str:
    """``$CODEX_HOME/config.toml``: a ``kvcellar`` provider on ``base_url/v1`` speaking the
    Responses API (``wire_api = "responses"``, streamed), key from ``$KVCELLAR_API_KEY``
    (``Authorization: Bearer``); no analytics, feedback or OTel export, no plugin marketplace sync
    (``git ls-remote https://github.com/openai/plugins.git`` otherwise), and connection errors
    fail the run instead of retrying forever. All keys pass ``--strict-config``."""
    return f'''model = {json.dumps(model)}
model_provider = "kvcellar"
check_for_update_on_startup = false

[model_providers.kvcellar]
name = "kvcellar"
base_url = {json.dumps(base_url.rstrip("/") + "/v1")}
wire_api = "responses"
env_key = "{API_KEY_ENV}"
request_max_retries = 0
stream_max_retries = 0

[analytics]
enabled = false

[feedback]
enabled = false

[otel]
exporter = "none"

[features]
plugins = false
unbounded_connection_retries = false
'''


def run_codex(base_url: str, model: str, prompt: str, tmp_dir: Path, *,
              timeout: float = DEFAULT_TIMEOUT, continue_session: bool = False,
              api_key: str = DEFAULT_API_KEY, extra_args: Sequence[str] = (),
              extra_env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``codex exec PROMPT`` (``codex exec resume --last PROMPT`` for a second turn), in its
    default ``exec`` policy: read-only sandbox, approval ``never`` (it just answers). The final
    answer is the last stdout line(s); the banner and transcript go to stderr. ``extra_args``
    go before the prompt (e.g. ``-c key=value``)."""
    home, work = _dirs(tmp_dir)
    codex_home = home / ".codex"
    codex_home.mkdir(exist_ok=True)
    (codex_home / "config.toml").write_text(codex_config(base_url, model))
    env = _base_env(home, {"CODEX_HOME": str(codex_home), API_KEY_ENV: api_key, **(extra_env or {})})
    cmd = [str(_binary("codex")), "exec", "--skip-git-repo-check", "--color", "never"]
    if continue_session:
        cmd += ["resume", "--last"]
    cmd += [*extra_args, "--", prompt]
    return run_bounded(cmd, env=env, cwd=work, timeout=timeout)


# -- opencode -----------------------------------------------------------------------------------

OPENCODE_VERSION_FILE = "opencode-ai/package.json"


# opencode's defaults let the model run shell commands and write files unasked; "ask" keeps
# these tools in the request ("deny" removes them) and `opencode run` auto-rejects the call
# (the run then ends, exit 0, with no answer printed).
OPENCODE_PERMISSION = {"bash": "ask", "edit": "ask", "webfetch": "ask"}


def opencode_config(base_url: str, model: str, limits: Mapping[str, int] | None = None) -> dict[str, Any]:
    """An OpenAI-compatible ``kvcellar`` provider (``@ai-sdk/openai-compatible`` is built into
    the opencode binary: nothing is installed) on ``base_url/v1`` with ``model`` as both the main
    and the small (title) model. ``limits`` (e.g. ``{"context": 8192, "output": 1024}``) become
    the model's ``limit``; without it opencode asks for ``max_tokens: 32000``."""
    entry: dict[str, Any] = {"name": model}
    if limits:
        entry["limit"] = dict(limits)
    return {
        "$schema": "https://opencode.ai/config.json",
        "provider": {"kvcellar": {
            "npm": "@ai-sdk/openai-compatible", "name": "kvcellar",
            "options": {"baseURL": base_url.rstrip("/") + "/v1", "apiKey": f"{{env:{API_KEY_ENV}}}"},
            "models": {model: entry},
        }},
        "model": f"kvcellar/{model}",
        "small_model": f"kvcellar/{model}",
        "autoupdate": False,
        "share": "disabled",
        "permission": dict(OPENCODE_PERMISSION),
    }


def _opencode_prime_config_dir(config_dir: Path) -> None:
    """opencode installs ``@opencode-ai/plugin`` into its config folder (npm registry) in the
    background unless the folder's package.json/package-lock.json already list it and
    node_modules exists; this makes it look installed (we load no plugins)."""
    version = "latest"
    try:
        version = json.loads((AGENTS_DIR / "node_modules" / OPENCODE_VERSION_FILE).read_text())["version"]
    except (OSError, ValueError, KeyError):
        pass
    (config_dir / "node_modules").mkdir(parents=True, exist_ok=True)
    deps = {"@opencode-ai/plugin": version}
    pkg = config_dir / "package.json"
    if not pkg.exists():
        pkg.write_text(json.dumps({"dependencies": deps}) + "\n")
    lock = config_dir / "package-lock.json"
    if not lock.exists():
        lock.write_text(json.dumps({"lockfileVersion": 3, "packages": {"": {"dependencies": deps}}}) + "\n")


def run_opencode(base_url: str, model: str, prompt: str, tmp_dir: Path, *,
                 timeout: float = DEFAULT_TIMEOUT, continue_session: bool = False,
                 api_key: str = DEFAULT_API_KEY, limits: Mapping[str, int] | None = None,
                 prompt_on_stdin: bool = True, config_overrides: Mapping[str, Any] | None = None,
                 extra_args: Sequence[str] = (), extra_env: Mapping[str, str] | None = None,
                 ) -> subprocess.CompletedProcess[str]:
    """``opencode run --model kvcellar/MODEL`` with PROMPT on stdin (``--continue`` for a second
    turn): a title request (small model, no tools; first turn only) and the main request, both
    streamed ``/v1/chat/completions``. The prompt goes on stdin because ``opencode run "a b"``
    sends it wrapped in double quotes (it quotes every argument that holds a space);
    ``prompt_on_stdin=False`` passes it as that argument. ``config_overrides``: top-level keys
    of opencode.json to replace (e.g. ``{"permission": {...}}``)."""
    home, work = _dirs(tmp_dir)
    config_path = Path(tmp_dir) / "opencode.json"
    config = {**opencode_config(base_url, model, limits), **(config_overrides or {})}
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    _opencode_prime_config_dir(home / ".config" / "opencode")
    env = _base_env(home, {
        "OPENCODE_CONFIG": str(config_path),
        API_KEY_ENV: api_key,
        "OPENCODE_DISABLE_MODELS_FETCH": "1",  # else models.opencode.ai/api.json
        "OPENCODE_DISABLE_AUTOUPDATE": "1",
        "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
        "OPENCODE_DISABLE_SHARE": "1",
        **(extra_env or {}),
    })
    cmd = [str(_binary("opencode")), "run", "--model", f"kvcellar/{model}"]
    if continue_session:
        cmd.append("--continue")
    cmd += extra_args
    if prompt_on_stdin:
        return run_bounded(cmd, env=env, cwd=work, timeout=timeout, input=prompt)
    return run_bounded([*cmd, "--", prompt], env=env, cwd=work, timeout=timeout)


RUNNERS = {"claude": run_claude, "codex": run_codex, "opencode": run_opencode}

# The default requests are large: about 12.4k (Claude Code), 9.3k (Codex) and 7.7k (opencode)
# SmolLM2 tokens counted over the JSON of system + tools + messages, above the embedded model's
# 8192-token context for the first two. These keep each agent's own prompt and a few of its
# tools (about 3.8k, 6.1k and 5.4k): pass them as extra_args / config_overrides.
CLAUDE_SLIM_ARGS = ("--tools", "Read,Bash")
CODEX_SLIM_ARGS = ("--disable", "multi_agent", "--disable", "goals", "-c", 'web_search="disabled"')
OPENCODE_SLIM_CONFIG = {"permission": {**OPENCODE_PERMISSION, "task": "deny", "todowrite": "deny",
                                       "skill": "deny", "webfetch": "deny"}}


def run_agent(name: str, base_url: str, model: str, prompt: str, tmp_dir: Path,
              **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``run_<name>(...)``."""
    return RUNNERS[name](base_url, model, prompt, tmp_dir, **kwargs)


def answer_text(name: str, result: subprocess.CompletedProcess[str]) -> str:
    """The agent's final answer from its stdout (all three print only the answer there)."""
    return result.stdout.strip()


FIXTURES_DIR = REPO / "tests" / "server" / "fixtures" / "agents"
FIXTURE_PREFIX = {"claude": "claude_code_messages", "codex": "codex_responses", "opencode": "opencode_chat"}


def record_fixtures(names: Sequence[str] = AGENTS, out_dir: Path = FIXTURES_DIR) -> dict[str, Any]:
    """Run each agent against the recording server and save the bodies of its requests under
    ``out_dir``: ``<prefix>.json`` (turn 1, main request), ``<prefix>_turn2.json`` (the second
    turn), ``<prefix>_tool_result.json`` (the request after a scripted tool call that reads a
    file), ``opencode_chat_title.json``; ``requests.json`` holds every request's method, path
    and headers. The runs use one fixed temporary folder so paths in prompts stay the same."""
    from tests.agent_recorder import RecordingServer, ToolCall

    out_dir.mkdir(parents=True, exist_ok=True)
    index: dict[str, Any] = {}
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / "kvcellar-agent-fixtures"

    def save(name: str, request: dict[str, Any]) -> None:
        (out_dir / f"{name}.json").write_text(json.dumps(request["body"], indent=2, ensure_ascii=False) + "\n")

    for agent in names:
        prefix = FIXTURE_PREFIX[agent]
        entries = []
        for scenario in ("turns", "tool"):
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / "work").mkdir(parents=True)
            (tmp / "work" / "hello.txt").write_text("kvcellar fixture file\n")
            file_path = str(tmp / "work" / "hello.txt")
            read = {"claude": ToolCall("Read", {"file_path": file_path}),
                    "codex": ToolCall("exec_command", {"cmd": "cat hello.txt"}),
                    "opencode": ToolCall("read", {"filePath": file_path})}[agent]
            with RecordingServer(replies=[read] if scenario == "tool" else []) as server:
                first = run_agent(agent, server.url, server.model, "Say hello.", tmp)
                if first.returncode != 0:
                    raise RuntimeError(f"{agent} failed: {first.stderr[-2000:]}")
                model_requests = [r for r in server.requests if r["method"] == "POST"]
                main = [r for r in model_requests if (r["body"] or {}).get("tools")]
                if scenario == "turns":
                    untooled = [r for r in model_requests if not (r["body"] or {}).get("tools")]
                    save(prefix, main[0])
                    if agent == "opencode" and untooled:
                        save("opencode_chat_title", untooled[0])
                    n = len(server.requests)
                    second = run_agent(agent, server.url, server.model, "And again.", tmp,
                                       continue_session=True)
                    if second.returncode != 0:
                        raise RuntimeError(f"{agent} turn 2 failed: {second.stderr[-2000:]}")
                    turn2 = [r for r in server.requests[n:] if (r["body"] or {}).get("tools")]
                    save(f"{prefix}_turn2", turn2[0])
                else:
                    save(f"{prefix}_tool_result", main[1])
                for r in server.requests:
                    headers = {k: v for k, v in r["headers"].items() if k.lower() != "host"}
                    entries.append({"scenario": scenario, "method": r["method"], "path": r["path"],
                                    "query": r["query"], "headers": headers,
                                    "body_bytes": len(json.dumps(r["body"])) if r["body"] else 0})
        index[agent] = {"version": agent_version(agent), "requests": entries}
    shutil.rmtree(tmp, ignore_errors=True)
    existing = {}
    if (out_dir / "requests.json").exists():
        existing = json.loads((out_dir / "requests.json").read_text())
    existing.update(index)
    (out_dir / "requests.json").write_text(json.dumps(existing, indent=2, ensure_ascii=False) + "\n")
    return index


if __name__ == "__main__":
    # python -m tests.coding_agents [AGENT...]: two turns of each installed agent against the recorder;
    # python -m tests.coding_agents --record [AGENT...]: record tests/server/fixtures/agents again.
    import sys
    import tempfile

    from tests.agent_recorder import CANNED_TEXT, RecordingServer

    if sys.argv[1:2] == ["--record"]:
        record_fixtures(sys.argv[2:] or AGENTS)
        sys.exit(0)
    names = sys.argv[1:] or list(AGENTS)
    for name in names:
        if (reason := skip_reason(name)) is not None:
            print(f"{name}: skipped: {reason}")
            continue
        with RecordingServer() as server, tempfile.TemporaryDirectory() as tmp:
            t0 = time.monotonic()
            first = run_agent(name, server.url, server.model, "Say hello.", Path(tmp))
            t1 = time.monotonic()
            second = run_agent(name, server.url, server.model, "And again.", Path(tmp),
                               continue_session=True)
            t2 = time.monotonic()
            ok = [r.returncode == 0 and CANNED_TEXT in r.stdout for r in (first, second)]
            print(f"{name}: turn 1 rc={first.returncode} ok={ok[0]} {t1 - t0:.1f}s; "
                  f"turn 2 rc={second.returncode} ok={ok[1]} {t2 - t1:.1f}s; requests: "
                  + ", ".join(f"{r['method']} {r['path']}" for r in server.requests))
            if not all(ok):
                print(first.stdout[-2000:], first.stderr[-2000:], second.stdout[-2000:],
                      second.stderr[-2000:], sep="\n---\n")
