"""The built documentation site in a real browser: headless Chromium opens the landing
page and a guide, and the navigation, the page's own contents and the search (a query's
results) render. Screenshots of both pages go to ``build/docs-screenshots/``.

Needs Debian's ``chromium``; ``.ci/docs-browser`` installs it and runs these tests
(marker ``browser``, left out of CI's e2e command)."""

from __future__ import annotations

import asyncio
import base64
import functools
import http.server
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.browser]

ROOT = Path(__file__).resolve().parents[2]
SHOTS = ROOT / "build" / "docs-screenshots"


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.fail(
            "Chromium is not installed: `apt-get install chromium` (Debian), or run "
            ".ci/docs-browser, which installs it and runs these tests"
        )
    return found


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site, built strictly, served over HTTP (the search loads its index with a
    request, which a file:// page may not make)."""
    out = tmp_path_factory.mktemp("site")
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
        cwd=ROOT, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-4000:]
    handler = functools.partial(_QuietHandler, directory=str(out))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


class _Browser:
    """Headless Chromium driven over its DevTools protocol (aiohttp's websocket, which
    Ray's [default] extra brings): open a page, wait until a script's value is true,
    evaluate, screenshot."""

    def __init__(self, profile: Path) -> None:
        self.process = subprocess.Popen(
            [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             "--window-size=1280,900", "--remote-debugging-port=0",
             f"--user-data-dir={profile}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not port_file.is_file() or not port_file.read_text().strip():
            assert self.process.poll() is None, "Chromium exited at start"
            assert time.monotonic() < deadline, "Chromium opened no DevTools port in 60 s"
            time.sleep(0.2)
        self.port = int(port_file.read_text().split()[0])
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(self._connect())
        self.next_id = 0

    async def _connect(self) -> None:
        import aiohttp

        self.session = aiohttp.ClientSession()
        async with self.session.get(f"http://127.0.0.1:{self.port}/json/list") as reply:
            pages = [t for t in await reply.json() if t["type"] == "page"]
        self.ws = await self.session.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=0)

    async def _call(self, method: str, **params):
        self.next_id += 1
        await self.ws.send_json({"id": self.next_id, "method": method, "params": params})
        while True:
            message = await self.ws.receive_json(timeout=120)
            if message.get("id") == self.next_id:
                assert "error" not in message, message["error"]
                return message["result"]

    def call(self, method: str, **params):
        return self.loop.run_until_complete(self._call(method, **params))

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")

    def open(self, url: str, ready: str, timeout_s: float = 60.0) -> None:
        """Navigate to ``url`` and wait until the script ``ready`` is true."""
        self.call("Page.navigate", url=url)
        deadline = time.monotonic() + timeout_s
        while not self.evaluate(f"document.readyState === 'complete' && !!({ready})"):
            assert time.monotonic() < deadline, f"{url}: not ready in {timeout_s:.0f} s: {ready}"
            time.sleep(0.25)

    def screenshot(self, name: str) -> Path:
        SHOTS.mkdir(parents=True, exist_ok=True)
        path = SHOTS / name
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot")["data"]))
        assert path.stat().st_size > 20_000, f"{path}: {path.stat().st_size} bytes, blank?"
        return path

    def close(self) -> None:
        async def shut() -> None:
            await self.ws.close()
            await self.session.close()

        self.loop.run_until_complete(shut())
        self.loop.close()
        self.process.terminate()
        self.process.wait(timeout=30)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    chromium = _Browser(tmp_path_factory.mktemp("chromium"))
    yield chromium
    chromium.close()


def test_the_landing_page_renders_its_navigation(site, browser):
    browser.open(f"{site}/", "document.querySelector('.md-tabs')")
    tabs = browser.evaluate(
        "[...document.querySelectorAll('.md-tabs__link')].map(a => a.textContent.trim())"
    )
    assert tabs == ["Get started", "Guides", "Reference", "Results"]
    links = browser.evaluate("document.querySelectorAll('.md-nav--primary .md-nav__link').length")
    assert links >= 20  # every page's entry in the navigation drawer
    assert browser.evaluate("document.querySelector('h1').firstChild.textContent") == "ray_credit"
    assert browser.evaluate("!!document.querySelector('.md-search__input')")
    browser.screenshot("landing.png")


def test_a_guide_renders_with_its_table_of_contents(site, browser):
    browser.open(f"{site}/retrieval/", "document.querySelector('.md-nav--secondary')")
    toc = browser.evaluate("document.querySelectorAll('.md-nav--secondary .md-nav__link').length")
    assert toc >= 5  # the guide's own sections
    assert "wiki-18" in browser.evaluate("document.querySelector('article').textContent")
    browser.screenshot("guide-retrieval.png")


def test_the_search_finds_a_setting(site, browser):
    # Material runs the query of the page's ?q= once its search index has loaded
    items = "document.querySelectorAll('.md-search-result__item')"
    browser.open(f"{site}/?q=micro_batch_tokens", f"{items}.length > 0", timeout_s=90)
    hrefs = browser.evaluate(
        "[...document.querySelectorAll('.md-search-result__link')].map(a => a.href)"
    )
    assert any("/reference/config/" in h for h in hrefs), hrefs[:5]
    browser.screenshot("search.png")
