"""A local HTTP file server on 127.0.0.1 for download tests, with Range support and
scripted faults. Bounded: it serves only files under its root and stops with the test."""
import gzip
import hashlib
import http.server
import os
import re
import threading
import time


LFS = "_lfs/"  # lfs=True: the hub's redirect of a file kept in LFS leads here

# on every request, not the next only
STICKY = ("always_short", "redirect_loop", "gzip", "endless", "superscript", "trickle", "header_trickle",
          "redirect_trickle")


class FaultyHandler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        server = self.server
        server.requests.append((self.path, self.headers.get("Range")))
        name = self.path.lstrip("/")
        stored = name.startswith(LFS)  # where the hub's redirect points
        name = name[len(LFS):] if stored else name
        path = os.path.join(server.root, name)
        if ".." in name or not os.path.isfile(path):
            self.send_error(404)
            return
        if server.faults.get(name) == "header_trickle":  # a status line, then a header a byte at a time
            trickle(self, b"HTTP/1.1 200 OK\r\nX-Slow: " + b"x" * 10 ** 6, server.trickle_s)
            return
        if server.faults.get(name) == "redirect_trickle" and not stored:  # a redirect whose body never ends
            self.send_response(302)
            self.send_header("Location", "/" + LFS + name)
            self.send_header("Content-Length", str(10 ** 9))
            self.end_headers()
            trickle(self, b"x" * 10 ** 6, server.trickle_s)
            return
        if server.lfs and name.endswith(".safetensors") and not stored:  # as the hub answers: a redirect naming its SHA-256
            self.send_response(302)
            self.send_header("X-Linked-Etag", f'"{hashlib.sha256(open(path, "rb").read()).hexdigest()}"')
            self.send_header("Location", "/" + LFS + name)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        data = open(path, "rb").read()
        fault = server.faults.pop(name, None) if server.faults.get(name) not in STICKY else server.faults[name]
        if fault == "flip":  # every byte arrives, one of them changed: a damaged copy of the right size
            data = data[:len(data) // 2] + bytes([data[len(data) // 2] ^ 0x01]) + data[len(data) // 2 + 1:]
        if fault == "redirect_loop":  # to itself, forever
            self.send_response(302)
            self.send_header("Location", self.path)
            self.end_headers()
            return
        # gzip: as a CDN may, where asked; not_gzip: says gzip whatever was asked, sends bytes that are not
        if fault == "not_gzip" or fault == "gzip" and "gzip" in (self.headers.get("Accept-Encoding") or ""):
            body = gzip.compress(data) if fault == "gzip" else data
            self.send_response(200)
            self.send_header("Content-Encoding", "gzip")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        start = 0
        m = re.match(r"bytes=(\d+)-", self.headers.get("Range") or "")
        if m and fault == "range_ignored":  # says 206, sends the whole file again
            self.send_response(206)
            self.send_header("Content-Range", f"bytes 0-{len(data) - 1}/{len(data)}")
        elif m and fault == "range_short":  # the next 100 bytes only, and says so
            start = int(m.group(1))
            data = data[:start + 100]
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data) + 1000}")
        elif m and server.ranges:
            start = int(m.group(1))
            if start >= len(data):
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(data)}")  # as RFC 9110 says a 416 should
                self.end_headers()
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        else:
            self.send_response(200)
        body = data[start:]
        self.send_header("Content-Length", {"endless": str(10 ** 15), "superscript": "\xb2"}.get(fault, str(len(body))))
        self.end_headers()
        if fault in ("drop", "always_short"):  # promise everything, send half, hang up
            self.wfile.write(body[:len(body) // 2])
            self.wfile.flush()
            self.close_connection = True
            return
        if fault == "trickle":  # a byte at a time, each well inside any read timeout
            trickle(self, body, server.trickle_s)
            return
        self.wfile.write(body)


def trickle(handler, body, pause_s, most_s=20.0):
    """body a byte at a time, each well inside any read timeout, for most_s at most (a client
    that gave up may have left its reading thread behind)."""
    end = time.monotonic() + most_s
    try:
        for i in range(len(body)):
            handler.wfile.write(body[i:i + 1])
            handler.wfile.flush()
            time.sleep(pause_s)
            if time.monotonic() > end:
                break
    except (BrokenPipeError, ConnectionResetError):  # the client gave up on it
        pass
    handler.close_connection = True


def start(root, ranges=True, lfs=False):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FaultyHandler)
    server.root, server.faults, server.requests, server.ranges, server.lfs = root, {}, [], ranges, lfs
    server.trickle_s = 0.02
    threading.Thread(target=server.serve_forever, daemon=True).start()
    server.url = f"http://127.0.0.1:{server.server_address[1]}"
    return server
