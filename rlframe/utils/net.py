"""Network facts of this process's host, for binding collectives to the right interface."""

from __future__ import annotations

import socket

SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def interface_of(ip: str) -> str | None:
    """The name of the local interface that holds IPv4 address `ip` (None: none does, or not Linux)."""
    import fcntl
    import struct

    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in names:
            try:
                packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:  # no IPv4 address, or down
                continue
            if socket.inet_ntoa(packed[20:24]) == ip:
                return name
    return None


def is_loopback(ip: str) -> bool:
    return ip.startswith("127.") or ip in ("::1", "localhost")
