"""Sharded checkpoints, as ``save_pretrained(max_shard_size=...)`` writes
them: ``tensordepot load`` takes the folder, the index or the files, both
clients' ``load_file`` take them too, every tensor bit-exact; ``save
--max-shard-size`` writes shards and an index that ``from_pretrained``
loads back; an index that does not match its shards is refused whole."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from _both import Api
from _harness import BrokerProc, cli, ok
from safetensors.torch import load_file
from tensordepot import InvalidRequest

SHARD = 200_000  # bytes: the model below makes 5 shards of it


def _model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()  # random weights, no download


def _bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].contiguous().view(torch.uint8), b[k].view(torch.uint8)), k


def _got(c: object, prefix: str, names: list[str]) -> dict[str, torch.Tensor]:
    got = c.get_many([prefix + n for n in names])  # type: ignore[attr-defined]
    return {n: torch.from_dlpack(got[prefix + n]).clone() for n in names}


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_sharded_transformers_checkpoint_loads_and_saves_bit_exact(
    broker: BrokerProc, tmp_path: Path, kind: str
) -> None:
    from transformers import LlamaForCausalLM

    src, dst = tmp_path / "src", tmp_path / "dst"
    _model().save_pretrained(src, max_shard_size=SHARD)
    shards = sorted(src.glob("*.safetensors"))
    index = src / "model.safetensors.index.json"
    assert len(shards) == 5 and index.exists(), sorted(p.name for p in src.iterdir())
    want: dict[str, torch.Tensor] = {}
    for shard in shards:
        want.update(load_file(str(shard)))
    names = sorted(want)

    said = ok("load", str(src), "--prefix", "folder/", "--url", broker.url)
    assert said == f"{len(want)} tensors and its metadata from {src}\n", said
    ok("load", str(index), "--prefix", "index/", "--url", broker.url)
    ok("load", *map(str, shards), "--prefix", "files/", "--url", broker.url)
    api = Api(broker.url, kind)
    try:
        heard: list[tuple[int, int]] = []
        versions = api.load_file(index, "api/", progress=lambda d, t: heard.append((d, t)))
        assert sorted(versions) == sorted(["api/" + n for n in names] + ["api/__metadata__"])
        total = sum(t.nbytes for t in want.values())
        assert heard[-1][0] == heard[-1][1] >= total  # the metadata's few bytes too
        assert api.load_file(shards, "list/").keys() == {
            "list/" + n for n in [*names, "__metadata__"]
        }
        for prefix in ("folder/", "index/", "files/", "api/", "list/"):
            _bits(want, _got(api, prefix, names))

        written = api.save_file("api/", dst, max_shard_size=SHARD)
        assert written == total
        assert len(list(dst.glob("model-*-of-00005.safetensors"))) == 5
        res = cli(
            "save",
            "index/",
            str(tmp_path / "cli"),
            "--max-shard-size",
            "200kB",
            "--url",
            broker.url,
        )
        assert res.returncode == 0, res.stderr
        assert json.loads((tmp_path / "cli" / "model.safetensors.index.json").read_text())[
            "metadata"
        ] == {"total_size": total}
        for name in ("config.json", "generation_config.json"):
            if (src / name).exists():
                shutil.copy(src / name, dst / name)
        back = LlamaForCausalLM.from_pretrained(dst).state_dict()
        _bits(want, {n: back[n] for n in names})
        for prefix in ("folder/", "index/", "files/", "api/", "list/"):
            api.delete(prefix=prefix)
    finally:
        api.close()
    broker.check_clean()


def test_a_second_save_with_fewer_shards_leaves_no_stale_shard(
    broker: BrokerProc, tmp_path: Path
) -> None:
    with broker.client() as c:
        c.put_many({f"m/t{i}": torch.full((1000,), float(i)) for i in range(6)})  # 4 kB each
        c.save_file("m/", tmp_path, max_shard_size=8000)
        assert len(list(tmp_path.glob("model-*.safetensors"))) == 3
        c.save_file("m/", tmp_path, max_shard_size="12kB")
        assert sorted(p.name for p in tmp_path.iterdir()) == [
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "model.safetensors.index.json",
        ]
        assert sorted(c.load_file(tmp_path, "again/")) == [f"again/t{i}" for i in range(6)]
        with pytest.raises(InvalidRequest, match="max_shard_size must be a size > 0"):
            c.save_file("m/", tmp_path, max_shard_size="lots")
        c.delete(prefix="m/")
        c.delete(prefix="again/")
    broker.check_clean()


def _shards(folder: Path) -> Path:
    folder.mkdir()
    for k, names in enumerate((["a", "b"], ["c"])):
        from safetensors.torch import save_file

        save_file({n: torch.ones(2) * k for n in names}, str(folder / f"s{k}.safetensors"))
    index = folder / "model.safetensors.index.json"
    index.write_text(
        json.dumps(
            {
                "metadata": {},
                "weight_map": {"a": "s0.safetensors", "b": "s0.safetensors", "c": "s1.safetensors"},
            }
        )
    )
    return index


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (lambda m: m.pop("b"), "its index does not name"),
        (lambda m: m.update(b="s1.safetensors"), "which its index puts in"),
        (lambda m: m.update(d="s1.safetensors"), "the index names tensor 'd'"),
        (lambda m: m.update(c="../s1.safetensors"), "is not a safetensors index"),
        (lambda m: m.update(c="gone.safetensors"), "cannot read"),
        (lambda m: m.clear(), "is not a safetensors index"),
    ],
)
def test_an_index_that_does_not_match_its_shards_is_refused_and_puts_nothing(
    broker: BrokerProc, tmp_path: Path, change: object, says: str
) -> None:
    index = _shards(tmp_path / "ckpt")
    doc = json.loads(index.read_text())
    change(doc["weight_map"])  # type: ignore[operator]
    index.write_text(json.dumps(doc))
    for what in (index, index.parent):
        res = cli("load", str(what), "--url", broker.url)
        assert res.returncode == 1 and says in res.stderr, res.stderr
        assert "Traceback" not in res.stderr
    with broker.client() as c:
        assert c.list() == []


def test_folders_and_lists_say_what_is_wrong(broker: BrokerProc, tmp_path: Path) -> None:
    index = _shards(tmp_path / "ckpt")
    index.unlink()
    (tmp_path / "empty").mkdir()
    with broker.client() as c:
        assert sorted(c.load_file(tmp_path / "ckpt", "f/")) == ["f/a", "f/b", "f/c"]
        with pytest.raises(InvalidRequest, match="is in both"):
            c.load_file([index.parent / "s0.safetensors"] * 2, "twice/")
        with pytest.raises(InvalidRequest, match=r"no \*\.safetensors file"):
            c.load_file(tmp_path / "empty", "e/")
        with pytest.raises(InvalidRequest, match="empty list"):
            c.load_file([], "e/")
        assert [i.name for i in c.list()] == ["f/a", "f/b", "f/c"]
        c.delete(prefix="f/")
    broker.check_clean()
