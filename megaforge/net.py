"""Addresses and ports of this machine, for the processes megaforge starts and the groups it forms
(engine servers, their API-key rule, weight-update groups, single-node jobs)."""
from __future__ import annotations

import ipaddress
import socket


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback IP; any other host name counts as reachable from outside."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def connect_host(host: str) -> str:
    """The address a client on this machine uses for a server bound to ``host``."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def free_port(host: str = "127.0.0.1") -> int:
    """A port of ``host`` that was free when asked (bound to port 0, then released)."""
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(fam, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
