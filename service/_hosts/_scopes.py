"""Who may do what over Arrow Flight: ``authorize(token, scope, name)``.

Flight takes exactly the broker's HTTP tokens (``--token-file``,
``TENSORDEPOT_TOKEN``, ``--token``), with the same scopes: ``read``
(GetFlightInfo, DoGet, ListFlights), ``write`` (read and DoPut) or ``admin``,
and the same name prefixes.  Tokens are compared in constant time, and
error messages name the missing scope, never the token.  With
``--insecure-no-auth`` and no token, every call is allowed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..._errors import AuthError, Forbidden
from .._auth import allows, matching, within
from .._registry._sessions import Caller

if TYPE_CHECKING:
    from .._auth import AuthPolicy


@dataclass(frozen=True)
class Grant:
    token: bytes
    scope: str
    prefix: str = ""
    identity: str = "anonymous"  # what HTTP calls the same token (``Token.id``)


class Scopes:
    """The tokens Flight accepts.  With none configured, every call is allowed
    (a Flight listener refuses to start without a token, unless the broker
    runs with --insecure-no-auth)."""

    def __init__(self, grants: list[Grant] | None = None) -> None:
        self.grants = list(grants or [])

    @classmethod
    def of(cls, policy: AuthPolicy) -> Scopes:
        return cls([Grant(t.secret, t.scope, t.prefix or "", t.id) for t in policy.tokens])

    @property
    def enabled(self) -> bool:
        return bool(self.grants)

    def known(self, token: str | None) -> bool:
        return not self.enabled or self._grant(token) is not None

    def _grant(self, token: str | None) -> Grant | None:
        if token is None:
            return None
        return matching(token.encode(), self.grants, lambda g: g.token)

    def authorize(self, token: str | None, scope: str, name: str | None) -> None:
        """Raise AuthError (401) for a missing or unknown token, ``Forbidden``
        (403) when it lacks ``scope`` on ``name`` (None: on every name)."""
        if not self.enabled:
            return
        g = self._grant(token)
        if g is None:
            raise AuthError("missing or unknown token: send 'authorization: Bearer <token>'")
        if not allows(g.scope, scope):
            raise Forbidden(f"this token has scope {g.scope!r}; this call needs {scope!r}")
        if not within(g.prefix, name):
            what = "every name" if name is None else f"{name!r}"
            raise Forbidden(
                f"this token's {scope!r} scope is limited to names starting with {g.prefix!r}, "
                f"not {what}"
            )

    def prefix(self, token: str | None) -> str | None:
        """The prefix of the names ``token`` may use (None: every name), for
        messages that must name nothing else."""
        g = self._grant(token) if self.enabled else None
        return (g.prefix or None) if g is not None else None

    def caller(self, token: str | None) -> Caller:
        """Who ``token`` is to the broker: the identity and prefix an HTTP
        request with the same token has, so that sessions, quotas and
        messages treat it the same through either door."""
        g = self._grant(token) if self.enabled else None
        if g is None:
            return Caller("anonymous")  # --insecure-no-auth, as over HTTP
        return Caller(g.identity, prefix=g.prefix or None)

    def allows(self, token: str | None, scope: str, name: str) -> bool:
        try:
            self.authorize(token, scope, name)
        except AuthError:
            return False
        return True
