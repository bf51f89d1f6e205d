"""What the fake model stores share: an HTTP server on a free loopback port, in a thread."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class LocalHTTPServer:
    server: ThreadingHTTPServer
    url: str

    def serve(self, handler: type[BaseHTTPRequestHandler], name: str) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, name=name, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
