#!/usr/bin/env python3
"""A small HTTP service for end-to-end tests of Keel's HTTP tools, run as a separate process.

Usage: python3 tool_service.py PORT   (0 picks a free port; the first line on stdout is
"listening <port>").

Python 3.11 standard library only. Everything is kept in memory and lost when the process ends.

Endpoints
  POST /restart/{instanceId}  the effect: restarts the instance ONCE per Idempotency-Key. A second
                              request with the same key gets the first answer again and applies
                              nothing; the same key with another path or body is refused (422).
                              A request without the header applies every time.
                              -> {"instanceId", "restarted": true, "restartCount": n}
  GET  /instances/{id}        read-only -> {"id", "status", "restartCount"}; every id exists, and is
                              "unhealthy" until its first restart, "healthy" after.
  GET  /_requests             every request recorded so far (not the /_ ones), oldest first:
                              {"method", "path", "idempotencyKey", "keelRunId", "keelCallId",
                               "keelAttempt", "body"}
  GET  /_effects              {instanceId: how many times its restart was applied}
  POST /_control              {"delay_ms": N, "mode": "ok|500|nonjson|oversize|hang_then_ok",
                               "times": K, "path": "/restart/"}: how the next K requests whose path
                              starts with "path" (default: every non-/_ request) behave; without
                              "times", all of them until the next /_control. {} restores normal.
  POST /_reset                forgets requests, effects, keys and control.

Modes
  ok            record, apply the effect, wait delay_ms, answer. A client that gives up (or is
                killed) during the wait leaves an applied effect: the crash case.
  hang_then_ok  record, wait delay_ms (default 60 s), then apply and answer: the effect lands after a
                client that timed out has stopped waiting (or never, if the service is stopped).
  500           record, wait delay_ms, answer 500 with a JSON error; nothing applied.
  nonjson       record, wait delay_ms, answer 200 with a text body; nothing applied.
  oversize      record, wait delay_ms, answer 200 with a 5 MiB JSON body; nothing applied.
"""

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

OVERSIZE_BYTES = 5 * 1024 * 1024
MODES = ("ok", "500", "nonjson", "oversize", "hang_then_ok")


class State:
    def __init__(self):
        self.lock = threading.Lock()
        self.reset()

    def reset(self):
        self.requests = []
        self.effects = {}
        # Idempotency-Key -> (method, path, body, status, answer)
        self.answers = {}
        self.control = None

    def take_mode(self, path):
        """The mode and delay for this request, consuming one of the control's times."""
        with self.lock:
            c = self.control
            if c is None or not path.startswith(c["path"]):
                return "ok", 0
            if c["times"] is not None:
                if c["times"] <= 0:
                    return "ok", 0
                c["times"] -= 1
            return c["mode"], c["delay_ms"]


STATE = State()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "keel-tool-service"

    def log_message(self, format, *args):
        # Quiet: the tests read stdout for the port, and stderr noise hides real failures.
        pass

    # --- plumbing ---------------------------------------------------------------------------

    def read_body(self):
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length > 0 else b""

    def send(self, status, body, content_type="application/json"):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client stopped waiting; what was applied stays applied

    def send_oversize(self):
        chunk = b"x" * 65536
        prefix, suffix = b'{"padding": "', b'"}'
        total = len(prefix) + OVERSIZE_BYTES + len(suffix)
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(total))
            self.end_headers()
            self.wfile.write(prefix)
            sent = 0
            while sent < OVERSIZE_BYTES:
                self.wfile.write(chunk)
                sent += len(chunk)
            self.wfile.write(suffix)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client stopped reading early, as it should
        # Whatever the client read, this connection is not reusable.
        self.close_connection = True

    def record(self, path, raw_body):
        try:
            body = json.loads(raw_body) if raw_body else None
        except ValueError:
            body = raw_body.decode("utf-8", "replace")
        with STATE.lock:
            STATE.requests.append(
                {
                    "method": self.command,
                    "path": self.path,
                    "idempotencyKey": self.headers.get("Idempotency-Key"),
                    "keelRunId": self.headers.get("Keel-Run-Id"),
                    "keelCallId": self.headers.get("Keel-Call-Id"),
                    "keelAttempt": self.headers.get("Keel-Attempt"),
                    "body": body,
                }
            )

    @staticmethod
    def instance(iid):
        count = STATE.effects.get(iid, 0)
        return {"id": iid, "status": "healthy" if count else "unhealthy", "restartCount": count}

    def segments(self):
        path = urlsplit(self.path).path
        return path, [unquote(s) for s in path.split("/")[1:]]

    # --- the service ------------------------------------------------------------------------

    def restart(self, iid, raw_body):
        """Applies the restart once per Idempotency-Key; returns (status, answer)."""
        key = self.headers.get("Idempotency-Key")
        with STATE.lock:
            if key is not None and key in STATE.answers:
                method, path, body, status, answer = STATE.answers[key]
                if (method, path, body) != (self.command, self.path, raw_body):
                    return 422, {"error": "this Idempotency-Key was used for another request"}
                return status, answer
            STATE.effects[iid] = STATE.effects.get(iid, 0) + 1
            answer = {"instanceId": iid, "restarted": True, "restartCount": STATE.effects[iid]}
            if key is not None:
                STATE.answers[key] = (self.command, self.path, raw_body, 200, answer)
            return 200, answer

    def serve(self, path, parts, raw_body):
        """The answer of a non-/_ endpoint in mode ok: (status, body)."""
        if self.command == "POST" and len(parts) == 2 and parts[0] == "restart" and parts[1]:
            return self.restart(parts[1], raw_body)
        if self.command == "GET" and len(parts) == 2 and parts[0] == "instances" and parts[1]:
            with STATE.lock:
                return 200, self.instance(parts[1])
        return 404, {"error": f"no endpoint {self.command} {path}"}

    def handle_one(self):
        raw_body = self.read_body()
        path, parts = self.segments()
        if path.startswith("/_"):
            return self.control_endpoint(path, raw_body)
        self.record(path, raw_body)
        mode, delay_ms = STATE.take_mode(path)
        if mode == "ok":
            # Applied before the wait: a client that gives up during it leaves the effect behind.
            status, answer = self.serve(path, parts, raw_body)
            time.sleep(delay_ms / 1000)
            return self.send(status, answer)
        if mode == "hang_then_ok":
            time.sleep((delay_ms or 60_000) / 1000)
            status, answer = self.serve(path, parts, raw_body)
            return self.send(status, answer)
        time.sleep(delay_ms / 1000)
        if mode == "500":
            return self.send(500, {"error": "injected failure"})
        if mode == "nonjson":
            return self.send(200, b"<html>not json</html>", "text/html")
        return self.send_oversize()

    def control_endpoint(self, path, raw_body):
        if self.command == "GET" and path == "/_requests":
            with STATE.lock:
                return self.send(200, list(STATE.requests))
        if self.command == "GET" and path == "/_effects":
            with STATE.lock:
                return self.send(200, dict(STATE.effects))
        if self.command == "POST" and path == "/_reset":
            with STATE.lock:
                STATE.reset()
            return self.send(200, {"reset": True})
        if self.command == "POST" and path == "/_control":
            try:
                c = json.loads(raw_body or b"{}")
                mode = c.get("mode", "ok")
                if mode not in MODES:
                    raise ValueError(f"mode must be one of {', '.join(MODES)}")
                control = {
                    "mode": mode,
                    "delay_ms": int(c.get("delay_ms", 0)),
                    "times": None if c.get("times") is None else int(c["times"]),
                    "path": str(c.get("path", "/")),
                }
            except (ValueError, TypeError, AttributeError) as e:
                return self.send(400, {"error": str(e)})
            with STATE.lock:
                STATE.control = control
            return self.send(200, control)
        return self.send(404, {"error": f"no endpoint {self.command} {path}"})

    def do_GET(self):
        self.handle_one()

    def do_POST(self):
        self.handle_one()

    def do_PUT(self):
        self.handle_one()

    def do_PATCH(self):
        self.handle_one()

    def do_DELETE(self):
        self.handle_one()


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: tool_service.py PORT (0 picks a free one)")
    server = ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler)
    server.daemon_threads = True
    print(f"listening {server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
