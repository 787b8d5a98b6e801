"""An app served by uvicorn on a daemon thread, for tests and `bench http`."""

from __future__ import annotations

import threading
import time

from fastapi import FastAPI


class BackgroundServer:
    """The app served by uvicorn on a daemon thread (tests and `bench http`); `stop()` ends it.
    port 0 picks a free port; `url` is where it listens once started."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0):
        import socket

        import uvicorn

        if port == 0:
            with socket.socket() as sock:
                sock.bind((host, 0))
                port = sock.getsockname()[1]
        self.url = f"http://{host}:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name="cacheclip-http", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server did not start on {self.url}")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
