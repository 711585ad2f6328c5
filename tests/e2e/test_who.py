"""Who holds what, against a real broker: ``Client.who()``,
``AsyncClient.who()``, ``GET /v1/who`` and ``tensordepot who`` show each
session's process, label, leases, bytes and the versions it holds by name;
over TCP a token sees its own sessions (an admin token every one) and only
the names it may use."""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Callable
from pathlib import Path

import numpy as np
from _both import Api
from _harness import BrokerProc, free_port, ok, wait_for
from tensordepot import Client

KiB = 1024


def test_who_shows_which_process_holds_which_versions(api: Api, broker: BrokerProc) -> None:
    with Client(broker.url, label="reader") as reader:
        api.put("w", np.zeros(KiB, np.uint8))
        first = reader.get("w")
        api.put("w", np.ones(KiB, np.uint8))  # v2: v1 lives on in the reader's lease
        second, again = reader.get("w"), reader.get("w")
        held = [h for h in api.who() if h.label == "reader"]
        assert len(held) == 1, api.who()
        h = held[0]
        assert (h.pid, h.leases, h.nbytes, h.writing, h.exiting) == (
            os.getpid(),
            3,
            2 * KiB,
            0,
            False,
        )
        assert [(n.name, n.versions, n.leases, n.nbytes) for n in h.names] == [
            ("w", [1, 2], 3, 2 * KiB)
        ]
        assert reader._core.sid.startswith(h.session) and len(h.session) == 8
        table = ok("who", "--url", broker.url)
        line = next(ln for ln in table.splitlines() if " reader " in ln)
        assert line.split()[:2] == [str(os.getpid()), h.session] and "w v1,2" in line, table
        as_json = json.loads(ok("who", "--json", "--url", broker.url))
        assert {"session", "pid", "label", "leases", "nbytes", "names"} <= set(as_json[0])
        del first, second, again
        wait_for(lambda: not any(h.leases for h in api.who()), 10, what="the leases to end")
    api.delete("w")


def test_a_token_sees_its_own_sessions_and_names(
    broker_factory: Callable[..., BrokerProc], tmp_path: Path
) -> None:
    admin, team, other = (secrets.token_urlsafe(24) for _ in range(3))
    path = tmp_path / "tokens"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(
            f"{admin} admin name=ops\n{team} write prefix=team-a/ name=team-a\n"
            f"{other} write name=other\n"
        )
    tcp = f"http://127.0.0.1:{free_port()}"
    broker_factory("--listen", tcp, "--token-file", str(path))
    with (
        Client(tcp, token=admin) as a,
        Client(tcp, token=team, label="team") as t,
        Client(tcp, token=other, label="other") as o,
    ):
        a.put_many({"team-a/w": np.zeros(4, np.uint8), "secret": np.zeros(4, np.uint8)})
        kept = [t.get("team-a/w"), o.get("secret"), o.get("team-a/w")]
        seen_by_team = t.who()
        assert [h.label for h in seen_by_team] == ["team"], seen_by_team
        assert [n.name for n in seen_by_team[0].names] == ["team-a/w"]
        labels = {h.label: [n.name for n in h.names] for h in a.who()}
        assert labels["team"] == ["team-a/w"] and labels["other"] == ["secret", "team-a/w"]
        mine = o.who()
        assert [h.label for h in mine] == ["other"] and mine[0].identity == "token:other"
        del kept
        a.delete_many(["team-a/w", "secret"])
