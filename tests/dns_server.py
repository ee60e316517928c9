"""A real DNS server on a loopback UDP port for tests (dnslib), whose answers a test changes.

It answers A and AAAA questions for the names it was given, NXDOMAIN for other names, and can
be made to fail (SERVFAIL) or go away altogether (its socket closed) and come back on its port.
"""

from __future__ import annotations

import ipaddress
import socket
import threading

from dnslib import AAAA, QTYPE, RCODE, RR, A
from dnslib.server import DNSLogger, DNSServer as _Server


class DnsServer:
    def __init__(self):
        self.records: dict[str, list[str]] = {}
        self.servfail = False
        self.queries = 0
        self._lock = threading.Lock()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        self._server: _Server | None = None
        self.start()

    def set(self, name: str, addresses: list[str]) -> None:
        with self._lock:
            self.records[name.rstrip(".").lower()] = list(addresses)

    def resolve(self, request, handler):
        """dnslib's resolver interface: the reply to one query."""
        reply = request.reply()
        name = str(request.q.qname).rstrip(".").lower()
        with self._lock:
            self.queries += 1
            addresses = self.records.get(name)
            servfail = self.servfail
        if servfail:
            reply.header.rcode = RCODE.SERVFAIL
        elif addresses is None:
            reply.header.rcode = RCODE.NXDOMAIN
        else:
            for address in addresses:
                v6 = ipaddress.ip_address(address).version == 6
                if request.q.qtype == (QTYPE.AAAA if v6 else QTYPE.A):
                    reply.add_answer(RR(request.q.qname, request.q.qtype, rdata=AAAA(address) if v6 else A(address), ttl=1))
        return reply

    def start(self) -> None:
        quiet = DNSLogger(logf=lambda line: None)
        self._server = _Server(self, address="127.0.0.1", port=self.port, logger=quiet)
        self._server.start_thread()

    def stop(self) -> None:
        """The server goes away: its port is closed (queries are refused) until `start()`."""
        if self._server is not None:
            self._server.stop()
            self._server.server.server_close()
            self._server = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
