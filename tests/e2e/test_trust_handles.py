"""What the client believes of a broker, and what it takes from its caller.

A handle whose geometry reaches outside its bytes or its segment is refused
with ``TensorBroken`` before anything is mapped, and its lease is given back
(a fake broker on a unix socket hands out crafted handles into a real
segment made with the project's shm code); a put of a tensor held from a
broker that was killed and restarted copies it, the first time; a masked
numpy array is refused, whatever its size, by both clients.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from _harness import BrokerProc, wait_for
from tensordepot import AsyncClient, InvalidRequest

MiB = 1 << 20


def drained_of_leases(b: BrokerProc) -> None:
    """No lease and no waiting get at the broker (releases go in the background)."""

    def idle() -> bool:
        st = b.stat()
        return st.leases == 0 and st.waiting == 0

    wait_for(idle, 10, what="no leases and no waiting gets at the broker")


def drained(b: BrokerProc) -> None:
    """No lease, no version, no byte in use at the broker (releases go in the background)."""

    def idle() -> bool:
        st = b.stat()
        return st.leases == 0 and st.versions == 0 and st.bytes_in_use == 0

    wait_for(idle, 10, what="no leases, versions or bytes at the broker")


# -- a re-put after the broker restarted ---------------------------------------------------------


def _restart(b: BrokerProc) -> None:
    """SIGKILL the broker, and start a new one on the same socket and prefix."""
    b.kill()
    b.start()


def _expected() -> dict[str, Any]:
    return {"small": np.arange(100.0), "big": np.arange(MiB, dtype=np.float32)}


def test_a_tensor_held_from_a_killed_broker_is_copied_by_the_first_put(
        broker: BrokerProc) -> None:
    want = _expected()
    with broker.client() as c:
        c.put_many(want)
        held = {"big": c.get("big"), **{f"many-{k}": v for k, v in
                                        c.get_many(["small", "big"]).items()}}
        _restart(broker)
        for key, t in held.items():
            assert c.put(f"again-{key}", t) >= 1  # the first put after the restart
        got = c.get_many([f"again-{key}" for key in held])
        for key, t in held.items():
            assert np.array_equal(np.from_dlpack(got[f"again-{key}"]), want[t.name])
        assert c.stat().tensors == len(held)
        del got, held, t

    async def main() -> None:
        async with AsyncClient(broker.url) as ac:
            await ac.put_many(want)
            many = await ac.get_many(["small"])
            held = {"big": await ac.get("big"), "many-small": many.pop("small")}
            await asyncio.get_running_loop().run_in_executor(None, _restart, broker)
            for key, t in held.items():
                assert await ac.put(f"again-{key}", t) >= 1
            for key, t in held.items():
                got = await ac.get(f"again-{key}")
                assert np.array_equal(np.from_dlpack(got), want[t.name])
            del got, held, t

    asyncio.run(main())
    drained_of_leases(broker)


# -- masked arrays ------------------------------------------------------------------------------


def masked(n: int) -> Any:
    data = np.arange(n, dtype=np.float32)
    return np.ma.masked_array(data, mask=data % 2 == 0, fill_value=-1.0)


def _puts(c: Any, x: Any) -> list[Callable[[], Any]]:
    return [lambda: c.put("m", x), lambda: c.put_many({"ok": np.zeros(3), "m": x})]


@pytest.mark.parametrize("n", [pytest.param(1000, id="inline"), pytest.param(MiB, id="alloc")])
def test_a_masked_array_is_refused_by_put_and_put_many(broker: BrokerProc, n: int) -> None:
    x = masked(n)
    with broker.client() as c:
        for call in _puts(c, x):
            with pytest.raises(InvalidRequest) as err:
                call()
            msg = str(err.value)
            assert "masked" in msg and ".filled(" in msg and ".data" in msg, msg
        assert c.list() == []

        async def main() -> None:
            async with AsyncClient(broker.url) as ac:
                for coro in (lambda: ac.put("m", x), lambda: ac.put_many({"m": x})):
                    with pytest.raises(InvalidRequest, match=r"\.filled\("):
                        await coro()
                # What the message says to do works.
                await ac.put("filled", x.filled(0.0))
                await ac.put("data", x.data)
                got = await ac.get_many(["filled", "data"])
                assert np.array_equal(np.from_dlpack(got["filled"]), x.filled(0.0))
                assert np.array_equal(np.from_dlpack(got["data"]), x.data)
                del got
                for name in ("filled", "data"):
                    await ac.delete(name)

        asyncio.run(main())
    drained(broker)
