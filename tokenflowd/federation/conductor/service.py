"""The conductor's HTTP service: the OpenAI routes, /health and the request inspection routes,
served by core.py's Conductor; `run` starts it for `tokenflowd conductor`."""
from __future__ import annotations

from aiohttp import web

from tokenflowd.federation.conductor.config import ConductorConfig
from tokenflowd.federation.conductor.core import MAX_BODY, Conductor
from tokenflowd.openai_api.errors import MAX_BODY_SIZE, error_middleware


def build_conductor_app(conductor: Conductor) -> web.Application:
    app = web.Application(middlewares=[error_middleware], client_max_size=MAX_BODY)
    app[MAX_BODY_SIZE] = MAX_BODY
    app.router.add_post("/v1/chat/completions", conductor.chat_completions)
    app.router.add_post("/v1/completions", conductor.completions)
    app.router.add_get("/v1/models", conductor.models)
    app.router.add_get("/health", conductor.health)
    app.router.add_get("/v1/requests", conductor.request_list)
    app.router.add_get("/v1/requests/{request_id}", conductor.request_route)
    app.router.add_post("/v1/requests/{request_id}/read", conductor.request_route)

    async def lifecycle(_app: web.Application):
        await conductor.start()
        yield
        await conductor.stop()

    app.cleanup_ctx.append(lifecycle)
    return app


def run(config: ConductorConfig) -> int:
    from tokenflowd.text.source import load_tokenizer

    conductor = Conductor(config, load_tokenizer(config.model))
    web.run_app(build_conductor_app(conductor), host=config.host, port=config.port, print=None, access_log=None,
                handler_cancellation=True)  # a client gone cancels its proxy: the decode node aborts it
    return 0
