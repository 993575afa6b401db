"""Where configuration comes from, highest precedence first: flags (flags.py), the environment
(TOKENFLOWD_*), the config file (TOML); merged section by section, and written back as TOML."""
from __future__ import annotations

from tokenflowd.config.engine import EngineConfig, PolicyConfig
from tokenflowd.config.server import AuthConfig, ServerConfig
from tokenflowd.config.values import parse_size


def load_config_file(path: str) -> dict[str, dict]:
    """A TOML file with [server], [engine] and [policy] tables whose keys are ServerConfig /
    EngineConfig / PolicyConfig fields (sizes may carry units: kv_cache_memory = "4GiB"), and
    an optional [auth] table (AuthConfig, returned as server["auth"]). Unknown tables or keys are errors."""
    import tomllib

    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ValueError(f"cannot read config file {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config file {path} is not valid TOML: {e}") from None
    known = _known_fields()
    out: dict[str, dict] = {"server": {}, "engine": {}, "policy": {}}
    for table, values in data.items():
        if table == "auth" and isinstance(values, dict):
            try:
                out["server"]["auth"] = AuthConfig.from_table(values)
            except ValueError as e:
                raise ValueError(f"{path}: {e}") from None
            continue
        if table not in known or not isinstance(values, dict):
            raise ValueError(f"{path}: unknown table [{table}]; use [server], [engine], [policy] and [auth]")
        for key, value in values.items():
            name = key.replace("-", "_")
            if name not in known[table]:
                raise ValueError(f"{path}: unknown key {key!r} in [{table}]; known: {', '.join(sorted(known[table]))}")
            if not _has_type(name, known[table][name], value):
                raise ValueError(f"{path}: [{table}] {key} must be {_type_name(name, known[table][name])}, "
                                 f"got {value!r}")
            out[table][name] = value
    if "max_body_size" in out["server"]:
        out["server"]["max_body_size"] = parse_size(out["server"]["max_body_size"])
    return out


# -- the environment and the merged view -----------------------------------------------------------
ENV_PREFIX = "TOKENFLOWD_"
ENV_NOT_CONFIG = {"TOKENFLOWD_API_KEY", "TOKENFLOWD_NODE_KEY"}  # secrets read by daemon/api/auth.py, not config fields


def _known_fields() -> dict[str, dict[str, str]]:
    """table -> field -> its annotation (a string: this module postpones annotations)."""
    from dataclasses import fields

    return {"server": {f.name: f.type for f in fields(ServerConfig) if f.name != "auth"},
            "engine": {f.name: f.type for f in fields(EngineConfig) if f.name != "policy_params"},
            "policy": {f.name: f.type for f in fields(PolicyConfig)}}


_SIZE_FIELDS = ("kv_cache_memory", "host_kv_memory", "disk_kv_memory", "max_body_size")  # a number of bytes, or a text with a unit


_TYPE_NAMES = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string",
               "tuple[str,": "a list of strings"}


def _type_name(name: str, annotation: str) -> str:
    return "a size such as 4GiB" if name in _SIZE_FIELDS else _TYPE_NAMES[annotation.split(" ")[0]]


def _has_type(name: str, annotation: str, value) -> bool:
    """A TOML value fits its field's declared type (ints pass for floats; no bool for a number)."""
    if name in _SIZE_FIELDS:
        return isinstance(value, (int, str)) and not isinstance(value, bool)
    kind = annotation.split(" ")[0]
    if kind == "tuple[str,":
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, str)


def _from_text(name: str, annotation: str, text: str):
    """A config value from an environment string, by its field's declared type."""
    if text == "" and "None" in annotation:
        return None
    try:
        if name in _SIZE_FIELDS:
            return parse_size(text)
        if annotation.startswith("tuple[str"):  # TOKENFLOWD_FEDERATION_PEERS=URL,URL
            return tuple(v.strip() for v in text.split(",") if v.strip())
        if annotation.startswith("bool"):
            if text.lower() not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                raise ValueError
            return text.lower() in ("1", "true", "yes", "on")
        if annotation.startswith("int"):
            return int(text)
        if annotation.startswith("float"):
            return float(text)
    except ValueError:
        raise ValueError(f"{ENV_PREFIX}{name.upper()}={text!r} is not a valid {annotation.split(' ')[0]}") from None
    return text


def env_config(environ: dict[str, str]) -> dict[str, dict]:
    """TOKENFLOWD_<FIELD> variables (TOKENFLOWD_PORT=8001, TOKENFLOWD_POLICY=tokenflow,
    TOKENFLOWD_KV_CACHE_MEMORY=4GiB), in load_config_file's shape. Field names are unique over
    the three tables. An unknown TOKENFLOWD_ variable is an error: a typo must not pass silently."""
    known = _known_fields()
    out: dict[str, dict] = {"server": {}, "engine": {}, "policy": {}}
    for var, text in environ.items():
        if not var.startswith(ENV_PREFIX) or var in ENV_NOT_CONFIG:
            continue
        name = var[len(ENV_PREFIX):].lower()
        table = next((t for t, names in known.items() if name in names), None)
        if table is None:
            raise ValueError(f"unknown environment variable {var}: TOKENFLOWD_ variables name a config field, "
                             f"such as TOKENFLOWD_PORT or TOKENFLOWD_POLICY")
        out[table][name] = _from_text(name, known[table][name], text)
    return out


def merge_sources(*sources: dict[str, dict]) -> dict[str, dict]:
    """Tables merged key by key, later sources winning (file, then environment; flags go last)."""
    out: dict[str, dict] = {"server": {}, "engine": {}, "policy": {}}
    for src in sources:
        for table, values in src.items():
            out[table].update(values)
    return out


def config_toml(server: ServerConfig, engine: EngineConfig) -> str:
    """The resolved configuration as a TOML file `--config` reads back (None values left out)."""
    import dataclasses

    import tomli_w

    def table(obj) -> dict:
        skip = ("policy_params", "auth")
        return {k: v for k, v in dataclasses.asdict(obj).items() if v is not None and k not in skip}

    text = tomli_w.dumps({"server": table(server), "engine": table(engine), "policy": table(engine.policy_params)})
    if server.auth != AuthConfig():  # keys are secrets: say that there are some, never what they are
        text += (f"\n# [auth]: {len(server.auth.keys)} key grant(s) and default_max_priority = "
                 f"{server.auth.default_max_priority}, not printed (secrets)\n")
    return text
