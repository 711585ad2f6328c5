"""Who may do what: the broker's one authorization layer.

``Authorizer`` runs first for every request, at both doors (the gate,
service/_http/_gate.py, calls it before anything else).  It resolves each request
to a ``Principal`` and stores it in ``scope["state"]["principal"]``:

* **unix socket, allowed uid**: the peer's uid comes from SO_PEERCRED, which
  the kernel fills in at connect(2) and the peer cannot forge.  The broker's
  own uid, an ``--allow-uid`` and a member of an ``--allow-gid`` group get the
  ``admin`` scope.  Principal id ``uid:<uid>``, with the kernel's pid.
* **a bearer token** (TCP, or a unix peer whose uid is not allowed):
  ``Authorization: Bearer <token>``, compared in constant time against every
  configured token.  The token's scope and name prefix apply.  Principal id
  ``token:<name>`` (or ``token:<first 12 hex of sha256(token)>`` for a token
  without a name).  Over a unix socket the kernel's uid and pid come with it.
* **TCP with --insecure-no-auth**: principal ``anonymous``, scope admin, and a
  warning on every connection's first request.

Anything else is answered here: 401 (no or unknown credentials) or 403
(known, but not allowed).  The route table (service/_http/_routes.py) gives each
route the scope it needs; the gate checks every name of a request, in its
path or its body, against the principal's prefix with ``require_names``.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import stat
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from .._errors import AuthError, Forbidden
from .._ids import describe_gid, describe_uid, group_id, user_id
from .config import Settings

T = TypeVar("T")

log = logging.getLogger("tensordepot.broker")

READ, WRITE, ADMIN = "read", "write", "admin"
# Each scope includes the ones below it.
SCOPES: dict[str, frozenset[str]] = {
    READ: frozenset({READ}),
    WRITE: frozenset({READ, WRITE}),
    ADMIN: frozenset({READ, WRITE, ADMIN}),
}


def allows(held: str, needed: str) -> bool:
    """Whether a token of scope ``held`` may do what needs ``needed``: the
    one scope order, for HTTP and Flight."""
    return needed in SCOPES.get(held, frozenset())


def within(prefix: str | None, name: str | None) -> bool:
    """Whether a token limited to ``prefix`` (None or "": no limit) may use
    ``name`` (None: every name): the one prefix rule, for HTTP and Flight."""
    return not prefix or (name is not None and name.startswith(prefix))


MIN_TOKEN_LENGTH = 16
_TOKEN_RE = re.compile(r"^[\x21-\x7e]+$")  # printable ASCII: it travels in an HTTP header
_LABEL_RE = re.compile(r"^[A-Za-z0-9._@-]{1,64}$")


class AuthConfigError(ValueError):
    """The authentication settings cannot be used; the message says what to do."""


@dataclass(frozen=True)
class Principal:
    """Who is asking.  Stored in ``scope["state"]["principal"]`` for every request.

    ``id`` is stable across connections for the same uid or token, so the
    broker can bind sessions to it.  ``pid`` and ``uid`` come from the kernel
    (SO_PEERCRED) and are None over TCP: a pid a client claims is never here.
    """

    id: str
    via: Literal["unix", "tcp"]
    scopes: frozenset[str]
    uid: int | None = None
    pid: int | None = None
    prefix: str | None = None  # names it may touch start with this (None: any name)

    def has(self, scope: str) -> bool:
        return scope in self.scopes

    @property
    def scope(self) -> str:
        """The highest scope held: "admin", "write", "read" or "" (none)."""
        return next((s for s in (ADMIN, WRITE, READ) if s in self.scopes), "")

    def may_use(self, name: str) -> bool:
        return within(self.prefix, name)


ANONYMOUS = Principal("anonymous", "tcp", frozenset())


@dataclass(frozen=True)
class Token:
    """One configured bearer token.  ``secret`` never appears in a message or a repr."""

    secret: bytes = field(repr=False)
    scope: str
    prefix: str | None = None
    name: str | None = None

    @property
    def id(self) -> str:
        # A prefix of the hash names an unnamed token without revealing it.
        return "token:" + (self.name or hashlib.sha256(self.secret).hexdigest()[:12])


def _check_secret(secret: str, where: str) -> bytes:
    if len(secret) < MIN_TOKEN_LENGTH or not _TOKEN_RE.match(secret):
        raise AuthConfigError(
            f"{where}: a token must be at least {MIN_TOKEN_LENGTH} printable ASCII characters "
            f"without spaces; make one with: "
            f"python -c 'import secrets; print(secrets.token_urlsafe(32))'"
        )
    return secret.encode()


def read_token_file(path: str) -> list[Token]:
    """Parse a token file: one token per line, ``<token> <scope> [prefix=<p>] [name=<n>]``.

    A comment line starts (after blanks) with ``#`` followed by a space, a
    tab or the end of the line.  Any other line whose first word starts with
    ``#`` is refused: a token that starts with ``#`` is never dropped silently
    as a comment.  The file must belong to the broker's uid (or root) and be
    readable by nobody else (mode 0600 or 0400): refused otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise AuthConfigError(f"--token-file {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        me = os.geteuid()
        if not stat.S_ISREG(st.st_mode):
            raise AuthConfigError(f"--token-file {path} is not a regular file")
        if st.st_uid not in (me, 0):
            raise AuthConfigError(
                f"--token-file {path} belongs to uid {describe_uid(st.st_uid)}, not to this "
                f"broker's uid {describe_uid(me)} or root; whoever owns it can change the tokens: "
                f"chown {describe_uid(me).split()[0]} {path}"
            )
        if st.st_mode & 0o077:
            raise AuthConfigError(
                f"--token-file {path} has mode {stat.S_IMODE(st.st_mode):04o}: other users can "
                f"read or change the tokens; chmod 600 {path}"
            )
        with os.fdopen(os.dup(fd), encoding="utf-8") as f:
            text = f.read()
    finally:
        os.close(fd)
    tokens = []
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split()
        if not words or words[0] == "#":
            continue
        where = f"--token-file {path}, line {number}"
        if words[0].startswith("#"):
            raise AuthConfigError(
                f"{where}: a token cannot start with '#'; for a comment, put a space after the '#'"
            )
        if len(words) < 2 or words[1] not in SCOPES:
            raise AuthConfigError(
                f"{where}: write '<token> <scope> [prefix=<p>] [name=<n>]' "
                f"with scope read, write or admin"
            )
        options: dict[str, str] = {}
        for word in words[2:]:
            key, eq, value = word.partition("=")
            if not eq or key not in ("prefix", "name") or key in options or not value:
                raise AuthConfigError(
                    f"{where}: unknown option {key!r}; options are prefix=<p> "
                    f"and name=<n>, each at most once"
                )
            options[key] = value
        name = options.get("name")
        if name is not None and not _LABEL_RE.match(name):
            raise AuthConfigError(f"{where}: name= takes letters, digits and ._@- (at most 64)")
        tokens.append(Token(_check_secret(words[0], where), words[1], options.get("prefix"), name))
    if not tokens:
        raise AuthConfigError(f"--token-file {path} holds no token")
    return tokens


def _is_member(uid: int, gid: int) -> bool | None:
    """Whether user ``uid`` belongs to group ``gid``; None when the host cannot tell."""
    import grp
    import pwd

    try:
        user = pwd.getpwuid(uid)
        members = grp.getgrgid(gid).gr_mem
    except KeyError:
        return None
    return user.pw_gid == gid or user.pw_name in members


@dataclass(frozen=True)
class AuthPolicy:
    """Who may connect, with which credentials, and the file modes that follow.

    | settings                          | socket dir   | socket       | segments     |
    | none                              | 0700         | 0600         | 0600         |
    | --shm-group G                     | 0750, grp G  | 0660, grp G  | 0640, grp G  |
    | --allow-gid G (or --allow-uid U)  | 0750, grp G  | 0660, grp G  | 0660, grp G  |
    """

    tokens: tuple[Token, ...] = ()
    insecure_no_auth: bool = False
    broker_uid: int = field(default_factory=os.geteuid)
    allow_uids: frozenset[int] = frozenset()
    allow_gids: frozenset[int] = frozenset()
    file_gid: int | None = None  # the group of the socket directory, the socket and the segments
    group_writable: bool = False  # segments 0660 (allowed peers write them), else 0640

    @property
    def dir_mode(self) -> int:
        return 0o700 if self.file_gid is None else 0o750

    @property
    def socket_mode(self) -> int:
        return 0o600 if self.file_gid is None else 0o660  # connect(2) needs write permission

    @property
    def segment_mode(self) -> int:
        if self.file_gid is None:
            return 0o600
        return 0o660 if self.group_writable else 0o640

    def admits(self, uid: int, gid: int, groups: Iterable[int] = ()) -> bool:
        """Whether a unix-socket peer with these kernel credentials is admitted (as admin)."""
        if uid == self.broker_uid or uid in self.allow_uids:
            return True
        return bool(self.allow_gids) and (
            gid in self.allow_gids or not self.allow_gids.isdisjoint(groups)
        )

    def match(self, presented: bytes) -> Token | None:
        """The token equal to ``presented`` (``matching``)."""
        return matching(presented, self.tokens, lambda t: t.secret)


def matching(presented: bytes, items: Sequence[T], secret: Callable[[T], bytes]) -> T | None:
    """The first of ``items`` whose ``secret`` equals ``presented``: every one
    is compared, each in constant time, so the time taken says nothing about
    which came close.  The one token match of the broker (its tokens, and
    the peers' grants)."""
    found = None
    for item in items:  # no early exit
        if hmac.compare_digest(presented, secret(item)):
            found = found or item
    return found


def load_policy(settings: Settings) -> AuthPolicy:
    """The policy for these settings; raises AuthConfigError with what to change."""
    tokens: list[Token] = []
    if settings.token:
        tokens.append(Token(_check_secret(settings.token, "--token / TENSORDEPOT_TOKEN"), ADMIN))
    if settings.token_file:
        tokens += read_token_file(settings.token_file)
    secrets_seen, names_seen = set(), set()
    for t in tokens:
        if t.secret in secrets_seen:
            raise AuthConfigError(
                f"a token is configured twice (seen again as {t.id}); each token has one scope"
            )
        if t.name is not None and t.name in names_seen:
            raise AuthConfigError(f"two tokens are named {t.name!r}; names identify tokens")
        secrets_seen.add(t.secret)
        names_seen.add(t.name)
    if settings.insecure_no_auth and tokens:
        raise AuthConfigError(
            "--insecure-no-auth turns authentication off, yet a token is "
            "configured; drop one of the two"
        )
    me = os.geteuid()
    try:
        allow_uids = frozenset(user_id(u) for u in settings.allow_uid)
        allow_gids = frozenset(group_id(g) for g in settings.allow_gid)
        shm_gid = settings.gid()
    except ValueError as exc:
        raise AuthConfigError(str(exc)) from None
    if len(allow_gids) > 1:
        raise AuthConfigError(
            f"--allow-gid names {len(allow_gids)} groups, but the socket and the segments carry "
            f"one group; make one group for every peer"
        )
    if shm_gid is not None and allow_gids and allow_gids != {shm_gid}:
        raise AuthConfigError(
            f"--allow-gid {describe_gid(next(iter(allow_gids)))} differs from --shm-group "
            f"{describe_gid(shm_gid)}: the allowed group's members could not open the socket; "
            f"give one group"
        )
    file_gid = shm_gid if shm_gid is not None else next(iter(allow_gids), None)
    # root opens any file, and our own uid owns them: no group needed for those.
    others = sorted(allow_uids - {me, 0})
    if others and file_gid is None:
        raise AuthConfigError(
            f"--allow-uid {describe_uid(others[0])} cannot open this broker's socket or segments "
            f"(mode 0600, owner uid {describe_uid(me)}); also give --shm-group GROUP, a group that "
            f"user belongs to: the socket and the segments then become group GROUP, mode 0660"
        )
    for uid in others:
        assert file_gid is not None
        member = _is_member(uid, file_gid)
        if member is False:
            raise AuthConfigError(
                f"--allow-uid {describe_uid(uid)} is not in group {describe_gid(file_gid)}, so it "
                f"could not open the socket or the segments; add it (usermod -aG) or pick its "
                f"group"
            )
        if member is None:
            log.warning(
                "cannot tell whether uid %s is in group %s (not in this host's user "
                "database); it must be, to open the socket",
                uid,
                file_gid,
            )
    if file_gid is not None and me != 0 and file_gid not in (os.getegid(), *os.getgroups()):
        raise AuthConfigError(
            f"this broker (uid {describe_uid(me)}) is not in group {describe_gid(file_gid)}, so it "
            f"cannot give its socket and segments to that group; run it as a member of the group"
        )
    return AuthPolicy(
        tuple(tokens),
        settings.insecure_no_auth,
        me,
        allow_uids,
        allow_gids,
        file_gid,
        group_writable=bool(allow_gids or others),
    )


# -- helpers for the routes ---------------------------------------------------------------


def require_name(principal: Principal, name: str) -> None:
    """Raise Forbidden unless ``principal`` may touch the tensor ``name`` (its prefix)."""
    if not principal.may_use(name):
        raise Forbidden(
            f"forbidden: {principal.id} may only use names starting with "
            f"{principal.prefix!r}; {name[:200]!r} is outside that prefix"
        )


def require_names(principal: Principal, names: Iterable[str]) -> None:
    """``require_name`` for each name (a batch): the whole request is refused if one is outside."""
    if principal.prefix is not None:
        for name in names:
            require_name(principal, name)


def _missing_scope(principal: Principal, needed: str, method: str, template: str) -> Forbidden:
    has = f"scope {principal.scope!r}" if principal.scope else "no scope"
    return Forbidden(
        f"forbidden: {method} {template} needs the {needed!r} scope, and "
        f"{principal.id} has {has}; use a token with scope {needed!r} "
        f"(see --token-file)"
    )


# -- the authorizer --------------------------------------------------------------------


class Authorizer:
    """Resolve each request's principal and check the scope of its route.
    The gate (service/_http/_gate.py) calls it for both doors, before anything
    else happens: no body is read, no rider released, before it passes."""

    def __init__(self, policy: AuthPolicy) -> None:
        self.policy = policy
        self._warned_unconnected = False

    def authorize(self, scope: Any, method: str, template: str, needed: str | None) -> Principal:
        """The principal of an HTTP request's scope, stored in
        ``scope["state"]["principal"]``; raises AuthError (401 or 403).
        ``needed`` is the route's scope (None: open to anyone); ``template``
        names the route in messages."""
        state = scope.setdefault("state", {})
        try:
            principal = self._resolve(scope, state)
            if principal is None:  # credentials were needed and are missing or wrong
                if needed is not None:
                    raise AuthError(
                        "missing or wrong token: send 'Authorization: Bearer <token>' "
                        "(Client(token=...) or $TENSORDEPOT_TOKEN)"
                    )
                principal = ANONYMOUS
            elif needed is not None and not principal.has(needed):
                raise _missing_scope(principal, needed, method, template)
        except Forbidden:
            if needed is not None:
                raise
            principal = ANONYMOUS  # open routes answer anyone
        state["principal"] = principal
        return principal

    def _resolve(self, scope: Any, state: dict[str, Any]) -> Principal | None:
        """The principal, None for no or unknown credentials; raises Forbidden
        for a unix peer that is not admitted and sent no token."""
        conn: dict[str, Any] | None = state.get("connection")
        if state.get("unix"):
            cached = conn.get("principal") if conn is not None else None
            if cached is not None:
                return cached  # type: ignore[no-any-return]
            pid, uid, gid = state["peercred"]
            if self.policy.admits(uid, gid, state.get("peergroups", ())):
                principal = Principal(f"uid:{uid}", "unix", SCOPES[ADMIN], uid=uid, pid=pid)
                if conn is not None:
                    # The kernel's credentials hold for the whole connection.
                    conn["principal"] = principal
                return principal
            token = _bearer(scope)
            if token is None:
                raise Forbidden(
                    f"forbidden: uid {describe_uid(uid)} may not use this broker, which runs as "
                    f"uid {describe_uid(self.policy.broker_uid)}; start the broker with "
                    f"--allow-uid {uid} or --allow-gid GROUP, or send a token"
                )
            t = self.policy.match(token)
            if t is None:
                return None
            return Principal(t.id, "unix", SCOPES[t.scope], uid=uid, pid=pid, prefix=t.prefix)
        if self.policy.insecure_no_auth:
            self._warn_insecure(scope, conn)
            return Principal("anonymous", "tcp", SCOPES[ADMIN])
        token = _bearer(scope)
        t = None if token is None else self.policy.match(token)
        if t is None:
            return None
        return Principal(t.id, "tcp", SCOPES[t.scope], prefix=t.prefix)

    def _warn_insecure(self, scope: Any, conn: dict[str, Any] | None) -> None:
        if conn is not None:
            if conn.get("warned"):
                return
            conn["warned"] = True
        elif self._warned_unconnected:
            return  # a transport without connections (an in-process test client): warn once
        else:
            self._warned_unconnected = True
        client = scope.get("client")
        peer = f"{client[0]}:{client[1]}" if client else "an unknown peer"
        log.warning(
            "unauthenticated TCP connection from %s: this broker runs with "
            "--insecure-no-auth, so anyone who reaches it may read, overwrite and delete "
            "every tensor",
            peer,
        )


def _bearer(scope: Any) -> bytes | None:
    for key, value in scope["headers"]:
        if key == b"authorization":
            kind, _, token = value.partition(b" ")
            return token.strip() if kind.lower() == b"bearer" and token.strip() else None
    return None
