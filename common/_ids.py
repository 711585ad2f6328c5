"""User and group ids as people read them in error messages: ``1001 (alice)``."""

from __future__ import annotations

from collections.abc import Callable


def describe_uid(uid: int) -> str:
    """``"1001 (alice)"``, or just ``"1001"`` when the host has no such user."""
    import pwd

    try:
        return f"{uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return str(uid)


def describe_gid(gid: int) -> str:
    """``"1001 (staff)"``, or just ``"1001"`` when the host has no such group."""
    import grp

    try:
        return f"{gid} ({grp.getgrgid(gid).gr_name})"
    except KeyError:
        return str(gid)


def user_id(name: str) -> int:
    """A uid from a user name or number; ValueError when the name is unknown."""
    import pwd

    return _number(name, lambda n: pwd.getpwnam(n).pw_uid, "user", "/etc/passwd")


def group_id(name: str) -> int:
    """A gid from a group name or number; ValueError when the name is unknown."""
    import grp

    return _number(name, lambda n: grp.getgrnam(n).gr_gid, "group", "/etc/group")


def _number(name: str, lookup: Callable[[str], int], what: str, where: str) -> int:
    if name.isdigit():
        return int(name)
    try:
        return lookup(name)
    except KeyError:
        raise ValueError(
            f"no {what} named {name!r} on this host (give a name from {where} or a number)"
        ) from None
