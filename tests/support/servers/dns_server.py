"""A real DNS server on a loopback UDP port for tests (dnslib), whose answers a test changes.

It answers A and AAAA questions for the names it was given, NXDOMAIN for other names, and can
be made to fail (SERVFAIL) or go away altogether (its socket closed) and come back on its port.
"""

from __future__ import annotations

import ipaddress
import socket
import threading

from dnslib import AAAA, QTYPE, RCODE, RR, A, DNSRecord
from dnslib.server import DNSHandler, DNSLogger, DNSServer as _Server


class _Handler(DNSHandler):
    """Truncates UDP answers as a real server does: to the size the query's EDNS record offers,
    else 512 bytes (the client then asks again over TCP)."""

    def get_reply(self, data):
        request = DNSRecord.parse(data)
        packed = self.server.resolver.resolve(request, self).pack()
        opt = [r for r in request.ar if r.rtype == QTYPE.OPT]
        limit = opt[0].rclass if opt else 512  # an OPT record's class is its UDP payload size
        if self.protocol == "udp" and len(packed) > limit:
            truncated = request.reply()  # the question, no records, TC set
            truncated.header.tc = 1
            packed = truncated.pack()
        return packed


class DnsServer:
    def __init__(self):
        self.records: dict[str, list[str]] = {}
        self.servfail = False
        self.queries = 0
        self.tcp_queries = 0
        self._lock = threading.Lock()
        self.port = _free_udp_and_tcp_port()
        self.address = f"127.0.0.1:{self.port}"
        self._servers: list[_Server] = []
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
            self.tcp_queries += handler.protocol == "tcp"
            addresses = self.records.get(name)
            servfail = self.servfail
        if servfail:
            reply.header.rcode = RCODE.SERVFAIL
        elif addresses is None:
            reply.header.rcode = RCODE.NXDOMAIN
        else:
            for address in addresses:
                ip = ipaddress.ip_address(address)
                if request.q.qtype == (QTYPE.AAAA if ip.version == 6 else QTYPE.A):
                    # AAAA from the 16 bytes: dnslib's text parser cannot read ::ffff:127.0.0.1
                    rdata = AAAA(list(ip.packed)) if ip.version == 6 else A(address)
                    reply.add_answer(RR(request.q.qname, request.q.qtype, rdata=rdata, ttl=1))
        return reply

    def start(self) -> None:
        """UDP and TCP on the same port, as a DNS server does (a truncated answer is asked again
        over TCP)."""
        quiet = DNSLogger(logf=lambda line: None)
        self._servers = [_Server(self, address="127.0.0.1", port=self.port, logger=quiet, tcp=tcp, handler=_Handler)
                         for tcp in (False, True)]
        for server in self._servers:
            server.start_thread()

    def stop(self) -> None:
        """The server goes away: its port is closed (queries are refused) until `start()`."""
        for server in self._servers:
            server.stop()
            server.server.server_close()
        self._servers = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def _free_udp_and_tcp_port() -> int:
    for _ in range(20):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.bind(("127.0.0.1", 0))
            port = udp.getsockname()[1]
            with socket.socket() as tcp:
                try:
                    tcp.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    raise RuntimeError("no port free for both UDP and TCP")
