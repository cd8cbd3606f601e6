"""Running the OpenAI-compatible API server: ``bevy serve``, and the app's server.

The app and its routes are ``backend.serving.routes``; this module owns the lifecycle
around them: binding the socket ourselves (so ``port=0`` works and a bind error is a
clear BevyError), running uvicorn on a background thread, waiting until it accepts
connections, stopping it, and Ctrl-C/SIGTERM handling for the foreground command.
"""

from __future__ import annotations

import signal
import socket
import threading
import time
from collections.abc import Callable

import uvicorn

from backend.errors import BevyError
from backend.serving.routes import ApiServer
from backend.serving.service import EngineService


class ServerHandle:
    """A server running on a background thread."""

    def __init__(
        self, api: ApiServer, server: uvicorn.Server, thread: threading.Thread, host: str, port: int
    ) -> None:
        self.api, self._server, self._thread = api, server, thread
        self.host, self.port = host, port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort in-flight requests and stop serving; the EngineService stays open."""
        self.api.abort_all()
        self._server.should_exit = True
        self._thread.join(timeout)


def start_server(
    service: EngineService,
    host: str = "127.0.0.1",
    port: int = 8080,
    api_key: str | None = None,
    max_queue: int = 64,
    log_level: str = "warning",
    allowed_hosts: tuple[str, ...] = (),
    cors_origins: tuple[str, ...] = (),
) -> ServerHandle:
    """Serve ``service`` on a background thread; returns once it accepts connections.
    ``port=0`` picks a free port (see ``handle.port``). ``allowed_hosts`` and
    ``cors_origins``: Host names and browser origins beyond loopback ones (guard.py)."""
    api = ApiServer(service, api_key, max_queue, allowed_hosts, cors_origins)
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as exc:
        raise BevyError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    config = uvicorn.Config(
        api.app,
        log_level=log_level,
        access_log=False,
        lifespan="off",
        ws="none",
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="bevy-api", daemon=True
    )
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            sock.close()
            raise BevyError(f"the API server on {host}:{port} did not start")
        time.sleep(0.02)
    return ServerHandle(api, server, thread, host, sock.getsockname()[1])


def serve_forever(
    service: EngineService,
    host: str,
    port: int,
    api_key: str | None = None,
    max_queue: int = 64,
    announce: Callable[[str], None] = lambda line: print(line, flush=True),
    allowed_hosts: tuple[str, ...] = (),
    cors_origins: tuple[str, ...] = (),
) -> None:
    """``bevy serve``: serve until Ctrl-C or SIGTERM (call from the main thread)."""
    handle = start_server(
        service,
        host,
        port,
        api_key,
        max_queue,
        allowed_hosts=allowed_hosts,
        cors_origins=cors_origins,
    )
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    announce(f"Bevy API serving {service.model_name} at {handle.url}/v1 (Ctrl-C stops)")
    try:
        while handle.running and not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        handle.stop()
