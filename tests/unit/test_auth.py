"""Who may set a priority: the [auth] table, the keys it names and the decision (daemon/api/auth.py)."""
import os
import re

import pytest

from tokenflowd.daemon.api.auth import KeyTable, exposure_warning, priority_refusal
from tokenflowd.config import AuthConfig, EngineConfig, KeyGrant, ServerConfig, config_toml, load_config_file

AUTH = """
[server]
port = 8100
[auth]
default_max_priority = 1
[auth.keys."sk-ops"]
role = "operator"
max_priority = 10
[auth.keys."sk-agent"]
"""


def test_the_auth_table_loads_into_the_server_config(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text(AUTH)
    got = load_config_file(str(path))
    auth = got["server"]["auth"]
    assert auth == AuthConfig((KeyGrant("sk-ops", "operator", 10), KeyGrant("sk-agent", "user", 0)), 1)
    server = ServerConfig(**got["server"])
    assert server.auth is auth and server.port == 8100
    printed = config_toml(server, EngineConfig())
    assert "sk-ops" not in printed and "2 key grant(s)" in printed  # secrets are never printed


@pytest.mark.parametrize("text,msg", [
    ('[auth.keys."sk"]\nmax_priority = "high"\n', "max_priority must be an integer in [0, 1000], got 'high'"),
    ('[auth.keys."sk"]\nmax_priority = true\n', "max_priority must be an integer"),
    ('[auth.keys."sk"]\nmax_priority = 5000\n', "max_priority must be an integer in [0, 1000], got 5000"),
    ('[auth.keys."sk"]\nrole = 3\n', "role must be a non-empty string, got 3"),
    ('[auth.keys."sk"]\nlevel = 3\n', "unknown key 'level' in an [auth.keys] entry"),
    ('[auth.keys]\n"sk" = 3\n', "must be a table with role and max_priority"),
    ('[auth]\nkeys = ["sk"]\n', "[auth] keys must be a table of tables"),
    ('[auth]\ndefault_max_priority = -1\n', "default_max_priority must be an integer in [0, 1000], got -1"),
    ('[auth]\nadmins = 1\n', "unknown key 'admins' in [auth]"),
    ('[auth.keys." sk"]\n', "without surrounding spaces"),
])
def test_a_bad_auth_table_is_a_clear_error(tmp_path, text, msg):
    path = tmp_path / "t.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=re.escape(msg)):
        load_config_file(str(path))


def test_the_max_reading_rate_bounds_the_default():
    assert ServerConfig().max_reading_rate == 100.0
    with pytest.raises(ValueError, match="default_reading_rate .* is above max_reading_rate"):
        ServerConfig(default_reading_rate=30.0, max_reading_rate=25.0)
    with pytest.raises(ValueError, match="max_reading_rate must be a finite rate"):
        ServerConfig(max_reading_rate=float("inf"))


def test_keys_resolve_to_their_grants_and_the_rest_to_the_default():
    auth = AuthConfig((KeyGrant("sk-ops", "operator", 10),), default_max_priority=0)
    table = KeyTable((b"plain", b"sk-ops"), auth)  # sk-ops also in the key file: its grant wins
    ops, plain = table.resolve(b"sk-ops"), table.resolve(b"plain")
    assert (ops.role, ops.max_priority) == ("operator", 10) and (plain.role, plain.max_priority) == ("user", 0)
    assert table.resolve(b"sk-op") is None and not table.open
    assert ops.identity != plain.identity and "sk-ops" not in ops.identity
    open_table = KeyTable((), AuthConfig())
    assert open_table.open and open_table.anonymous.max_priority == 0


def test_priority_above_the_ceiling_is_refused_with_what_to_send():
    ops = KeyTable((), AuthConfig((KeyGrant("k", "operator", 10),))).resolve(b"k")
    plain = KeyTable((b"p",), AuthConfig()).resolve(b"p")
    anonymous = KeyTable((), AuthConfig()).anonymous
    assert priority_refusal(ops, 10) is None and priority_refusal(ops, 0) is None
    assert priority_refusal(ops, 11) == ("priority 11 is above what this key may set (10): send at most 10, or ask "
                                         "an operator to raise max_priority for this key in [auth]")
    assert priority_refusal(plain, 5).startswith("priority 5 needs an API key allowed priorities up to at least 5; "
                                                 "this key may not set priority above 0")
    assert "requests without an API key may not set priority" in priority_refusal(anonymous, 1)
    # Lowering one's own priority harms nobody else: anyone may.
    assert priority_refusal(plain, -5) is None and priority_refusal(anonymous, -1000) is None


def test_an_open_daemon_beyond_loopback_is_warned_of():
    open_table = KeyTable((), AuthConfig())
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert exposure_warning(host, open_table) is None, host
    for host in ("0.0.0.0", "::", "10.1.2.3", "api.example.internal"):
        assert "no API key" in exposure_warning(host, open_table), host
    assert exposure_warning("0.0.0.0", KeyTable((b"k",), AuthConfig())) is None


def test_the_api_key_stays_in_the_front(monkeypatch):
    from tokenflowd.daemon.launcher import engine_environment

    monkeypatch.setenv("TOKENFLOWD_API_KEY", "sk-secret")
    monkeypatch.setenv("TOKENFLOWD_NODE_KEY", "sk-node-secret")  # the cluster's own key, too
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "16")
    env = engine_environment({"CUDA_VISIBLE_DEVICES": "3"})
    assert "TOKENFLOWD_API_KEY" not in env and "sk-secret" not in env.values()
    assert "TOKENFLOWD_NODE_KEY" not in env and "sk-node-secret" not in env.values()
    assert env["CUDA_VISIBLE_DEVICES"] == "3" and env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "16"
    assert env["PATH"] == os.environ["PATH"]


def test_federation_routes_take_only_node_keys_and_v1_takes_every_key():
    import asyncio

    import aiohttp
    from aiohttp import web

    from tokenflowd.daemon.api.auth import auth_middleware, node_key

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def run(table: KeyTable) -> dict:
        app = web.Application(middlewares=[auth_middleware(table)])
        app.router.add_get("/v1/models", ok)
        app.router.add_get("/federation/state", ok)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        got = {}
        try:
            async with aiohttp.ClientSession() as s:
                for path in ("/v1/models", "/federation/state"):
                    for key in (None, "sk-ops", "sk-node"):
                        headers = {"Authorization": f"Bearer {key}"} if key else {}
                        async with s.get(url + path, headers=headers) as r:
                            got[path, key] = (r.status, (await r.json()).get("error", {}).get("code"))
        finally:
            await runner.cleanup()
        return got

    keyed = KeyTable((), AuthConfig((KeyGrant("sk-ops", "operator", 10), KeyGrant("sk-node", "node"))))
    got = asyncio.run(run(keyed))
    assert got["/v1/models", "sk-ops"][0] == got["/v1/models", "sk-node"][0] == 200
    assert got["/federation/state", "sk-node"][0] == 200
    assert got["/federation/state", "sk-ops"] == (403, "not_a_node"), "a client's key, however privileged"
    assert got["/federation/state", None][0] == got["/v1/models", None][0] == 401
    # an open API (no key) stays open, federation included: the daemon binds 127.0.0.1 unless told
    assert all(status == 200 for status, _ in asyncio.run(run(KeyTable((), AuthConfig()))).values())
    assert node_key({"TOKENFLOWD_NODE_KEY": " sk-node "}) == "sk-node" and node_key({}) is None
