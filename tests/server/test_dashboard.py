"""The live dashboard on SmolLM2-135M: its feed shows the running batch and the KV blocks while
requests run, only while watched; the page and feed need the API key (header or session cookie);
and in headless Chromium the page draws the batch changing under a load of 16 streams."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import shutil
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import msgspec
import pytest
import torch
from itsdangerous import TimestampSigner
from prometheus_client.parser import text_string_to_metric_families
from starlette.requests import Request

from iterserve.engine.messages import KV_CACHED, KV_FIRST_ROW, KV_FREE, LoadedWeights, SchedulerStats
from iterserve.server import dashboard as dashboard_module
from iterserve.server.dashboard import COOKIE, SessionAuth
from iterserve.server.errors import APIError
from tests.server.conftest import API_KEY, MODEL, ServerThread, speculating_server, wait_until_idle

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


def frames(server: ServerThread, headers: dict[str, str], stop: threading.Event) -> Iterator[dict | None]:
    """The feed's frames (None for a keep-alive) until ``stop`` is set (checked as they arrive)."""
    with httpx.stream("GET", f"{server.url}/dashboard/events", headers=headers, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                yield json.loads(line.removeprefix("data: "))
            elif line.startswith(":"):
                yield None
            if stop.is_set():
                return


def stream_completion(server: ServerThread, prompt: str, max_tokens: int) -> int:
    """One streaming completion; returns the chunks received."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=300) as r:
        assert r.status_code == 200
        return sum(1 for line in r.iter_lines() if line.startswith("data: {"))


class Load:
    """``streams`` concurrent streaming requests of different lengths, started ``stagger_s`` apart so
    that requests join and leave the batch at different steps; ``wait`` checks every one completed."""

    def __init__(self, server: ServerThread, streams: int, stagger_s: float = 0.0, max_tokens: int = 16) -> None:
        self.pool = ThreadPoolExecutor(streams)
        self.futures = []
        for i in range(streams):
            self.futures.append(self.pool.submit(stream_completion, server, f"Request {i} asks about {i * 7}:",
                                                 max_tokens + 4 * (i % 8)))
            time.sleep(stagger_s)

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def wait(self) -> None:
        self.pool.shutdown()
        assert all(f.result() > 0 for f in self.futures)


# -- the feed ----------------------------------------------------------------------------------------


@pytest.fixture
def quick_keepalive(monkeypatch):
    """Idle feeds speak every 0.5 s, so a test waiting on one never waits long."""
    monkeypatch.setattr(dashboard_module, "KEEPALIVE_S", 0.5)


def test_feed_shows_the_batch_and_kv_blocks_while_requests_run(server, quick_keepalive):
    wait_until_idle(server)
    dashboard = server.engine.step_observer
    stop = threading.Event()
    seen_rows: set[str] = set()
    kv_in_use = 0
    first = None
    running = None
    deadline = time.monotonic() + 120
    for frame in frames(server, AUTH, stop):
        assert time.monotonic() < deadline, f"saw rows {seen_rows} and at most {kv_in_use} KV cells in use"
        if frame is None:
            if running is not None and running.done():
                stop.set()
            continue
        if first is None:
            first = frame
            assert frame["facts"]["served_model_name"] == MODEL and frame["facts"]["capacity"]["num_blocks"] == 256
            # the device in use, never the unset default ("auto" on the page)
            assert frame["facts"]["engine"]["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
            assert frame["facts"]["engine"]["dtype"] == "float32"
            assert dashboard.viewers == 1 and server.engine.is_running
            running = Load(server, 4, max_tokens=16)
        if "step" in frame:
            seen_rows.update(row[0] for row in frame["step"]["seqs"])
        if "kv" in frame:
            _, blocks = frame["kv"]
            kv_in_use = max(kv_in_use, sum(b >= KV_FIRST_ROW for b in base64.b64decode(blocks)))
        if (len(seen_rows) >= 4 and kv_in_use >= 4) or (running is not None and running.done()):
            stop.set()
    assert running is not None
    running.wait()
    assert kv_in_use >= 4  # each running request holds at least one block of its own
    assert all(rid.startswith("cmpl-") for rid in seen_rows)
    deadline = time.monotonic() + 10
    while dashboard.viewers and time.monotonic() < deadline:  # the server notices the closed feed
        time.sleep(0.05)
    assert dashboard.viewers == 0
    wait_until_idle(server)
    assert dashboard.series and sum(b.steps for b in dashboard.series) > 0
    assert len(dashboard.latencies) >= 4 and all(ttft > 0 and e2e >= ttft for ttft, _, e2e in dashboard.latencies)


class _Engine:
    """What the dashboard reads of the engine client."""

    num_waiting = 0
    weights: list[LoadedWeights] = []

    def __init__(self) -> None:
        self.watching: list[bool] = []

    def watch_kv(self, on: bool) -> None:
        self.watching.append(on)


def _stats(steps: int) -> SchedulerStats:
    return SchedulerStats(1, 0, steps, 0.5, steps, 0, 10, steps, 0, 0, 1)


def test_a_crowd_of_viewers_costs_one_frame_per_tick_and_a_limit(monkeypatch):
    """Each tick builds what changed once for every page (and the whole state once for pages just
    opened), so 50 viewers cost the event loop what one does; past ``max_viewers``, 429."""

    async def crowd() -> None:
        engine = _Engine()
        dash = dashboard_module.Dashboard(engine, {"model": "m"}, max_viewers=50)  # type: ignore[arg-type]
        built = 0
        frame = dash.frame

        def counted(cursor):
            nonlocal built
            built += 1
            return frame(cursor)

        monkeypatch.setattr(dash, "frame", counted)
        feeds = [dash.events(dash.open_feed()) for _ in range(50)]
        with pytest.raises(APIError) as refused:
            dash.open_feed()
        assert refused.value.status_code == 429 and refused.value.code == "too_many_viewers"
        first = await asyncio.gather(*(f.__anext__() for f in feeds))
        assert all(json.loads(f.removeprefix(b"data: "))["facts"] == {"model": "m", "weights": []} for f in first)
        assert built <= 4  # not one per viewer
        for steps in (1, 2):
            built = 0
            dash.record_step(None, None, _stats(steps))
            frames = await asyncio.gather(*(f.__anext__() for f in feeds))
            assert {json.loads(f.removeprefix(b"data: "))["stats"]["steps"] for f in frames} == {steps}
            assert built == 1
        for f in feeds:
            await f.aclose()
        assert dash.viewers == 0 and engine.watching == [True, False]
        again = dash.events(dash.open_feed())  # a page after the crowd left gets the whole state again
        assert b'"facts"' in await asyncio.wait_for(again.__anext__(), 5)
        await again.aclose()

    asyncio.run(crowd())


def test_the_stats_carry_speculative_decoding_only_when_it_is_on():
    plain = dashboard_module.Dashboard(_Engine(), {})  # type: ignore[arg-type]
    plain.record_step(None, None, _stats(3))
    assert "spec" not in plain.frame(dashboard_module._Cursor())["stats"]
    spec = dashboard_module.Dashboard(_Engine(), {}, speculative=True)  # type: ignore[arg-type]
    spec.record_step(None, None, _stats(1))  # nothing verified yet: no rate to show
    assert spec.frame(dashboard_module._Cursor())["stats"]["spec"] == {
        "drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "acceptance_rate": None, "mean_accepted_length": None}
    stats = msgspec.structs.replace(_stats(9), spec_num_drafts=4, spec_num_draft_tokens=12, spec_num_accepted_tokens=6)
    spec.record_step(None, None, stats)
    assert spec.frame(dashboard_module._Cursor())["stats"]["spec"] == {
        "drafts": 4, "draft_tokens": 12, "accepted_tokens": 6, "acceptance_rate": 0.5, "mean_accepted_length": 2.5}


def test_the_stats_name_the_lora_adapters_while_requests_use_them():
    board = dashboard_module.Dashboard(_Engine(), {})  # type: ignore[arg-type]
    board.record_step(None, None, _stats(3))
    assert "loras" not in board.frame(dashboard_module._Cursor())["stats"]
    board.record_step(None, None, msgspec.structs.replace(_stats(4), running_loras=["a", "b"], waiting_loras=["c"]))
    assert board.frame(dashboard_module._Cursor())["stats"]["loras"] == {"running": ["a", "b"], "waiting": ["c"]}


@pytest.fixture(scope="module")
def spec_server() -> Iterator[tuple[ServerThread, dict[str, float]]]:
    """A server with n-gram speculation after one completion, and its /metrics samples then."""
    with speculating_server() as s:
        metrics = {sample.name: sample.value for family in text_string_to_metric_families(httpx.get(
            f"{s.url}/metrics").text) for sample in family.samples}
        yield s, metrics


def test_the_feed_shows_the_servers_speculative_decoding_counters(spec_server):
    s, metrics = spec_server
    stop = threading.Event()
    stop.set()  # the first frame is the whole state
    shown = next(f for f in frames(s, {}, stop) if f is not None)["stats"]["spec"]
    assert shown["drafts"] == metrics["vllm:spec_decode_num_drafts_total"] > 0
    assert shown["draft_tokens"] == metrics["vllm:spec_decode_num_draft_tokens_total"]
    assert shown["accepted_tokens"] == metrics["vllm:spec_decode_num_accepted_tokens_total"]
    assert shown["acceptance_rate"] == pytest.approx(shown["accepted_tokens"] / shown["draft_tokens"])
    assert shown["mean_accepted_length"] == pytest.approx(1 + shown["accepted_tokens"] / shown["drafts"])


def test_an_idle_pool_shows_free_blocks_once_watched(server, quick_keepalive):
    """Opening the feed on an idle server brings a snapshot at once: every block is free or cached."""
    wait_until_idle(server)
    stop = threading.Event()
    deadline = time.monotonic() + 30
    for frame in frames(server, AUTH, stop):
        assert time.monotonic() < deadline, "no KV snapshot came"
        if frame is not None and "kv" in frame:
            blocks = base64.b64decode(frame["kv"][1])
            assert len(blocks) == 256 and set(blocks) <= {KV_FREE, KV_CACHED} and KV_FREE in blocks
            break


# -- the API key -----------------------------------------------------------------------------------


def test_the_page_and_feed_need_the_key_or_a_session_cookie(server):
    with httpx.Client(base_url=server.url, timeout=30) as anonymous:
        page = anonymous.get("/dashboard")
        assert page.status_code == 401 and "API key" in page.text  # the page shows its login form
        assert page.headers["www-authenticate"] == "Bearer"
        assert "default-src 'self'" in page.headers["content-security-policy"]  # no CDN can run on it
        assert anonymous.get("/dashboard/events").status_code == 401
        assert anonymous.post("/dashboard/session", json={}).status_code == 401
        assert anonymous.post("/dashboard/session", json={}, headers={"Authorization": "Bearer nope"}).status_code \
            == 401
        assert anonymous.get("/dashboard/static/dashboard.js").status_code == 200  # code, no data
        assert anonymous.get("/dashboard/static/nothing.js").status_code == 404
        assert anonymous.get("/dashboard", headers={"Cookie": f"{COOKIE}=99999999999.forged"}).status_code == 401
    with httpx.Client(base_url=server.url, timeout=30) as browser:
        login = browser.post("/dashboard/session", json={}, headers=AUTH)
        assert login.status_code == 204 and "httponly" in login.headers["set-cookie"].lower()
        assert browser.get("/dashboard").status_code == 200  # the cookie alone lets the page in
        with browser.stream("GET", "/dashboard/events") as feed:
            assert feed.status_code == 200
            line = next(line for line in feed.iter_lines() if line.startswith("data: "))
            assert "facts" in json.loads(line.removeprefix("data: "))
    assert httpx.get(f"{server.url}/dashboard", headers=AUTH).status_code == 200


def cookie_request(value: str) -> Request:
    return Request({"type": "http", "headers": [(b"cookie", f"{COOKIE}={value}".encode())]})


def test_a_session_cookie_is_signed_with_the_key_and_expires(monkeypatch):
    auth = SessionAuth("sk-test")
    token = auth.token()
    assert TimestampSigner(b"sk-test", salt="dashboard-session").unsign(token) == b"dashboard"  # itsdangerous'
    assert auth.allows(cookie_request(token))
    assert not SessionAuth("another key").allows(cookie_request(token))
    assert not auth.allows(cookie_request(token[:-2] + ("AA" if not token.endswith("AA") else "BB")))
    assert not auth.allows(cookie_request("99999999999.forged")) and not auth.allows(cookie_request(""))
    later = time.time() + dashboard_module.SESSION_TTL_S + 5
    monkeypatch.setattr(time, "time", lambda: later)  # what itsdangerous reads the cookie's age against
    assert not auth.allows(cookie_request(token))


# -- in a browser ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium from the system (Debian's chromium package; .ci/run installs it), through Playwright."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        if os.environ.get("CI"):
            raise
        pytest.skip("playwright is not installed (pip install 'iterserve[test]')")
    if not os.path.exists(CHROMIUM):
        if os.environ.get("CI"):
            raise AssertionError(f"{CHROMIUM} is missing: .ci/run installs Debian's chromium package")
        pytest.skip("no system Chromium (apt-get install chromium)")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM)
        yield browser
        browser.close()


BATCH_ROWS = "() => [...document.querySelectorAll('#batch tr')].map((tr) => tr.textContent)"


def test_browser_sees_the_batch_change_and_kv_cells_in_use_under_16_streams(server, browser, tmp_path):
    wait_until_idle(server)
    # bypass_csp: Playwright's waits evaluate strings, which the page's policy (checked above) forbids
    context = browser.new_context(viewport={"width": 1280, "height": 1100}, extra_http_headers=AUTH, bypass_csp=True)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    assert page.goto(f"{server.url}/dashboard").status == 200
    page.wait_for_selector("#panels:not([hidden])")
    running = Load(server, 16, stagger_s=0.05, max_tokens=8)
    try:
        page.wait_for_function("document.querySelectorAll('#batch tr').length >= 4", timeout=60_000)
        first = page.evaluate(BATCH_ROWS)
        page.wait_for_function(f"(before) => JSON.stringify(({BATCH_ROWS})()) !== JSON.stringify(before)", arg=first,
                               timeout=30_000)
        second = page.evaluate(BATCH_ROWS)
        assert first != second  # the rows moved on: tokens advanced, requests joined or left
        page.wait_for_function("Number(document.getElementById('kv').dataset.used) >= 4", timeout=30_000)
        assert int(page.get_attribute("#kv", "data-total")) == 256
        # the picture once the first requests have finished: latencies drawn, the longer ones still running
        page.wait_for_function("document.getElementById('caption-ttft').textContent.includes('p50')", timeout=60_000)
        page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
    finally:
        running.wait()
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000
    assert not errors
    context.close()


def test_browser_login_prompt_takes_the_key(server, browser):
    context = browser.new_context(bypass_csp=True)
    page = context.new_page()
    assert page.goto(f"{server.url}/dashboard").status == 401
    page.wait_for_selector("#login:not([hidden])")
    assert page.is_hidden("#panels")
    page.fill("#key", "wrong")
    page.click("#login button")
    page.wait_for_function("document.getElementById('login-error').textContent.length > 0")
    page.fill("#key", API_KEY)
    page.click("#login button")
    page.wait_for_selector("#panels:not([hidden])")
    page.wait_for_function("document.getElementById('facts').textContent.includes('KV bytes per token')")
    assert "continuous batching: requests join and leave the batch at every step" in page.inner_text("#facts")
    assert re.search(r"weights\s+\d+\.\d MB \(quantization none\): float32: \d+ tensors", page.inner_text("#facts"))
    assert page.is_hidden("#login") and page.is_hidden("#spec-panel")  # no speculation on this server
    assert page.reload().status == 200  # the session cookie lets the page itself in now
    context.close()


def test_browser_shows_speculative_decoding(spec_server, browser):
    s, metrics = spec_server
    context = browser.new_context(bypass_csp=True)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    assert page.goto(f"{s.url}/dashboard").status == 200
    page.wait_for_selector("#spec-panel:not([hidden])")
    rows = dict(tuple(td.inner_text() for td in tr.query_selector_all("td"))
                for tr in page.query_selector_all("#spec tr"))
    drafts = metrics["vllm:spec_decode_num_drafts_total"]
    accepted = metrics["vllm:spec_decode_num_accepted_tokens_total"]
    assert rows["drafts verified"] == str(int(drafts)) and rows["accepted tokens"] == str(int(accepted))
    assert rows["mean accepted length"] == f"{1 + accepted / drafts:.2f} tokens per pass"
    assert rows["acceptance rate"].endswith("%") and not errors


# every label a chart draws: where its text starts and ends, and its canvas' width (in CSS pixels)
RECORD_LABELS = """
window.labels = [];
const fillText = CanvasRenderingContext2D.prototype.fillText;
CanvasRenderingContext2D.prototype.fillText = function (text, x, y, ...rest) {
  const width = this.measureText(text).width;
  const start = this.textAlign === "center" ? x - width / 2 : this.textAlign === "right" ? x - width : x;
  window.labels.push({text: String(text), canvas: this.canvas.id, start, end: start + width,
                      width: this.canvas.width / (window.devicePixelRatio || 1)});
  return fillText.call(this, text, x, y, ...rest);
};
"""


def test_browser_chart_labels_fit_their_canvas(server, browser):
    """The time axis' last label, "now", is drawn whole (it was cut to "nov" at the canvas' right edge)."""
    context = browser.new_context(viewport={"width": 1280, "height": 1100}, extra_http_headers=AUTH, bypass_csp=True)
    page = context.new_page()
    page.add_init_script(RECORD_LABELS)
    assert page.goto(f"{server.url}/dashboard").status == 200
    page.wait_for_function("window.labels.some((l) => l.text === 'now')", timeout=30_000)
    labels = page.evaluate("window.labels.filter((l) => l.canvas.startsWith('chart-'))")
    assert any(label["text"] == "now" for label in labels)
    outside = [label for label in labels if label["start"] < 0 or label["end"] > label["width"] + 0.5]
    assert not outside
    page.wait_for_function("document.getElementById('facts').textContent.includes('precision, device')")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert f", {device}" in page.inner_text("#facts")
    context.close()
