"""Addresses a flylocal command listens on (serve, rpc-server)."""

from __future__ import annotations

import ipaddress
import socket

from flylocal.errors import FlylocalError


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_port(host: str, port: int) -> None:
    """One line, before anything loads, when the address cannot be listened on."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise FlylocalError(f"--host {host}: {e.strerror}") from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as e:
            raise FlylocalError(f"cannot listen on {host}:{port}: {e.strerror}") from None
