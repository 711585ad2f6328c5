"""Five normal exits with a view alive past ``close()``: ``python exits.py
URL`` gets ``x`` in this process and in four children (multiprocessing with
fork, spawn and forkserver, and a torch DataLoader worker), each inside
``with Client() as c:`` and keeping the view past it, and every one of them
exits normally.  Prints "done" once all have."""

from __future__ import annotations

import multiprocessing as mp
import sys
from typing import Any

from tensordepot import Client

KEPT: list[Any] = []


def held(url: str) -> None:
    """The ordinary pattern: the client closes, a view lives on to the exit."""
    with Client(url) as c:
        KEPT.append(c.get("x"))


class _Data:  # a Dataset that gets in its worker, and keeps the view
    def __init__(self, url: str) -> None:
        self.url = url

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int) -> int:
        held(self.url)
        return i


def main() -> None:
    url = sys.argv[1]
    held(url)
    for method in ("fork", "spawn", "forkserver"):
        p = mp.get_context(method).Process(target=held, args=(url,))
        p.start()
        p.join()
        assert p.exitcode == 0, (method, p.exitcode)
    import torch.utils.data

    loader = torch.utils.data.DataLoader(
        _Data(url),
        num_workers=1,  # type: ignore[arg-type]
        multiprocessing_context="fork",
    )
    assert [int(b) for b in loader] == [0]
    del loader
    print("done", flush=True)


if __name__ == "__main__":
    main()
