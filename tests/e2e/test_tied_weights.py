"""Tied weights through a real broker: ``put_many`` stores the bytes that two
names of a state dict share once (the ``same`` column of /v1/many/alloc),
``get_many`` gives them back as views of the same bytes, and
``load_state_dict(assign=True)`` therefore keeps a transformers model's tie."""

from __future__ import annotations

import torch
from _harness import BrokerProc, wait_for
from _rawhttp import Session

KiB = 1024


def test_put_many_stores_tied_tensors_once_and_get_many_keeps_the_tie(broker: BrokerProc) -> None:
    w = torch.randn(256, 64)  # 64 KiB: whole pages, so the bytes in use add up exactly
    sd = {"embed": w, "head": w, "other": torch.randn(1024), "rows": w[64:], "as_numpy": w.numpy()}
    with broker.client() as c:
        c.put_many(sd)
        st = c.stat()
        # embed, head and as_numpy are one tensor; rows only overlaps it: stored apart.
        assert st.bytes_in_use == (64 + 4 + 48) * KiB, st
        assert st.tensors == 5, st
        got = c.get_many(list(sd))
        assert got["embed"]._address == got["head"]._address == got["as_numpy"]._address
        assert got["rows"]._address != got["embed"]._address + 64 * 64 * 4, "stored apart"
        for name, x in sd.items():
            assert torch.equal(torch.from_dlpack(got[name]), torch.as_tensor(x)), name
        torch.from_dlpack(got["embed"]).add_(1.0)  # a write within the tie: seen through it
        assert torch.equal(torch.from_dlpack(got["head"]), w + 1.0)
        assert torch.equal(torch.from_dlpack(got["rows"]), w[64:]), "nothing else sees it"
        assert torch.equal(torch.from_dlpack(c.get("head")), w), "nor a later get"
        del got
        c.delete("embed")  # the tie's bytes stay while a name holds them
        assert c.stat().bytes_in_use == (64 + 4 + 48) * KiB
        assert torch.equal(torch.from_dlpack(c.get("head")), w)
        c.delete_many(["head", "as_numpy", "other", "rows"])
        wait_for(
            lambda: c.stat().bytes_in_use == 0 and c.stat().leases == 0,
            10,
            what="the tie's bytes to be freed with its last name",
        )


def test_numpy_arrays_are_tied_when_they_are_one_array_or_view_the_same_bytes(
    broker: BrokerProc,
) -> None:
    import numpy as np

    a = np.arange(16 * KiB, dtype=np.float32)  # 64 KiB each
    b = a.copy()  # equal bytes, its own memory: stored apart
    owners = {"a": a, "a_again": a, "b": b}  # arrays that own their memory
    mixed = {"a": a, "view": a[:], "b": b, "half": a[: 8 * KiB]}  # views of a among them
    with broker.client() as c:
        c.put_many(owners)
        assert c.stat().bytes_in_use == 2 * 64 * KiB, "a once, b apart"
        got = c.get_many(list(owners))
        assert got["a"]._address == got["a_again"]._address != got["b"]._address
        del got
        c.delete_many(list(owners))
        c.put_many(mixed)
        assert c.stat().bytes_in_use == (2 * 64 + 32) * KiB, "a and its view once; half apart"
        got = c.get_many(list(mixed))
        assert got["a"]._address == got["view"]._address
        for name, x in mixed.items():
            assert np.array_equal(np.from_dlpack(got[name]), x), name
        del got
        c.delete_many(list(mixed))
        wait_for(
            lambda: c.stat().bytes_in_use == 0 and c.stat().leases == 0, 10, what="every byte freed"
        )


def test_a_transformers_model_keeps_its_tied_weights(broker: BrokerProc) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    trainer = LlamaForCausalLM(config).eval()  # random weights, no download
    sd = trainer.state_dict()
    embed, head = "model.embed_tokens.weight", "lm_head.weight"
    assert sd[head].data_ptr() == sd[embed].data_ptr()
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        want = trainer(ids).logits
    with broker.client() as producer, broker.client() as c:
        producer.put_many({f"llama/{k}": v for k, v in sd.items()})
        once = sum(v.nbytes for v in sd.values()) - sd[head].nbytes
        assert once <= producer.stat().bytes_in_use < once + sd[head].nbytes // 2, "stored once"
        got = c.get_many([f"llama/{k}" for k in sd])
        worker = LlamaForCausalLM(config).eval()
        worker.load_state_dict({k: torch.from_dlpack(got[f"llama/{k}"]) for k in sd}, assign=True)
        assert worker.lm_head.weight.data_ptr() == worker.model.embed_tokens.weight.data_ptr()
        assert worker.lm_head.weight.data_ptr() == got[f"llama/{embed}"]._address, "zero copy"
        worker.tie_weights()
        assert worker.lm_head.weight is worker.model.embed_tokens.weight
        with torch.no_grad():
            assert torch.equal(worker(ids).logits, want), "bit-exact"
        del got, worker
        producer.delete(prefix="llama/")
        wait_for(
            lambda: c.stat().leases == 0 and c.stat().bytes_in_use == 0,
            10,
            what="the model's leases and bytes to go",
        )


def test_a_same_column_that_cannot_be_meant_is_refused(broker: BrokerProc) -> None:
    raw = Session(broker.sock)
    try:
        base = {"names": ["a", "b"], "shapes": [[4], [4]], "dtypes": ["float32", "float32"]}
        for same, says in (
            ([1, -1], "earlier tensor"),
            ([-1, 1], "earlier tensor"),
            ([-1], "one entry per name"),
            ([-1, -2], "greater than or equal"),
        ):
            status, answer = raw.send("POST", "/v1/many/alloc", {**base, "same": same})
            assert status in (400, 422), (same, answer)
            assert says in answer["error"]["message"], (same, answer)
        status, answer = raw.send(
            "POST", "/v1/many/alloc", {**base, "shapes": [[4], [2, 2]], "same": [-1, 0]}
        )
        assert status == 400 and "shapes differ" in answer["error"]["message"], answer
        status, answer = raw.send(
            "POST",
            "/v1/many/alloc",
            {
                "names": ["a", "b", "c"],
                "shapes": [[4]] * 3,
                "dtypes": ["float32"] * 3,
                "same": [-1, 0, 1],
            },
        )
        assert status == 400 and "not itself another's" in answer["error"]["message"], answer
    finally:
        raw.close()
    with broker.client() as c:
        wait_for(
            lambda: c.stat().sessions == 1 and c.stat().bytes_in_use == 0 and c.stat().tensors == 0,
            10,
            what="nothing to be left of the refused batches",
        )
        assert c.list() == []
