"""Run an ASGI app with uvicorn on a background thread (tests, notebooks, benchmarks).

``ragkv serve`` runs uvicorn in the foreground; this is for code that wants a live server
next to itself in one process, on a loopback port picked by the OS.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

from ragkv.errors import MissingDependencyError, RagkvError

try:
    import uvicorn
except ImportError as exc:  # pragma: no cover
    raise MissingDependencyError("uvicorn", "server") from exc


class ServerThread:
    """``with ServerThread(app) as base_url: ...`` serves ``app`` until the block ends.

    ``port=0`` lets the OS pick a free port; the socket is bound before the thread starts,
    so there is no race with other processes picking the same port.
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, **config: Any) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        config.setdefault("log_level", "warning")
        self.server = uvicorn.Server(uvicorn.Config(app, lifespan="off", **config))
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, name="ragkv-http", daemon=True
        )

    @property
    def base_url(self) -> str:
        host, port = self.sock.getsockname()[:2]
        return f"http://{host}:{port}"

    def start(self, timeout_s: float = 30.0) -> str:
        """Start serving and return the base URL once uvicorn accepts connections."""
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RagkvError("the HTTP server did not start; see the log")
            time.sleep(0.01)
        return self.base_url

    def stop(self, timeout_s: float = 30.0) -> None:
        """Ask uvicorn to finish in-flight requests and exit, then close the socket."""
        self.server.should_exit = True
        if self.thread.is_alive():
            self.thread.join(timeout_s)
        self.sock.close()

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
