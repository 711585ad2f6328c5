"""Client and AsyncClient have one API: every public member of Client is on
AsyncClient with the same parameters, a coroutine where Client's does I/O,
so code moves between them by adding ``await``."""

from __future__ import annotations

import inspect

import pytest
from tensordepot import AsyncClient, Client

# Client's members that do no I/O, and the AsyncClient's name for each that differs.
NO_IO = {"round_trips"}
ASYNC_NAME = {"close": "aclose"}
PUBLIC = sorted(n for n in vars(Client) if not n.startswith("_"))


def test_the_list_of_public_members_is_real() -> None:
    """The parametrized test below sees every method a user calls."""
    assert {
        "put",
        "put_many",
        "get",
        "get_many",
        "empty",
        "share",
        "push",
        "delete",
        "list",
        "stat",
        "close",
        "round_trips",
    } <= set(PUBLIC)


@pytest.mark.parametrize("name", PUBLIC)
def test_asyncclient_has_the_same_member(name: str) -> None:
    ours = vars(Client)[name]
    theirs = vars(AsyncClient).get(ASYNC_NAME.get(name, name))
    assert theirs is not None, f"AsyncClient has no {ASYNC_NAME.get(name, name)}"
    if isinstance(ours, property):
        assert isinstance(theirs, property), name
        return
    assert inspect.iscoroutinefunction(theirs) != (name in NO_IO), (
        f"AsyncClient.{name} should {'not ' if name in NO_IO else ''}be a coroutine function"
    )
    mine, async_params = (inspect.signature(f).parameters for f in (ours, theirs))
    assert list(async_params) == list(mine), name
    for pname, p in mine.items():
        q = async_params[pname]
        assert (q.kind, q.default, q.annotation) == (p.kind, p.default, p.annotation), (name, pname)
    assert (
        inspect.signature(theirs).return_annotation == inspect.signature(ours).return_annotation
    ), name
