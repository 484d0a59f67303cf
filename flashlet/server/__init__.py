"""flashlet's HTTP server: FastAPI + uvicorn in an API-server process, the engine in
engine-core processes (or on one thread, EngineLoop).

`python -m flashlet.server --model M --backend B --port 8000` (see `--help`). The engine itself
never imports fastapi, uvicorn or prometheus_client; only this package does.
"""

from flashlet.server.app import ServerConfig, create_app
from flashlet.server.core_client import CoreClient
from flashlet.server.engine_loop import EngineLoop, RequestStream

__all__ = ["CoreClient", "EngineLoop", "RequestStream", "ServerConfig", "create_app"]
