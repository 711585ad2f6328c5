"""In-memory checkpoints through ``torch.distributed.checkpoint`` (DCP).

``DepotWriter`` and ``DepotReader`` are DCP's ``StorageWriter`` and
``StorageReader`` for a broker, so a trainer saves and loads with torch's
own API, on one rank or many (gloo on the CPU included)::

    import torch.distributed.checkpoint as dcp
    from tensordepot.checkpoint import DepotReader, DepotWriter

    dcp.save({"model": model.state_dict()}, storage_writer=DepotWriter("run1/step-100"))
    dcp.load(state, storage_reader=DepotReader("run1/step-100"))

A checkpoint lives in the broker, so it outlives the trainer: kill -9 every
rank after ``save``, start new ones, ``load``, and the state is bit-exact.
See ``_dcp`` for how it is stored; ``ZeroCopyLoadPlanner`` loads without a
copy; ``push`` sends a checkpoint to another host's broker.  Needs torch.
"""

from __future__ import annotations

from ._dcp import DepotReader, DepotWriter, Stored, ZeroCopyLoadPlanner, push

__all__ = ["DepotReader", "DepotWriter", "Stored", "ZeroCopyLoadPlanner", "push"]
