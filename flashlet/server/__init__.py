"""flashlet's HTTP server: FastAPI + uvicorn around one engine-loop thread.

`python -m flashlet.server --model M --backend B --port 8000` (see `--help`). The engine itself
never imports fastapi, uvicorn or prometheus_client; only this package does.
"""

from flashlet.server.app import ServerConfig, create_app
from flashlet.server.engine_loop import EngineLoop, RequestStream

__all__ = ["EngineLoop", "RequestStream", "ServerConfig", "create_app"]
