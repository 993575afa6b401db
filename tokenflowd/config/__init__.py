"""Frozen, validated configuration; "auto" values are resolved before freezing.

    engine.py    EngineConfig, PolicyConfig and their resolution (device, dtype, backend, quantization)
    server.py    ServerConfig, AuthConfig: the HTTP front, its limits, keys and priority rights
    sources.py   the config file, the environment, merging, and the TOML written back
    flags.py     the engine and policy flags shared by serve, generate, sim and calibrate
    platform.py  what this machine offers (CUDA devices, fast bf16, flashinfer), asked without torch
    values.py    sizes with units, node URLs in one spelling
"""
from tokenflowd.config.engine import (
           OFFLOAD_MODES,
           POLICY_NAMES,
           POOL_HAND_OFFS,
           QUANTIZATIONS,
           EngineConfig,
           PolicyConfig,
           resolve_peers,
           resolve_quantization,
)
from tokenflowd.config.server import MAX_PRIORITY, MIN_HEARTBEAT_INTERVAL, AuthConfig, KeyGrant, ServerConfig
from tokenflowd.config.sources import (
           ENV_NOT_CONFIG,
           ENV_PREFIX,
           config_toml,
           env_config,
           load_config_file,
           merge_sources,
)
from tokenflowd.config.values import normal_url, parse_size

__all__ = ["OFFLOAD_MODES", "POLICY_NAMES", "POOL_HAND_OFFS", "QUANTIZATIONS", "EngineConfig", "PolicyConfig",
           "resolve_peers", "resolve_quantization",
           "MAX_PRIORITY", "MIN_HEARTBEAT_INTERVAL", "AuthConfig", "KeyGrant", "ServerConfig", "ENV_NOT_CONFIG",
           "ENV_PREFIX", "config_toml", "env_config", "load_config_file", "merge_sources", "normal_url", "parse_size"]
