"""A Google Cloud Storage on localhost, for STORAGE_EMULATOR_HOST: the part of its JSON API that
google-cloud-storage's list_blobs and download_to_filename use.

  GET /storage/v1/b/{bucket}                    the bucket (404 when there is none)
  GET /storage/v1/b/{bucket}/o?prefix&delimiter  its objects under a prefix, one page
  GET /download/storage/v1/b/{bucket}/o/{name}   an object's bytes
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from urllib.parse import parse_qs, unquote, urlsplit

from tests.unit.model.local_http import LocalHTTPServer


@dataclass
class FakeGCS(LocalHTTPServer):
    buckets: dict[str, dict[str, bytes]] = field(default_factory=dict)  # bucket -> object name -> bytes
    url: str = ""

    def start(self) -> FakeGCS:
        gcs = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # no request lines on stderr
                pass

            def do_GET(self) -> None:
                url = urlsplit(self.path)
                query = {key: values[0] for key, values in parse_qs(url.query).items()}
                parts = [unquote(p) for p in url.path.strip("/").split("/")]
                download = parts[0] == "download"
                parts = parts[1:] if download else parts
                if parts[:3] != ["storage", "v1", "b"] or len(parts) < 4 or parts[3] not in gcs.buckets:
                    return self._send(404, {"error": {"code": 404, "message": "The specified bucket does not exist."}})
                objects = gcs.buckets[parts[3]]
                if len(parts) == 4:
                    return self._send(200, {"kind": "storage#bucket", "name": parts[3]})
                if len(parts) == 5 and parts[4] == "o":
                    prefix, delimiter = query.get("prefix", ""), query.get("delimiter")
                    names = [n for n in sorted(objects) if n.startswith(prefix)
                             and not (delimiter and delimiter in n[len(prefix):])]
                    items = [{"kind": "storage#object", "bucket": parts[3], "name": n, "size": str(len(objects[n]))}
                             for n in names]
                    return self._send(200, {"kind": "storage#objects", "items": items})
                name = "/".join(parts[5:])
                if not download or name not in objects:
                    return self._send(404, {"error": {"code": 404, "message": f"No such object: {name}"}})
                self._send(200, objects[name])

            def _send(self, status: int, body: dict | bytes) -> None:
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/octet-stream" if isinstance(body, bytes)
                                 else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.serve(Handler, "fake-gcs")
        return self
