"""Configuration: the frozen values and their checks (schema.py) and where they come from, argv,
env vars and config files (loader.py, the only reader of those). The names the rest of the
service uses are importable from here."""

from service.config.loader import (
    CONFIG_FILE_ENV,
    ENV_PREFIX,
    Setting,
    build_serve_parser,
    format_problems,
    load_config,
    settings,
    toml_value,
)
from service.config.schema import (
    BACKENDS,
    DEFAULT_MODEL,
    DRAFTERS,
    LOG_FORMATS,
    LOG_LEVELS,
    MAX_STEP_ROWS,
    MAX_TREE_BUDGET,
    MAX_VERIFY_WIDTH,
    MIN_VERIFY_WIDTH,
    MODELS_DIR_ENV,
    SUPPORTED_KV_PAIRS,
    EngineConfig,
    ServerConfig,
    models_dir_from_env,
    parse_memory,
    step_budget,
    supported_pairs_listing,
)

__all__ = [
    "BACKENDS", "CONFIG_FILE_ENV", "DEFAULT_MODEL", "DRAFTERS", "ENV_PREFIX", "LOG_FORMATS",
    "LOG_LEVELS", "MAX_STEP_ROWS", "MAX_TREE_BUDGET", "MAX_VERIFY_WIDTH", "MIN_VERIFY_WIDTH",
    "MODELS_DIR_ENV", "SUPPORTED_KV_PAIRS", "EngineConfig", "ServerConfig", "Setting",
    "build_serve_parser", "format_problems", "load_config", "models_dir_from_env",
    "parse_memory", "settings", "step_budget", "supported_pairs_listing", "toml_value",
]
