"""Checks Keel through nginx (e2e/nginx/run.sh starts them): SSE unbuffered compared with a direct
connection, a WebSocket upgrade, and a reconnect with Last-Event-ID on the other instance with no
gap and no duplicate. Python's standard library only."""

import argparse
import base64
import json
import os
import socket
import statistics
import sys
import time
import urllib.parse
import urllib.request

# A run of the demo that finishes on its own: a read-only tool, then a streamed answer.
LOOK = "Look at the recent errors of payment-api"


def request(base, method, path, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method=method,
                                 headers={"Content-Type": "application/json", "Accept": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.load(r)


class Sse:
    """A raw HTTP/1.1 SSE request on its own socket; frames as they arrive (chunked decoding by
    hand, so nothing between the socket and the test buffers)."""

    def __init__(self, base, method, path, body=None, last_event_id=None):
        url = urllib.parse.urlsplit(base)
        self.sock = socket.create_connection((url.hostname, url.port), timeout=30)
        payload = b"" if body is None else json.dumps(body).encode()
        head = [f"{method} {path} HTTP/1.1", f"Host: {url.hostname}:{url.port}", "Accept: text/event-stream",
                "Connection: close"]
        if body is not None:
            head += ["Content-Type: application/json", f"Content-Length: {len(payload)}"]
        if last_event_id is not None:
            head.append(f"Last-Event-ID: {last_event_id}")
        self.sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + payload)
        self.buf = b""
        status = self._line()
        if b" 200 " not in status:
            raise AssertionError(f"{method} {base}{path}: {status!r}")
        self.chunked = False
        while True:
            line = self._line()
            if not line:
                break
            if line.lower().startswith(b"transfer-encoding:") and b"chunked" in line.lower():
                self.chunked = True
        self.text = b""

    def _fill(self):
        data = self.sock.recv(65536)
        if not data:
            raise EOFError("the stream ended")
        self.buf += data

    def _line(self):
        while b"\r\n" not in self.buf:
            self._fill()
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def _body(self):
        if not self.chunked:
            if not self.buf:
                self._fill()
            data, self.buf = self.buf, b""
            return data
        size = int(self._line().split(b";")[0], 16)
        if size == 0:
            raise EOFError("the stream ended")
        while len(self.buf) < size + 2:
            self._fill()
        data, self.buf = self.buf[:size], self.buf[size + 2:]
        return data

    def events(self):
        """Yields (arrival time, event) for each frame with data, as soon as it is complete."""
        while True:
            while b"\n\n" not in self.text:
                self.text += self._body()
            frame, self.text = self.text.split(b"\n\n", 1)
            data = [line[5:].strip() for line in frame.split(b"\n") if line.startswith(b"data:")]
            if data:
                yield time.monotonic(), json.loads(b"\n".join(data))

    def close(self):
        self.sock.close()


def timed_run(base):
    """Starts a run with a streamed POST; the times of its first and last events from the send."""
    conv = request(base, "POST", "/v1/conversations", {"title": "nginx timing"})["id"]
    start = time.monotonic()
    sse = Sse(base, "POST", f"/v1/conversations/{conv}/messages", {"content": LOOK})
    first = None
    seqs = []
    for at, event in sse.events():
        first = first or at
        seqs.append(event["sequence"])
        if event["type"] in ("done", "error", "cancelled"):
            assert event["type"] == "done", event
            sse.close()
            assert seqs == list(range(1, len(seqs) + 1)), f"a gap or a duplicate on {base}: {seqs}"
            return first - start, at - start, len(seqs)


def check_sse_unbuffered(nginx, direct):
    direct_runs, proxied = [], []
    for _ in range(3):  # alternate, so that both paths see the same load on the machine
        direct_runs.append(timed_run(direct))
        proxied.append(timed_run(nginx))
    d_first = statistics.median(r[0] for r in direct_runs)
    d_span = statistics.median(r[1] - r[0] for r in direct_runs)
    n_first = statistics.median(r[0] for r in proxied)
    n_span = statistics.median(r[1] - r[0] for r in proxied)
    print(f"SSE direct: first event {d_first * 1000:.0f} ms, events over {d_span * 1000:.0f} ms; "
          f"through nginx: first event {n_first * 1000:.0f} ms, events over {n_span * 1000:.0f} ms")
    assert d_span > 0.2, f"the run is too short to tell buffering apart: {d_span:.3f} s"
    # Buffered, the events would arrive together at the end: the first one late, the span near zero.
    assert n_first <= d_first + d_span / 2, "the first event through nginx came much later than directly"
    assert n_span >= d_span / 2, "through nginx the events came bunched together (buffered)"


class WebSocket:
    def __init__(self, base, path):
        url = urllib.parse.urlsplit(base)
        self.sock = socket.create_connection((url.hostname, url.port), timeout=30)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET {path} HTTP/1.1\r\nHost: {url.hostname}:{url.port}\r\nUpgrade: websocket\r\n"
                           f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
        self.buf = b""
        while b"\r\n\r\n" not in self.buf:
            self._fill()
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 101"), f"no upgrade through nginx: {head!r}"

    def _fill(self):
        data = self.sock.recv(65536)
        if not data:
            raise EOFError("the WebSocket closed")
        self.buf += data

    def _take(self, n):
        while len(self.buf) < n:
            self._fill()
        data, self.buf = self.buf[:n], self.buf[n:]
        return data

    def send(self, message):
        payload = json.dumps(message).encode()
        mask = os.urandom(4)
        n = len(payload)
        head = bytes([0x81]) + (bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + n.to_bytes(2, "big"))
        self.sock.sendall(head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))

    def receive(self):
        """The next text message (pings are answered, other control frames skipped)."""
        while True:
            b0, b1 = self._take(2)
            n = b1 & 0x7F
            if n == 126:
                n = int.from_bytes(self._take(2), "big")
            elif n == 127:
                n = int.from_bytes(self._take(8), "big")
            payload = self._take(n)
            opcode = b0 & 0x0F
            if opcode == 0x1:
                return json.loads(payload)
            if opcode == 0x8:
                raise EOFError("the server closed the WebSocket")
            if opcode == 0x9:  # ping → pong
                mask = os.urandom(4)
                self.sock.sendall(bytes([0x8A, 0x80 | n]) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))

    def reply(self, request_id):
        while True:
            message = self.receive()
            if message.get("type") == "reply" and message.get("requestId") == request_id:
                assert "error" not in message, message
                return message["result"]


def check_websocket(nginx):
    ws = WebSocket(nginx, "/v1/ws")
    ws.send({"type": "create_conversation", "requestId": "c", "title": "nginx ws"})
    conv = ws.reply("c")["id"]
    ws.send({"type": "send", "requestId": "m", "conversationId": conv, "content": LOOK})
    run = ws.reply("m")["runId"]
    ws.send({"type": "subscribe", "requestId": "s", "runId": run, "after": 0})
    ws.reply("s")
    seqs = []
    while True:
        message = ws.receive()
        if message.get("runId") != run or message.get("type") == "reply":
            continue
        seqs.append(message["sequence"])
        if message["type"] in ("done", "error", "cancelled"):
            assert message["type"] == "done", message
            break
    ws.sock.close()
    assert seqs == list(range(1, len(seqs) + 1)), f"WebSocket: a gap or a duplicate: {seqs}"
    print(f"WebSocket through nginx: upgraded, {len(seqs)} events of one run, in order")


def upstreams(log, run):
    """The upstream of each GET of the run's event stream, in the order nginx finished them."""
    found = []
    with open(log) as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 4 and parts[0] == "GET" and parts[1].startswith(f"/v1/runs/{run}/events"):
                found.append(parts[3])
    return found


def check_reconnect(nginx, instances, log):
    for attempt in range(1, 4):
        conv = request(nginx, "POST", "/v1/conversations", {"title": "nginx reconnect"})["id"]
        run = request(nginx, "POST", f"/v1/conversations/{conv}/messages", {"content": LOOK})["runId"]
        first = Sse(nginx, "GET", f"/v1/runs/{run}/events")
        seen = []
        for _, event in first.events():
            seen.append(event["sequence"])
            if len(seen) == 3:
                break
        first.close()  # cut mid-run, as a network failure would
        again = Sse(nginx, "GET", f"/v1/runs/{run}/events", last_event_id=seen[-1])
        for _, event in again.events():
            seen.append(event["sequence"])
            if event["type"] in ("done", "error", "cancelled"):
                assert event["type"] == "done", event
                break
        again.close()
        assert seen == list(range(1, len(seen) + 1)), f"the reconnect left a gap or a duplicate: {seen}"
        # nginx logs a request when it ends; the cut one ends once nginx notices the closed socket.
        deadline = time.monotonic() + 20
        while len(ups := upstreams(log, run)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(ups) == 2, f"the access log has {ups} for the run's streams"
        assert set(ups) <= {urllib.parse.urlsplit(i).netloc for i in instances}, ups
        if ups[0] != ups[1]:
            print(f"reconnect with Last-Event-ID {seen[2]}: first stream on {ups[0]}, reconnect on {ups[1]}; "
                  f"events 1..{len(seen)}, no gap, no duplicate")
            return
        print(f"attempt {attempt}: both streams went to {ups[0]}; again")
    raise AssertionError("no reconnect landed on the other instance in 3 attempts")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--nginx", required=True)
    p.add_argument("--direct", required=True)
    p.add_argument("--instances", nargs=2, required=True)
    p.add_argument("--access-log", required=True)
    args = p.parse_args()
    check_sse_unbuffered(args.nginx, args.direct)
    check_websocket(args.nginx)
    check_reconnect(args.nginx, args.instances, args.access_log)
    print("nginx in front of two instances: ok")


if __name__ == "__main__":
    try:
        main()
    except (AssertionError, EOFError, OSError) as e:
        print(f"FAILED: {e}", file=sys.stderr)
        sys.exit(1)
