"""The aiohttp application: middlewares (refusals counted, HEAD, API keys, errors), the routes
(routes.py) and the node's federation endpoints (federation.py), and for the app's life the SSE
keep-alive sweep and the event loop's lag watch (refusals.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Awaitable, Callable

from aiohttp import web

from tokenflowd.daemon.api import web_ui
from tokenflowd.daemon.api.auth import KeyTable, auth_middleware, exposure_warning, load_api_keys
from tokenflowd.daemon.api.connections import head_middleware
from tokenflowd.daemon.api.front import Front
from tokenflowd.daemon.api.refusals import RefusalLog, refusal_middleware, watch_loop
from tokenflowd.daemon.api.routes import Routes
from tokenflowd.openai_api.errors import MAX_BODY_SIZE, error_middleware

log = logging.getLogger("tokenflowd.api")


def build_app(front: Front) -> web.Application:
    keys = KeyTable(load_api_keys(front.config.api_key_file), front.config.auth)
    warning = exposure_warning(front.config.host, keys)
    if warning:
        log.warning(warning)
    count = lambda status, reason: front.metrics.refused.labels(str(status), reason).inc()  # noqa: E731
    refusals = refusal_middleware(count, RefusalLog())
    app = web.Application(middlewares=[refusals, head_middleware, auth_middleware(keys), error_middleware],
                          client_max_size=front.config.max_body_size)
    app[MAX_BODY_SIZE] = front.config.max_body_size
    routes = Routes(front)
    app.router.add_post("/v1/chat/completions", routes.chat_completions)
    app.router.add_post("/v1/completions", routes.completions)
    app.router.add_get("/v1/models", routes.models)
    app.router.add_get("/v1/requests", routes.request_list)
    app.router.add_get("/v1/requests/{request_id}", routes.request_info)
    app.router.add_post("/v1/requests/{request_id}/read", routes.read_cursor)
    app.router.add_get("/health", routes.health)
    app.router.add_get("/metrics", routes.metrics_endpoint)
    app.router.add_get("/openapi.json", routes.openapi)
    if front.config.web_ui:
        web_ui.add_routes(app)
    app.router.add_get("/federation/state", front.federation.state)
    app.router.add_post("/federation/prefill", front.federation.prefill)
    app.router.add_post("/federation/abort", front.federation.abort)
    app.router.add_post("/federation/keep", front.federation.keep)
    app.router.add_post("/federation/kept", front.federation.kept)
    app.router.add_post("/federation/give", front.federation.give)
    app.router.add_post("/federation/role", front.federation.set_role)

    async def close_federation(_app: web.Application) -> None:
        await front.federation.close()

    app.on_cleanup.append(close_federation)
    if front.config.sse_keepalive > 0:
        app.cleanup_ctx.append(_background(front.keep_alive))
    app.cleanup_ctx.append(_background(lambda: watch_loop(front.metrics.loop_lag.observe)))
    app.on_cleanup.append(lambda _app: front.close())
    return app


def _background(run: Callable[[], Awaitable[None]]):
    """An aiohttp cleanup context: `run` as a task for the application's life."""
    async def ctx(app: web.Application):
        task = asyncio.create_task(run())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    return ctx
