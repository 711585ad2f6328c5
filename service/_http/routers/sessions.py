"""Client sessions: open, heartbeat, fork, claim, close.  Only the identity
that opened a session may use it (403 for anyone else)."""

from __future__ import annotations

from typing import Any

from ...._errors import InvalidRequest
from ...._wire import ForkInfo, LaneInfo, SessionInfo, SessionOpen
from ..._auth import READ
from .._handler import Call, Reply, route, routes_of

TAG = "sessions"
_SESSION = {
    "parameters": [
        {
            "name": "session",
            "in": "path",
            "required": True,
            "schema": {"type": "string"},
            "description": "the id from POST /v1/sessions",
        }
    ]
}


@route(
    "POST",
    "/v1/sessions",
    READ,
    "open_session",
    tag=TAG,
    body=SessionOpen,
    answers=SessionInfo,
    summary="Open a session for a client process",
)
def open_session(call: Call[SessionOpen]) -> Reply:
    assert call.body is not None
    # The pid in the body is informational: only SO_PEERCRED makes a session tracked.
    return 200, call.broker.open_session(
        call.who, call.body.label, call.body.holding
    ).model_dump_json().encode()


_HOLDING = {
    "name": "holding",
    "in": "query",
    "required": False,
    "schema": {"type": "string"},
    "description": "comma-separated ids of earlier sessions of this process that lapsed "
    "(it was paused) and whose leases its views still hold: their memory "
    "stays retired while this session lives (README, Lifetime)",
}


@route(
    "POST",
    "/v1/sessions/{session}/heartbeat",
    READ,
    "heartbeat",
    tag=TAG,
    status=204,
    docs={"parameters": [*_SESSION["parameters"], _HOLDING]},
    note="the session's owner",
    summary="Keep a heartbeat session alive",
)
def heartbeat(call: Call[Any]) -> Reply:
    holding = [sid for sid in call.query.get("holding", "").split(",") if sid]
    call.broker.heartbeat(call.params["session"], call.who, holding)
    return 204, b""


@route(
    "POST",
    "/v1/sessions/{session}/fork",
    READ,
    "fork_session",
    tag=TAG,
    answers=ForkInfo,
    once=True,
    docs=_SESSION,
    note="the session's owner",
    summary="Copy this session's leases into a session for a child about to be forked",
)
def fork(call: Call[Any]) -> Reply:
    return 200, call.broker.fork_session(
        call.params["session"], call.who
    ).model_dump_json().encode()


@route(
    "POST",
    "/v1/sessions/{session}/claim",
    READ,
    "claim_session",
    tag=TAG,
    answers=SessionInfo,
    docs=_SESSION,
    note="the identity that forked it",
    summary="Take over the session a parent made for this forked child",
)
def claim(call: Call[Any]) -> Reply:
    return 200, call.broker.claim_session(
        call.params["session"], call.who
    ).model_dump_json().encode()


_EXIT = {
    "name": "exit",
    "in": "query",
    "required": False,
    "schema": {"type": "boolean"},
    "description": "the process is exiting, perhaps with views alive: the session ends "
    "once the process is gone, counted as an exit, not a crash",
}


@route(
    "DELETE",
    "/v1/sessions/{session}",
    READ,
    "close_session",
    tag=TAG,
    status=204,
    docs={"parameters": [*_SESSION["parameters"], _EXIT]},
    note="the session's owner, or admin",
    summary="Close a session, releasing its leases",
)
def close_session(call: Call[Any]) -> Reply:
    exiting = call.query.get("exit", "").lower() in ("1", "true")
    call.broker.close_session(call.params["session"], call.who, exiting=exiting)
    call.state.shmlanes.ended(call.params["session"])
    return 204, b""


@route(
    "POST",
    "/v1/lane",
    READ,
    "open_lane",
    tag=TAG,
    answers=LaneInfo,
    handover=True,
    note="the session's owner, on the unix socket",
    summary="Hand over a shared-memory lane for this session (its memfd and bells come "
    "with the answer, as SCM_RIGHTS)",
)
def open_lane(call: Call[Any]) -> Reply:
    handover = call.handover
    if handover is None:
        raise InvalidRequest(
            "a lane is handed over only on the broker's unix socket, to a client that reads "
            "descriptors with the answer; this connection keeps HTTP"
        )
    s = call.broker.sessions.use(call.session, call.who)
    lane = call.state.shmlanes.open(s.id, handover.scope)
    handover.passing = lane.passing()
    requests, answers = lane.mem.sizes
    return 200, LaneInfo(requests=requests, answers=answers).model_dump_json().encode()


ROUTES = routes_of(open_session, heartbeat, fork, claim, close_session, open_lane)
