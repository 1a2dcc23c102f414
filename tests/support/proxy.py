"""An egress proxy as companies run them for https: it only tunnels (CONNECT host:port), looking names up
in its own network's (`hosts`) before the system's. It records each tunnel asked for."""

from __future__ import annotations

import contextlib
import socket
import socketserver
import threading


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)


class ConnectProxy:
    def __init__(self, hosts: dict[str, str] | None = None) -> None:
        self.hosts = hosts or {}
        self.tunnels: list[str] = []
        proxy = self

        class Handler(socketserver.StreamRequestHandler):
            rbufsize = 0  # (unbuffered: nothing the client sends after its headers is read here)

            def handle(self) -> None:
                request = self.rfile.readline().decode("latin-1").split()
                while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass  # (its headers: a Proxy-Authorization would be checked here)
                if len(request) != 3 or request[0] != "CONNECT":
                    self.wfile.write(b"HTTP/1.1 405 Method Not Allowed\r\ncontent-length: 0\r\n\r\n")
                    return
                host, _, port = request[1].rpartition(":")
                proxy.tunnels.append(request[1])
                try:
                    upstream = socket.create_connection((proxy.hosts.get(host, host), int(port)), timeout=10)
                except OSError:
                    self.wfile.write(b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: 0\r\n\r\n")
                    return
                with upstream:
                    self.wfile.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
                    back = threading.Thread(target=_pipe, args=(upstream, self.connection), daemon=True)
                    back.start()
                    _pipe(self.connection, upstream)
                    back.join(timeout=10)

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
