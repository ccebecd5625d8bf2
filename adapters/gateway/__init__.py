"""The gateway: the ASGI app (app.py), its client dialects (dialects.py), who may call it
(auth.py), its metrics (metrics.py), and running it with a drain (server.py)."""

from .app import Gateway
from .server import run_until_signalled, serve

__all__ = ["Gateway", "run_until_signalled", "serve"]
