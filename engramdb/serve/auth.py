"""Who may talk to the server: the bind rule and the bearer token.

* A TCP listener on anything but a loopback address needs a token (``--token-file``), or an
  explicit ``--insecure`` that says the operator means it.
* The token is compared with `hmac.compare_digest`, whose time does not depend on where the
  first differing byte is, so response timing tells an attacker nothing about a prefix.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import socket
import stat

from engramdb.errors import InvalidArgument

#: Shortest token accepted: 16 bytes is 128 bits when the token is random hex or base64.
MIN_TOKEN_BYTES = 16
MAX_TOKEN_BYTES = 4096


def load_token(path: str | os.PathLike[str]) -> bytes:
    """Read a bearer token from ``path`` (surrounding whitespace stripped).

    Raises `InvalidArgument` naming the file if it is missing, empty, shorter than
    `MIN_TOKEN_BYTES`, or holds characters that cannot appear in an HTTP header.
    """
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_TOKEN_BYTES + 1)
    except OSError as e:
        raise InvalidArgument(f"cannot read token file {str(path)!r}: {e.strerror}") from None
    token = raw.strip()
    if len(raw) > MAX_TOKEN_BYTES:
        raise InvalidArgument(f"token file {str(path)!r} is over {MAX_TOKEN_BYTES} bytes")
    if len(token) < MIN_TOKEN_BYTES:
        raise InvalidArgument(
            f"token in {str(path)!r} is {len(token)} bytes; use at least {MIN_TOKEN_BYTES} "
            "(e.g. `python -c 'import secrets; print(secrets.token_hex(32))' > FILE`)"
        )
    check_token(token, where=f"token file {str(path)!r}")
    return token


def check_token(token: bytes, *, where: str = "token") -> bytes:
    """A token must be printable ASCII without spaces, so it fits a header unchanged."""
    if not all(0x21 <= b <= 0x7E for b in token):
        raise InvalidArgument(f"{where} must be printable ASCII without spaces or newlines")
    return token


def token_file_is_private(path: str | os.PathLike[str]) -> bool:
    """True unless group or others may read the token file (the CLI warns otherwise)."""
    return not (os.stat(path).st_mode & (stat.S_IRGRP | stat.S_IROTH))


class TokenCheck:
    """Checks ``Authorization: Bearer <token>`` headers in constant time.

    With no token configured every request passes (the loopback / UDS default).
    """

    __slots__ = ("_expected",)

    def __init__(self, token: bytes | None):
        self._expected = None if token is None else b"Bearer " + check_token(token)

    @property
    def required(self) -> bool:
        return self._expected is not None

    def allows(self, header: str | None) -> bool:
        """Whether an ``Authorization`` header value (or None) carries the token. The time
        taken depends only on the lengths, never on the bytes compared."""
        if self._expected is None:
            return True
        got = (header or "").encode("latin-1", "replace")
        return hmac.compare_digest(got, self._expected)

    def allows_token(self, token: bytes) -> bool:
        """Whether a raw token (the wire protocol's HELLO payload) is the server's, compared
        in constant time like `allows`."""
        if self._expected is None:
            return True
        return hmac.compare_digest(b"Bearer " + token, self._expected)


def resolve_bind(host: str, port: int) -> list[tuple[int, tuple[object, ...]]]:
    """``(family, sockaddr)`` for every address ``host`` names (deduplicated, in resolver
    order). Raises `InvalidArgument` if the name does not resolve."""
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as e:
        raise InvalidArgument(f"cannot resolve bind address {host!r}: {e.strerror}") from None
    seen: set[tuple[object, ...]] = set()
    out: list[tuple[int, tuple[object, ...]]] = []
    for family, _, _, _, sockaddr in infos:
        key = (family, sockaddr[0])
        if key not in seen:
            seen.add(key)
            out.append((int(family), tuple(sockaddr)))
    return out


def is_loopback(addr: str) -> bool:
    """Whether a numeric address is in 127.0.0.0/8 or is ::1 (or ::ffff:127.x)."""
    try:
        ip = ipaddress.ip_address(addr.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped.is_loopback
    return ip.is_loopback


def check_bind(host: str, addresses: list[str], *, token: bytes | None, insecure: bool) -> None:
    """Refuse a TCP bind that reaches beyond this machine unless a token is set or the
    operator passed ``insecure``. ``addresses`` are the numeric addresses ``host`` resolved
    to; every one of them must be loopback for the unauthenticated default."""
    if token is not None or insecure:
        return
    outside = [a for a in addresses if not is_loopback(a)]
    if outside:
        raise InvalidArgument(
            f"refusing to listen on {host!r} ({', '.join(outside)}) without a token: anyone "
            "on the network could read every table. Pass --token-file FILE, or --insecure if "
            "the network is trusted"
        )
