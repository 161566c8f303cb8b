"""Checkpoint directories as bundles ('gpushm put NAME DIR'), on the host
backend: the layout the client reads, the index followed, the small files,
'gpushm get' back equal under diff -r, and bad input. The checkpoints are
written here, with numpy, as the safetensors library lays files out."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import gpushm
from conftest import child

_ST = {np.dtype("float32"): "F32", np.dtype("float16"): "F16", np.dtype("int64"): "I64", np.dtype("uint8"): "U8",
       np.dtype("int32"): "I32", np.dtype("bool"): "BOOL"}


def write_safetensors(path, tensors, metadata=None):
    header, data = {}, b""
    if metadata:
        header["__metadata__"] = metadata
    for name, a in tensors.items():
        b = np.ascontiguousarray(a).tobytes()
        header[name] = {"dtype": _ST[a.dtype], "shape": list(a.shape), "data_offsets": [len(data), len(data) + len(b)]}
        data += b
    js = json.dumps(header).encode()
    js += b" " * (-len(js) % 8)
    Path(path).write_bytes(len(js).to_bytes(8, "little") + js + data)


SHARDS = {
    "model-00001-of-00003.safetensors": {
        "model.embed_tokens.weight": np.arange(64 * 48, dtype=np.float32).reshape(64, 48) / 7,
        "model.norm.weight": np.ones(48, dtype=np.float16),
        "odd": np.arange(5, dtype=np.uint8),   # a data region whose length is not a multiple of 64
    },
    "model-00002-of-00003.safetensors": {
        "model.layers.0.mlp.up_proj.weight": np.linspace(-1, 1, 96 * 48, dtype=np.float32).reshape(96, 48),
        "step": np.array(7, dtype=np.int64),
        "mask": np.array([True, False, True]),
    },
    "model-00003-of-00003.safetensors": {
        "lm_head.weight": np.full((64, 48), 0.5, dtype=np.float16),
        "empty": np.zeros((0, 3), dtype=np.int32),
    },
}
FILES = {
    "config.json": b'{"model_type": "llama", "hidden_size": 48}\n',
    "generation_config.json": b'{"do_sample": false}\n',
    "tokenizer.json": b'{"version": "1.0", "model": {"type": "WordLevel"}}' * 100,
    "tokenizer.model": bytes(range(256)) * 10,
    "special_tokens_map.json": b"{}",
    "README.md": b"# a model\n",
}


def make_checkpoint(root, extra=True):
    d = Path(root) / "ckpt"
    d.mkdir()
    wm = {}
    for shard, ts in SHARDS.items():
        write_safetensors(d / shard, ts, {"format": "pt"})
        wm.update({k: shard for k in ts})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 1}, "weight_map": wm}))
    for n, b in FILES.items():
        (d / n).write_bytes(b)
    return d


def cli(daemon, *args, check=True):
    env = dict(os.environ, GPUSHM_SOCKET=daemon.socket)
    r = subprocess.run([os.environ["GPUSHM_BIN"], *map(str, args)], env=env, capture_output=True, text=True)
    if check and r.returncode != 0:
        pytest.fail(f"gpushm {' '.join(map(str, args))}: exit {r.returncode}: {r.stderr}")
    return r


def test_checkpoint_dir_roundtrip(client, daemon, name, tmp_path):
    d = make_checkpoint(tmp_path)
    cli(daemon, "put", name, d)
    meta = client.stat(name).meta
    assert meta["kind"] == "bundle" and meta["source"] == "dir" and meta["tensors"] == 8
    assert [f["name"] for f in meta["files"]] == sorted(list(FILES) + ["model.safetensors.index.json"])

    # The tensors, read as any bundle is: every shard's, by name.
    b = client.tensors(name)
    assert b.metadata == {"format": "pt"}
    want = {k: v for ts in SHARDS.values() for k, v in ts.items()}
    assert list(b) == [k for ts in SHARDS.values() for k in ts]    # shard after shard, header order
    for k, v in b.items():
        got = np.asarray(v)
        assert got.dtype == want[k].dtype and got.shape == want[k].shape, k
        np.testing.assert_array_equal(got, want[k])
        assert v.ptr % want[k].dtype.itemsize == 0, k
    assert not b["model.norm.weight"].readonly                       # no --readonly-default: read-write

    # The small files, from the segment alone.
    files = client.files(name)
    assert files == {**FILES, "model.safetensors.index.json": (d / "model.safetensors.index.json").read_bytes()}
    # Only some of them, and through the bundle's own mapping: one open
    # serves the tensors and the files (what from_pretrained does).
    assert client.files(name, lambda n: n.endswith(".json") and n != "model.safetensors.index.json") == {
        k: v for k, v in FILES.items() if k.endswith(".json")}
    opens = client.stat(name).opens
    assert b.files() == files and b.files(lambda n: n == "config.json") == {"config.json": FILES["config.json"]}
    assert client.stat(name).opens == opens, "Bundle.files opened the segment again"

    # Another process sees the same.
    out = child(daemon.socket, """
        import sys, numpy as np, gpushm
        c = gpushm.connect()
        b = c.tensors(sys.argv[1], readonly=True)
        print(float(np.asarray(b["model.embed_tokens.weight"]).sum()), c.files(sys.argv[1])["config.json"].decode().strip())
    """, name)
    assert out.strip().split(maxsplit=1) == [str(float(want["model.embed_tokens.weight"].sum())), FILES["config.json"].decode().strip()]

    # And back as the directory it was: diff -r finds nothing.
    back = tmp_path / "back"
    cli(daemon, "get", name, back)
    if shutil.which("diff"):
        r = subprocess.run(["diff", "-r", str(d), str(back)], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout
    for p in d.iterdir():
        assert (back / p.name).read_bytes() == p.read_bytes(), p.name
    assert sorted(p.name for p in back.iterdir()) == sorted(p.name for p in d.iterdir())


def test_readonly_default(client, daemon, name, tmp_path):
    d = make_checkpoint(tmp_path)
    cli(daemon, "put", "--readonly-default", name, d)
    assert client.stat(name).meta["readonly"] is True
    b = client.tensors(name)                                         # honours the mark
    assert b["lm_head.weight"].readonly and not np.asarray(b["lm_head.weight"]).flags.writeable
    rw = client.tensors(name, readonly=False)                        # asked for write: granted
    assert not rw["lm_head.weight"].readonly


def test_index_is_followed_and_the_rest_named(client, daemon, name, tmp_path):
    d = make_checkpoint(tmp_path)
    write_safetensors(d / "consolidated.safetensors", {"x": np.zeros(4, dtype=np.float32)})
    (d / "original").mkdir()
    r = cli(daemon, "put", name, d)
    assert "not kept: consolidated.safetensors (a safetensors file the index does not name), original/ (a directory)" in r.stderr
    assert "x" not in client.tensors(name)


def test_files_of_other_segments(client, name):
    client.put_tensors(name, {"a": np.arange(3)})
    assert client.files(name) == {}
    assert client.tensors(name).files() == {}
    client.create(name + "raw", 10)
    with pytest.raises(ValueError, match="not a tensor bundle"):
        client.files(name + "raw")


@pytest.mark.parametrize("case,want", [
    ("missing shard", "names shard model-00003-of-00003.safetensors, which is not in"),
    ("corrupt header", "model-00002-of-00003.safetensors is not a valid safetensors file"),
    ("duplicate tensor", 'tensor "step" is in both'),
    ("unknown dtype", 'unknown dtype "Q8"'),
    ("no safetensors", "has no *.safetensors files"),
])
def test_bad_checkpoints(client, daemon, name, tmp_path, case, want):
    d = make_checkpoint(tmp_path)
    if case == "missing shard":
        (d / "model-00003-of-00003.safetensors").unlink()
    elif case == "corrupt header":
        p = d / "model-00002-of-00003.safetensors"
        p.write_bytes(p.read_bytes()[:40])
    elif case == "duplicate tensor":
        write_safetensors(d / "model-00003-of-00003.safetensors", {"lm_head.weight": np.zeros(2, np.float16),
                                                                     "empty": np.zeros(1, np.int32),
                                                                     "step": np.zeros(1, np.int64)})
    elif case == "unknown dtype":
        h = json.dumps({"w": {"dtype": "Q8", "shape": [2], "data_offsets": [0, 2]}}).encode()
        (d / "model-00003-of-00003.safetensors").write_bytes(len(h).to_bytes(8, "little") + h + b"xx")
    elif case == "no safetensors":
        for p in d.glob("*.safetensors*"):
            p.unlink()
    r = cli(daemon, "put", name, d, check=False)
    assert r.returncode != 0 and want in r.stderr, r.stderr
    with pytest.raises(FileNotFoundError):
        client.stat(name)                                            # nothing left behind


def test_bench_models_smallest_size(daemon, tmp_path):
    """python/bench/bench_models.py at its smallest size on the host backend:
    the benchmark itself must keep working where there is no GPU."""
    bench = Path(__file__).resolve().parents[2] / "bench" / "bench_models.py"
    r = subprocess.run([sys.executable, "-u", str(bench), "--tiny", "--backend", "host", "--gpushm", os.environ["GPUSHM_BIN"],
                        "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PASS b-get" in r.stdout and "PASS b-attach" in r.stdout and "FAIL" not in r.stdout, r.stdout
