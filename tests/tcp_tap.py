"""A TCP forwarder on loopback that records every byte it relays (a capture without root)."""
from __future__ import annotations

import selectors
import socket
import threading


class TcpTap:
    """Listens on a free loopback port and relays each connection to ``target_port``."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.captured = bytearray()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        self._listener.settimeout(0.1)
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                continue
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            t = threading.Thread(target=self._relay, args=(client, upstream), daemon=True)
            t.start()
            self._threads.append(t)

    def _relay(self, a: socket.socket, b: socket.socket) -> None:
        sel = selectors.DefaultSelector()
        sel.register(a, selectors.EVENT_READ, b)
        sel.register(b, selectors.EVENT_READ, a)
        try:
            while not self._stop.is_set():
                for key, _ in sel.select(0.1):
                    data = key.fileobj.recv(65536)
                    if not data:
                        return
                    with self._lock:
                        self.captured += data
                    key.data.sendall(data)
        except OSError:
            return
        finally:
            a.close()
            b.close()

    def seen(self, needle: bytes) -> bool:
        with self._lock:
            return needle in self.captured

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        for t in self._threads:
            t.join(2)
