"""Whom a consumer reads KV blocks from, and how it knows the bytes are a trusted producer's.

A request's kv_transfer_params name a host and port: whoever can send a request with them (a key
with the kv_transfer scope, a prefill answer the gateway forwards) could make the decode engine
connect anywhere (a blind SSRF) and store whatever it receives under the hashes of its own tokens,
for every later request with that prompt. So:

- `ProducerAllowList`: the producer's address must be one the settings list
  (kv_allowed_producers: IP addresses, CIDR networks, or DNS names whose current addresses are
  admitted, e.g. a prefill pool's headless Service); the address checked is the one connected to
  (a name in the params is resolved once, here), so a name cannot be re-pointed between the check
  and the connection. IPv4-mapped IPv6 addresses are checked as the IPv4 address they carry.
- `payload_mac`: the producer sends, after the blocks, an HMAC-SHA256 keyed by a secret the
  engines share (kv_transfer_key_env) over engine id, request id, the block hashes and a SHA-256 of
  the bytes; a consumer that computes another MAC fails the read, and a failed read's blocks are
  freed and its prompt recomputed, never cached.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import socket

log = logging.getLogger("kvgate.kv_transfer")

# Where a key shared by the engines one process started lives when kv_transfer_key_env names no
# key: the native plugin sets it before its engines start, so they inherit it.
LOCAL_KEY_ENV = "KVGATE_KV_TRANSFER_LOCAL_KEY"


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    address = ipaddress.ip_address(text.split("%", 1)[0])
    mapped = getattr(address, "ipv4_mapped", None)
    return mapped if mapped is not None else address


class ProducerAllowList:
    def __init__(self, entries):
        self.any = "*" in entries
        self.networks, self.names = [], []
        for entry in entries:
            if entry == "*":
                continue
            try:
                self.networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                self.names.append(entry)

    def _admits(self, address, port: int) -> bool:
        if self.any or any(address.version == net.version and address in net for net in self.networks):
            return True
        return any(address in _resolve(name, port) for name in self.names)

    def address(self, host: str, port: int) -> str:
        """The address to connect to for `host`: one of its addresses this list admits;
        PermissionError when none is (nothing is connected to)."""
        for address in _resolve(host, port):
            if self._admits(address, port):
                return str(address)
        raise PermissionError(f"producer {host}:{port} is not in kv_allowed_producers")


def _resolve(host: str, port: int) -> list:
    try:
        return [_address(host)]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return []
    return [_address(info[4][0]) for info in infos]


def share_local_key() -> None:
    """Make the key this process's engines share (before they start: they inherit it)."""
    os.environ.setdefault(LOCAL_KEY_ENV, secrets.token_hex(32))


def transfer_key(env_name: str) -> bytes:
    """The engines' shared secret: $env_name, else the key of the engines this process family
    started (LOCAL_KEY_ENV, made here when nobody made it: engines in one process share it)."""
    key = os.environ.get(env_name, "") if env_name else ""
    if key:
        return key.encode()
    log.info("KV transfer: %s is not set; payloads are authenticated with a key only the engines this "
             "process started share (engines started elsewhere need %s set to one key)", env_name, env_name)
    return os.environ.setdefault(LOCAL_KEY_ENV, secrets.token_hex(32)).encode()


def payload_mac(key: bytes, engine_id: str, request_id: str, block_hashes: list[bytes], digest: bytes) -> str:
    """HMAC-SHA256 (hex) over what a read moves: whose blocks, for which request, with which hashes,
    and the SHA-256 of their bytes. Each part is length-prefixed: no two reads share a message."""
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for part in (engine_id.encode(), request_id.encode(), *block_hashes, digest):
        mac.update(len(part).to_bytes(4, "big") + part)
    return mac.hexdigest()
