"""An OTLP/HTTP traces receiver for tests: a stdlib HTTP server on 127.0.0.1 that decodes each
``ExportTraceServiceRequest`` (opentelemetry-proto) it is sent and keeps the spans."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span


class OtlpReceiver:
    """The spans received so far (``spans``), in arrival order."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.posts: list[str] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                export = ExportTraceServiceRequest.FromString(body)
                with receiver._lock:
                    receiver.posts.append(self.path)
                    for resource in export.resource_spans:
                        for scope in resource.scope_spans:
                            receiver.spans.extend(scope.spans)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    @contextmanager
    def running(self) -> Iterator[OtlpReceiver]:
        thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._server.shutdown()
            self._server.server_close()
            thread.join()
