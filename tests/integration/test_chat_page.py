"""The chat page at / (daemon/api/web_ui.py) in headless Chromium, against the daemon on the
embedded model behind an API key: the page loads, takes the key, streams an answer and shows it at
its reader's pace, and posts read cursors that the front and the engine's modelled buffer follow
(read back through /v1/requests/{id}). `--no-web-ui` serves no page.

Chromium is Debian's (`.ci/run` installs it) or Playwright's own; without either the page tests
skip and say why. CHAT_PAGE_SCREENSHOT=PATH saves the page as it looks mid-answer
(docs/chat_page.png was made so).
"""
from __future__ import annotations

import os
import shutil
import time

import httpx
import pytest
from daemon import Daemon

playwright = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (the test extra)")

KEY = "page-test-key"
RATE = 20  # tokens/s the page's reader reads: slower than the model writes, so text waits to be shown
MAX_TOKENS = 150


def chromium() -> str | None:
    """Debian's Chromium, else None (then Playwright's own browser, if it was installed)."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


@pytest.fixture(scope="module")
def browser():
    with playwright.sync_playwright() as p:
        try:
            b = p.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
        except playwright.Error as e:
            pytest.skip(f"no Chromium to drive: {str(e).splitlines()[0]} (apt-get install chromium)")
        yield b
        b.close()


@pytest.fixture(scope="module")
def daemon():
    d = Daemon("--dtype", "float32", "--quantization", "none", "--kv-cache-memory", "128MiB",
               env={"TOKENFLOWD_API_KEY": KEY})
    yield d
    d.stop()


def test_the_page_streams_at_its_readers_pace_and_its_cursor_drives_the_engines_buffer(browser, daemon):
    # the page's CSP forbids eval, which Playwright's waits use: the test's context bypasses it
    page = browser.new_context(bypass_csp=True, viewport={"width": 1100, "height": 700}).new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    r = page.goto(f"{daemon.base_url}/?max_tokens={MAX_TOKENS}")
    assert r.status == 200 and "script-src 'self'" in r.headers["content-security-policy"]
    # behind the key: the page says so until the key is typed
    page.wait_for_function("window.tokenflowd && window.tokenflowd.error.startsWith('401')")
    page.fill("#key", KEY)
    page.dispatch_event("#key", "change")
    page.wait_for_function("window.tokenflowd.model !== null")
    assert page.inner_text("#model") == "smollm2-135m"
    page.fill("#rate", str(RATE))
    page.fill("#prompt", "Tell me a short story about a lighthouse keeper.")
    # the page tells the server what its reader has read, while the answer streams: the test reads
    # the engine's view as soon as the first cursor is answered (the answer takes seconds longer)
    with page.expect_response(lambda r: r.url.endswith("/read") and r.request.method == "POST",
                              timeout=60_000) as posted:
        page.click("#send")
    cursor = posted.value.json()
    rid = cursor["id"]
    info = httpx.get(f"{daemon.base_url}/v1/requests/{rid}", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert cursor["accepted"] and 0 < cursor["read_tokens"] <= cursor["delivered_tokens"], cursor
    assert info.status_code == 200, info.text
    info = info.json()
    assert info["read_tokens"] >= cursor["read_tokens"]
    # the engine models the buffer from the cursor on: no more unread than it has written
    # (tokens it holds back to pace the stream included) less what was read
    assert info["buffer_tokens"] <= info["num_output_tokens"] - info["read_tokens"] + 1, info
    started, first = time.monotonic(), page.evaluate("window.tokenflowd.shown")
    state = page.evaluate("window.tokenflowd")
    assert state["requestId"] == rid and state["read"] > 0 and state["cursorsPosted"] >= 1, state
    if os.environ.get("CHAT_PAGE_SCREENSHOT"):
        page.wait_for_timeout(2500)
        page.screenshot(path=os.environ["CHAT_PAGE_SCREENSHOT"])
    page.wait_for_function("!window.tokenflowd.streaming", timeout=120_000)
    # the whole answer is shown in the end, at the reader's pace
    deadline = time.monotonic() + MAX_TOKENS / RATE + 30
    while page.evaluate("window.tokenflowd.shown < window.tokenflowd.delivered") and time.monotonic() < deadline:
        page.wait_for_timeout(500)
    state = page.evaluate("window.tokenflowd")
    assert state["shown"] == state["delivered"] > 0, state
    # never faster than its reader: RATE tokens/s at most (a bound, not a speed the test needs)
    assert state["shown"] - first <= RATE * (time.monotonic() - started) + 1, (state, time.monotonic() - started)
    assert page.inner_text(".assistant").strip(), "the answer is on the page"
    assert not errors, errors
    page.close()


def test_the_page_can_be_turned_off(tmp_path):
    d = Daemon("--dtype", "float32", "--quantization", "none", "--kv-cache-memory", "64MiB", "--no-web-ui")
    try:
        assert d.http.get("/").status_code == 404
        assert d.http.get("/ui/chat.js").status_code == 404
        assert d.http.get("/health").status_code == 200
    finally:
        d.stop()
