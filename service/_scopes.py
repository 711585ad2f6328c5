"""Who may do what over Arrow Flight: ``authorize(token, scope, name)``.

Flight takes the broker's HTTP token (``--token``), which grants every scope
on every name, plus the tokens of ``--flight-token-file``: one per line,

    <token> <scope> [<name prefix>]

with scope ``read`` (GetFlightInfo, DoGet, ListFlights), ``write`` (read and
DoPut) or ``admin`` (everything), optionally limited to names that start
with the prefix.  Blank lines and ``#`` comments are ignored.  Tokens are
compared in constant time, and error messages name the missing scope, never
the token.

Only this module knows how tokens are stored: the Flight service calls
``authorize`` and nothing else, so a broker-wide token store can replace it.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from .._errors import AuthError

SCOPES = ("read", "write", "admin")  # each includes the ones before it


@dataclass(frozen=True)
class Grant:
    token: bytes
    scope: str
    prefix: str = ""


class Forbidden(AuthError):
    """A known token without the scope this call needs (HTTP 403, Flight PERMISSION_DENIED)."""

    code = "forbidden"
    status = 403


def parse_token_file(text: str, source: str = "token file") -> list[Grant]:
    """The grants of a ``--flight-token-file``; raises ValueError naming the line."""
    grants = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) not in (2, 3) or parts[1] not in SCOPES:
            raise ValueError(
                f"{source}, line {n}: expected '<token> <read|write|admin> [<name prefix>]'"
            )
        if len(parts[0]) < 16:
            raise ValueError(f"{source}, line {n}: a token needs at least 16 characters")
        grants.append(Grant(parts[0].encode(), parts[1], parts[2] if len(parts) == 3 else ""))
    return grants


class Scopes:
    """The tokens Flight accepts.  With none configured, every call is allowed
    (a Flight listener beyond loopback refuses to start without a token)."""

    def __init__(self, token: str = "", grants: list[Grant] | None = None) -> None:
        self.grants = ([Grant(token.encode(), "admin")] if token else []) + list(grants or [])

    @property
    def enabled(self) -> bool:
        return bool(self.grants)

    def known(self, token: str | None) -> bool:
        return not self.enabled or self._grant(token) is not None

    def _grant(self, token: str | None) -> Grant | None:
        if token is None:
            return None
        raw = token.encode()
        found = None
        for g in self.grants:  # no early exit: the time taken does not depend on which one matches
            if hmac.compare_digest(raw, g.token):
                found = found or g
        return found

    def authorize(self, token: str | None, scope: str, name: str | None) -> None:
        """Raise AuthError (401) for a missing or unknown token, ``Forbidden``
        (403) when it lacks ``scope`` on ``name`` (None: on every name)."""
        if not self.enabled:
            return
        g = self._grant(token)
        if g is None:
            raise AuthError("missing or unknown token: send 'authorization: Bearer <token>'")
        if SCOPES.index(g.scope) < SCOPES.index(scope):
            raise Forbidden(f"this token has scope {g.scope!r}; this call needs {scope!r}")
        if g.prefix and (name is None or not name.startswith(g.prefix)):
            what = "every name" if name is None else f"{name!r}"
            raise Forbidden(
                f"this token's {scope!r} scope is limited to names starting with {g.prefix!r}, "
                f"not {what}"
            )

    def allows(self, token: str | None, scope: str, name: str) -> bool:
        try:
            self.authorize(token, scope, name)
        except AuthError:
            return False
        return True
