"""The tests' own read of this machine's IPv4 addresses, from the kernel's routing table
(/proc/net/fib_trie: a "/32 host LOCAL" entry is an address of one of its interfaces), apart from
the socket calls the code under test makes. A pod's IP is such an address: tests that bind where a
pod would use one of them."""

from __future__ import annotations

import ipaddress
from pathlib import Path

FIB_TRIE = Path("/proc/net/fib_trie")


def own_ipv4_addresses(loopback: bool = False) -> list[str]:
    """This machine's IPv4 addresses, sorted; loopback ones only if asked. Empty without /proc."""
    try:
        lines = FIB_TRIE.read_text().splitlines()
    except OSError:
        return []
    found = set()
    for previous, line in zip(lines, lines[1:]):
        if "/32 host LOCAL" in line and "|--" in previous:
            address = ipaddress.ip_address(previous.split("|--")[1].strip())
            if loopback or not address.is_loopback:
                found.add(address)
    return [str(a) for a in sorted(found)]
