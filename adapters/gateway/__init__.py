"""The gateway: the ASGI app (app.py) and the client dialects it speaks (dialects.py)."""

from .app import Gateway, serve

__all__ = ["Gateway", "serve"]
