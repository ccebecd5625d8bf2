"""The gateway: the ASGI app (app.py) and its collaborators (routes, the chat path, the stream
wire, admin, bookkeeping), who may call it (auth.py), its metrics (metrics.py), and running it
with a drain (serving.py). The dialects it speaks to its clients are codecs (codecs/dialects.py)."""

from .app import Gateway
from .serving import run_until_signalled, serve

__all__ = ["Gateway", "run_until_signalled", "serve"]
