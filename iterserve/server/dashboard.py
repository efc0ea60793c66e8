"""The live dashboard: ``GET /dashboard`` and its feed, drawn from the engine core's step records.

The core sends every step's :class:`StepStats` (the step trace's schema) with its outputs and,
while at least one dashboard is open, a snapshot of every KV block's state, at most ten a second
and fewer when the pool is large (:meth:`EngineCore.kv_snapshot`). :class:`Dashboard` keeps what
the page draws: the last step's batch, the last snapshot, half-second buckets of the last five
minutes and the latencies of the last requests. One feed task turns that state into frames at most
every ``FRAME_INTERVAL_S``: each tick encodes what is new since the last tick once, for every open page,
and the whole state once more only when pages have just opened (or fell behind), so a crowd of viewers
costs the event loop one frame per tick, not one per viewer. At most ``max_viewers`` feeds are open at
once; more get 429.

With an API key, the page and its feed need it. A browser cannot put a header on a page load, so
the page posts the key once (``POST /dashboard/session``, behind the server's key check like every
route) and gets an HttpOnly cookie holding its time signed with the key (itsdangerous); the page and the feed
take either the ``Authorization: Bearer`` header or that cookie. The page and its scripts are
package files (no CDN); without the key the page answers 401 and shows only its login form.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from importlib import resources
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from itsdangerous import BadSignature, TimestampSigner
from starlette.background import BackgroundTask

from iterserve import __version__
from iterserve.engine.core_client import EngineCoreClient
from iterserve.engine.messages import KVSnapshot, SchedulerStats, StepStats
from iterserve.engine.spec_decode.stats import acceptance_rate, mean_accepted_length
from iterserve.outputs import RequestOutput
from iterserve.server.auth import bearer_matches
from iterserve.server.errors import APIError

PAGE = "/dashboard"
EVENTS = "/dashboard/events"
SESSION = "/dashboard/session"
STATIC = "/dashboard/static/"
COOKIE = "iterserve_dashboard"
SESSION_TTL_S = 12 * 3600
SESSION_SALT = "dashboard-session"  # a signature for the dashboard's cookie is good for nothing else
FRAME_INTERVAL_S = 0.1  # a page gets at most ten frames a second, however fast the engine steps
KEEPALIVE_S = 15.0  # an idle feed sends a comment this often, so a page that left is noticed
BUCKET_S = 0.5  # the time series' resolution
SERIES_SPAN_S = 300.0  # ... and how far back it goes
RECENT_REQUESTS = 500  # finished requests whose latencies the histograms draw
STATIC_TYPES = {"index.html": "text/html; charset=utf-8", "dashboard.js": "text/javascript; charset=utf-8",
                "dashboard.css": "text/css; charset=utf-8"}
# Only this server's own files run on the page; nothing is fetched from elsewhere.
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'self'; base-uri 'none'; form-action 'none'; "
                                           "frame-ancestors 'none'", "Cache-Control": "no-store"}


def checks_own_key(path: str) -> bool:
    """Dashboard paths that the server's API-key middleware lets through: the page and the feed check
    the key themselves (they also take the session cookie), and the scripts hold no data."""
    return path in (PAGE, EVENTS) or path.startswith(STATIC)


@dataclass
class Bucket:
    """The steps that began in one BUCKET_S slice of time."""

    start: float  # time.perf_counter (the core's clock: the same across processes)
    steps: int = 0
    tokens: int = 0  # computed: prefill chunks and decodes
    decode_tokens: int = 0
    running: int = 0  # most running after a step
    waiting: int = 0  # most waiting after a step
    kv_blocks: int = 0  # most KV blocks held after a step
    preemptions: int = 0

    def add(self, step: StepStats) -> None:
        self.steps += 1
        self.tokens += step.num_prefill_tokens + step.num_decode_tokens
        self.decode_tokens += step.num_decode_tokens
        self.running = max(self.running, step.num_running)
        self.waiting = max(self.waiting, step.num_waiting)
        self.kv_blocks = max(self.kv_blocks, step.kv_blocks_used)
        self.preemptions += step.num_preemptions


@dataclass
class _Cursor:
    """What one page has been sent."""

    version: int = -1
    step: int = -1
    kv: int = 0
    buckets: int = 0
    finished: int = 0


class Dashboard:
    """The state every open page draws, fed by the engine client on the event loop (a StepObserver).
    With ``speculative`` (the engine drafts tokens) the stats carry the spec-decode counters too."""

    def __init__(self, engine: EngineCoreClient, facts: dict[str, Any], max_viewers: int = 16,
                 speculative: bool = False) -> None:
        self.engine = engine
        self.facts = facts
        self.max_viewers = max_viewers
        self.speculative = speculative
        self.stats: SchedulerStats | None = None
        self.step: StepStats | None = None
        self.kv: KVSnapshot | None = None
        self.num_kv = 0  # snapshots received: a page's cursor
        self.series: deque[Bucket] = deque(maxlen=int(SERIES_SPAN_S / BUCKET_S))
        self.num_buckets = 0  # buckets ever opened
        self.latencies: deque[tuple[float | None, float | None, float | None]] = deque(maxlen=RECENT_REQUESTS)
        self.num_finished = 0
        self.viewers = 0
        self._version = 0
        self._changed = asyncio.Event()
        # the feed: the latest tick's number and its frames (what is new since the tick before, and the
        # whole state when some page needs it), and the pages waiting for the whole state
        self._tick = 0
        self._frames: tuple[bytes | None, bytes | None] = (None, None)
        self._ticked = asyncio.Event()
        self._joining = 0
        self._feed: asyncio.Task[None] | None = None

    # -- fed by the engine client ---------------------------------------------------------------

    def record_step(self, step: StepStats | None, kv: KVSnapshot | None, stats: SchedulerStats) -> None:
        self.stats = stats
        if step is not None:
            self.step = step
            slot = step.start - step.start % BUCKET_S
            if not self.series or self.series[-1].start != slot:
                self.series.append(Bucket(slot))
                self.num_buckets += 1
            self.series[-1].add(step)
        if kv is not None and self.viewers:  # one sent before the last page left is stale
            self.kv = kv
            self.num_kv += 1
        self._wake()

    def record_finished(self, output: RequestOutput) -> None:
        m = output.metrics
        self.latencies.append((m.ttft, m.tpot, m.e2e_latency))
        self.num_finished += 1
        self._wake()

    def _wake(self) -> None:
        self._version += 1
        self._nudge()

    def _nudge(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # -- read by the pages ----------------------------------------------------------------------

    def frame(self, cursor: _Cursor) -> dict[str, Any] | None:
        """What is new for the page at ``cursor`` (everything on its first frame); None if nothing is."""
        if cursor.version == self._version:
            return None
        frame: dict[str, Any] = {"now": time.perf_counter(), "viewers": self.viewers}
        if cursor.version < 0:  # the weights are known once the core is ready, after the facts were taken
            weights = [msgspec.structs.asdict(w) for w in self.engine.weights]
            frame["facts"] = {**self.facts, "weights": weights}
        cursor.version = self._version
        if self.stats is not None:
            s = self.stats
            frame["stats"] = {"running": s.num_running, "waiting": self.engine.num_waiting,
                              "kv_usage": s.kv_cache_usage, "steps": s.num_steps, "preemptions": s.num_preemptions,
                              "generation_tokens": s.num_generation_tokens}
            if self.speculative:
                frame["stats"]["spec"] = spec_stats(s)
            if s.running_loras or s.waiting_loras:  # the adapters' names, as vllm:lora_requests_info has them
                frame["stats"]["loras"] = {"running": s.running_loras, "waiting": s.waiting_loras}
        if self.step is not None and self.step.step != cursor.step:
            frame["step"] = self.step
            cursor.step = self.step.step
        if self.kv is not None and self.num_kv != cursor.kv:
            frame["kv"] = self.kv  # bytes travel as base64 in JSON
            cursor.kv = self.num_kv
        if self.num_buckets:
            first = self.num_buckets - len(self.series)  # the absolute index of series[0]
            since = max(cursor.buckets - 1, first)  # the last bucket sent may have grown since
            frame["series"] = [dataclasses.astuple(b) for b in list(self.series)[since - first:]]
            cursor.buckets = self.num_buckets
        new = min(self.num_finished - cursor.finished, len(self.latencies))
        if new:
            frame["latencies"] = list(self.latencies)[-new:]
            cursor.finished = self.num_finished
        return frame

    async def _run_feed(self) -> None:
        """Each tick: one frame of what changed for every page, plus the whole state if a page needs it."""
        cursor = _Cursor()
        while self.viewers:
            changed = self._changed  # taken before the frame, so a change while it is built is not missed
            delta = self.frame(cursor)
            whole = self.frame(_Cursor()) if self._joining else None
            self._frames = (_event(delta), _event(whole))
            self._tick += 1
            self._ticked.set()
            self._ticked = asyncio.Event()
            await asyncio.sleep(FRAME_INTERVAL_S)
            if not self._joining:
                await changed.wait()

    def open_feed(self) -> ViewerSlot:
        """A viewer's place (released when its feed ends); 429 when ``max_viewers`` feeds are open."""
        if self.viewers >= self.max_viewers:
            raise APIError(429, f"{self.viewers} dashboard feeds are open, the most this server allows; retry "
                                "later", type="rate_limit_error", code="too_many_viewers",
                           headers={"Retry-After": str(KEEPALIVE_S)})
        self.viewers += 1
        if self.viewers == 1:
            self.engine.watch_kv(True)
        if self._feed is None or self._feed.done():
            self._feed = asyncio.ensure_future(self._run_feed())
        return ViewerSlot(self)

    def _close_feed(self) -> None:
        self.viewers -= 1
        if not self.viewers:
            self.engine.watch_kv(False)
            self.kv = None  # it goes stale unwatched; the next page waits for a fresh one
            if self._feed is not None:
                self._feed.cancel()  # not done() until it runs again: a page opening now starts a new one
                self._feed = None

    async def events(self, slot: ViewerSlot) -> AsyncIterator[bytes]:
        """One page's feed as server-sent events: the whole state at the next tick, then each tick's
        changes (the whole state again if the page fell behind by a tick)."""
        seen, whole_needed = -1, True
        self._joining += 1
        self._nudge()
        try:
            while True:
                ticked = self._ticked
                try:
                    await asyncio.wait_for(ticked.wait(), KEEPALIVE_S)
                except TimeoutError:
                    yield b": keep-alive\n\n"
                    continue
                delta, whole = self._frames
                if whole_needed:
                    if whole is not None:
                        seen, whole_needed = self._tick, False
                        self._joining -= 1
                        yield whole
                elif self._tick != seen + 1:  # a slow page missed a tick: send it everything again
                    whole_needed = True
                    self._joining += 1
                    self._nudge()
                else:
                    seen = self._tick
                    if delta is not None:
                        yield delta
        finally:
            if whole_needed:
                self._joining -= 1
            slot.release()


def spec_stats(s: SchedulerStats) -> dict[str, Any]:
    """Speculative decoding since the engine started, from the counters /metrics exports (vLLM's
    spec_decode_*): the rate and the mean length are None until a draft has been verified."""
    return {"drafts": s.spec_num_drafts, "draft_tokens": s.spec_num_draft_tokens,
            "accepted_tokens": s.spec_num_accepted_tokens,
            "acceptance_rate": acceptance_rate(s.spec_num_accepted_tokens, s.spec_num_draft_tokens),
            "mean_accepted_length": mean_accepted_length(s.spec_num_accepted_tokens, s.spec_num_drafts)}


def _event(frame: dict[str, Any] | None) -> bytes | None:
    return None if frame is None else b"data: " + msgspec.json.encode(frame) + b"\n\n"


class ViewerSlot:
    """One open dashboard feed's place among ``max_viewers``; released once, by whichever comes first:
    the feed's end or the response's."""

    def __init__(self, dashboard: Dashboard) -> None:
        self._dashboard: Dashboard | None = dashboard

    def release(self) -> None:
        if self._dashboard is not None:
            self._dashboard._close_feed()
            self._dashboard = None


def facts(engine: EngineCoreClient, model_name: str) -> dict[str, Any]:
    """The engine's settings and the model facts the page shows beside the live panels."""
    m = engine.model_config
    config = dataclasses.asdict(engine.config)
    config.pop("step_history")
    config["device"], config["dtype"] = engine.config.resolved_device, engine.config.resolved_dtype
    return {
        "version": __version__, "served_model_name": model_name,
        "model": {"architecture": m.architecture, "num_layers": m.num_layers, "hidden_size": m.hidden_size,
                  "num_heads": m.num_heads, "num_kv_heads": m.num_kv_heads, "head_dim": m.head_dim,
                  "vocab_size": m.vocab_size},
        "capacity": dataclasses.asdict(engine.capacity),
        "engine": config,
    }


class SessionAuth:
    """The API key, or a cookie signed with it, with its time, that lasts SESSION_TTL_S (what a browser can send
    on a page load); itsdangerous signs and checks it."""

    def __init__(self, api_key: str | None) -> None:
        self._key = api_key.encode() if api_key else None
        self._signer = TimestampSigner(self._key, salt=SESSION_SALT) if self._key else None

    def token(self) -> str:
        assert self._signer is not None
        return self._signer.sign(b"dashboard").decode()

    def allows(self, request: Request) -> bool:
        if self._key is None or self._signer is None \
                or bearer_matches(request.headers.get("authorization", ""), self._key):
            return True
        try:
            self._signer.unsign(request.cookies.get(COOKIE, ""), max_age=SESSION_TTL_S)
        except BadSignature:  # forged, altered, malformed or expired (SignatureExpired is one)
            return False
        return True

    @property
    def enabled(self) -> bool:
        return self._key is not None


def _unauthorized() -> APIError:
    return APIError(401, "invalid or missing API key; send 'Authorization: Bearer <key>' or log in on /dashboard",
                    type="authentication_error", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def add_dashboard(app: FastAPI, engine: EngineCoreClient, model_name: str, api_key: str | None,
                  max_viewers: int = 16) -> Dashboard:
    """Register the dashboard's routes on ``app`` and make it the engine client's step observer."""
    dashboard = Dashboard(engine, facts(engine, model_name), max_viewers,
                          speculative=engine.config.speculative_config is not None)
    engine.step_observer = dashboard
    auth = SessionAuth(api_key)
    root = resources.files("iterserve.server") / "static" / "dashboard"
    files = {name: (root / name).read_bytes() for name in STATIC_TYPES}

    async def page(request: Request) -> Response:
        """The page; without the key it answers 401 and shows only its login form."""
        allowed = auth.allows(request)
        headers = PAGE_HEADERS if allowed else {**PAGE_HEADERS, "WWW-Authenticate": "Bearer"}
        return Response(files["index.html"], 200 if allowed else 401, headers, STATIC_TYPES["index.html"])

    async def events(request: Request) -> Response:
        if not auth.allows(request):
            raise _unauthorized()
        slot = dashboard.open_feed()
        return StreamingResponse(dashboard.events(slot), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
                                 background=BackgroundTask(slot.release))  # if the feed never started

    async def session() -> Response:
        """Reached only with the key (the server's middleware checks it): a cookie for the page."""
        response = Response(status_code=204)
        if auth.enabled:
            response.set_cookie(COOKIE, auth.token(), max_age=SESSION_TTL_S, path=PAGE, httponly=True,
                                samesite="strict")
        return response

    async def static(name: str) -> Response:
        if name not in files or name == "index.html":
            return JSONResponse(APIError(404, f"no dashboard file {name!r}").body(), 404)
        return Response(files[name], media_type=STATIC_TYPES[name], headers={"Cache-Control": "no-cache"})

    app.get(PAGE, response_model=None, include_in_schema=False)(page)
    app.get(EVENTS, response_model=None, include_in_schema=False)(events)
    app.post(SESSION, response_model=None, include_in_schema=False)(session)
    app.get(STATIC + "{name}", response_model=None, include_in_schema=False)(static)
    return dashboard
