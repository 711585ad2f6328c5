"""An AsyncClient across fork(): the child uses it in an event loop of its own.

    python async_fork.py BROKER_URL

Prints ``ok`` when the child read the parent's tensor and its inherited
view, put a tensor of its own, and the parent read that; and a get of the
parent's waiting on its lane when it forked is answered after the child,
on a lane of its own, is gone.
"""

from __future__ import annotations

import asyncio
import os
import sys
import traceback

import numpy as np
from tensordepot import AsyncClient


async def main(url: str) -> None:
    async with AsyncClient(url) as c:
        await c.put("w", np.arange(10, dtype=np.float32))
        held = np.from_dlpack(await c.get("w"))
        waiter = asyncio.ensure_future(c.get("late", timeout=60))  # on the lane, in flight
        while (await c.stat()).waiting != 1:
            await asyncio.sleep(0.01)
        pid = os.fork()
        if pid == 0:  # the child: a new event loop, the same AsyncClient
            code = 1
            try:

                async def child() -> None:
                    t = await c.get("w")
                    assert np.array_equal(np.from_dlpack(t), held)
                    await c.put("from_child", held + 1)
                    await c.aclose()

                asyncio.run(child())
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        _, status = await asyncio.get_running_loop().run_in_executor(None, os.waitpid, pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the child failed"
        got = np.from_dlpack(await c.get("from_child"))
        assert np.array_equal(got, held + 1) and held[3] == 3
        await c.put("after", held)  # the parent's connections and session still work
        await c.put("late", held * 2)
        t = await asyncio.wait_for(waiter, 20)
        assert np.array_equal(np.from_dlpack(t), held * 2) and c._core.lane is not None
        del t
    print("ok", flush=True)


asyncio.run(main(sys.argv[1]))
