"""flashlet's HTTP server: FastAPI + uvicorn in an API-server process, the engine in
engine-core processes (or on one thread, EngineLoop).

`python -m flashlet.server --model M --backend B --port 8000` (see `--help`). The engine itself
never imports fastapi, uvicorn or prometheus_client; only this package does.
"""

import importlib

# Loaded on first use (PEP 562): `python -m flashlet.server` imports this package before its
# __main__, which must set the signal handlers before fastapi and torch load (seconds).
_EXPORTS = {"ServerConfig": "flashlet.server.app", "create_app": "flashlet.server.app",
            "CoreClient": "flashlet.server.core_client",
            "EngineLoop": "flashlet.server.engine_loop",
            "RequestStream": "flashlet.server.engine_loop"}

__all__ = ["CoreClient", "EngineLoop", "RequestStream", "ServerConfig", "create_app"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'flashlet.server' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted([*globals(), *_EXPORTS])
