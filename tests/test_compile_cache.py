"""The compiled steps kept across restarts (srt/model_executor/compiled/cache.py, srt/model_executor/compiled/builder.py).

- The cache folder's key follows the checkpoint's bytes, the flags, dtype and TP rank, so
  a stale or foreign build is never loaded; the cache can be turned off.
- A frozen oneDNN (mkldnn) weight is keyed like any frozen weight; any other mkldnn tensor
  still refuses Inductor's cache.
- A real server (2 layers, this machine's default dtype): the first start builds in a
  separate process at nice 19 while it serves eagerly, then loads the build with no
  Inductor cache miss; a restart loads it at once (no builder, no miss, the decode graphs
  as AOTInductor packages: loaded, none built) and gives the same greedy ids.
"""
from __future__ import annotations

import json
import os
import re
import time

import httpx
import pytest
import torch

from conftest import _launch_server
from srt.model_executor.compiled.cache import (GRAPH_SOURCES, allow_frozen_mkldnn_weights, cache_complete, code_digest,
                               compile_cache_key, use_compile_cache)
from srt.server_args import ServerArgs

MiB = 1 << 20


def _checkpoint(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (d / "model.safetensors").write_bytes(os.urandom(3 * MiB))
    return d


def test_key_follows_checkpoint_bytes_flags_dtype_and_rank(tmp_path, monkeypatch):
    d = _checkpoint(tmp_path)
    args = ServerArgs(model_path=str(d))

    def key(a=args, dtype=torch.bfloat16, tp=(1, 0), bs=16):
        return compile_cache_key(a, str(d), dtype, tp[0], tp[1], bs)

    base = key()
    assert key() == base
    # One byte at the end of the weights, same size and mtime: another checkpoint.
    weights = d / "model.safetensors"
    st = os.stat(weights)
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert key() != base
    changed = key()
    for other in (key(dtype=torch.float32), key(tp=(2, 0)), key(tp=(2, 1)), key(bs=8),
                  key(a=ServerArgs(model_path=str(d), json_model_override_args='{"num_hidden_layers": 2}')),
                  key(a=ServerArgs(model_path=str(d), torchao_config="int8wo"))):
        assert other != changed
    # Whole experts per rank (--ep-size) are other weights than split ones at the same TP.
    assert key(a=ServerArgs(model_path=str(d), tp_size=2, ep_size=2), tp=(2, 0)) != key(tp=(2, 0))
    assert changed["torch"] == torch.__version__ and changed["cpu_flags"]
    assert changed["code"] == code_digest()
    monkeypatch.setenv("GRAMSYNC_AOTI_DECODE", "0")  # the decode graphs from torch.compile
    assert key() != changed


def test_code_digest_follows_the_graph_sources(tmp_path):
    """A change to the code the graphs are traced from is another key (else a folder
    stays 'complete' while every graph misses); the real sources are all found."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "layer.py").write_text("x = 1\n")
    (tmp_path / "one.py").write_text("y = 2\n")
    base = code_digest(str(tmp_path), ("pkg", "one.py"))
    assert code_digest(str(tmp_path), ("pkg", "one.py")) == base
    (tmp_path / "pkg" / "layer.py").write_text("x = 3\n")
    assert code_digest(str(tmp_path), ("pkg", "one.py")) != base
    import srt.model_executor.compiled.cache as cc
    for src in GRAPH_SOURCES:
        assert os.path.exists(os.path.join(cc._REPO, src)), src
    assert "srt/layers" in GRAPH_SOURCES and "srt/models" in GRAPH_SOURCES


def test_use_compile_cache_points_inductor_at_the_keyed_folder(tmp_path, monkeypatch):
    d = _checkpoint(tmp_path)
    args = ServerArgs(model_path=str(d))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.environ.get("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "ic")))
    monkeypatch.setenv("GRAMSYNC_COMPILE_CACHE_DIR", str(tmp_path / "cc"))
    a = use_compile_cache(args, str(d), torch.float32, 2, 0, 16, "[test]")
    b = use_compile_cache(args, str(d), torch.float32, 2, 1, 16, "[test]")
    assert a != b and os.path.dirname(a) == os.path.dirname(b) == str(tmp_path / "cc")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == b  # the last call's rank
    with open(os.path.join(a, "key.json")) as f:
        assert json.load(f) == json.loads(json.dumps(compile_cache_key(args, str(d), torch.float32, 2, 0, 16)))
    assert not cache_complete(a)
    monkeypatch.setenv("GRAMSYNC_COMPILE_CACHE", "0")
    assert use_compile_cache(args, str(d), torch.float32, 2, 0, 16, "[test]") is None


def test_frozen_mkldnn_weights_are_keyed_by_metadata_and_others_still_refused():
    from torch._inductor.codecache import BypassFxGraphCache, CacheabilityValidator, FxGraphCachePickler

    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch built without oneDNN")
    assert allow_frozen_mkldnn_weights() and allow_frozen_mkldnn_weights()  # idempotent
    frozen = torch.randn(64, 32).to_mkldnn()
    frozen._is_frozen_param = True  # what Inductor's freezing marks its folded weights with
    CacheabilityValidator.check_tensor(frozen)
    fn, (meta,) = FxGraphCachePickler(torch.fx.GraphModule({}, torch.fx.Graph()))._reduce_tensor(frozen)
    assert fn(meta) == ("frozen-mkldnn", (64, 32), "torch.float32")
    with pytest.raises(BypassFxGraphCache, match="mkldnn"):
        CacheabilityValidator.check_tensor(torch.randn(64, 32).to_mkldnn())


# ---- a real server, first start and restart ---------------------------------------------
ARGS = ["--enable-torch-compile", "--max-running-requests", "3", "--log-level", "info",
        "--json-model-override-args", json.dumps({"num_hidden_layers": 2})]
PACKAGE_BUILT = re.compile(r"decode package for batches [0-9-]+ built")
PACKAGE_LOADED = re.compile(r"decode package for batches [0-9-]+ loaded")
READY = re.compile(r"INFO srt\.model_executor\.model_runner: .*compiled steps ready \(Inductor's cache: hits (\d+), misses (\d+), bypassed (\d+)\)")


def _greedy(base: str) -> list[int]:
    body = {"text": "The capital of France is",
            "sampling_params": {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}}
    r = httpx.post(base + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def _wait_for(log_path, pattern: re.Pattern, timeout: float) -> re.Match:
    deadline = time.time() + timeout
    while time.time() < deadline:
        m = pattern.search(log_path.read_text(errors="replace"))
        if m:
            return m
        time.sleep(1)
    pytest.fail(f"no {pattern.pattern!r} in the server log:\n{log_path.read_text()[-4000:]}")


@pytest.mark.timeout(900)
def test_first_start_builds_aside_and_a_restart_loads_the_build(tmp_path, tmp_path_factory, smollm2_dir):
    env = {"GRAMSYNC_COMPILE_CACHE_DIR": str(tmp_path / "compile")}
    logs: list = []
    for base in _launch_server(tmp_path_factory, smollm2_dir, ARGS, env, log_paths=logs):
        log = logs[-1]
        started = _wait_for(log, re.compile(r"compile builder started \(pid (\d+)"), 60)
        pid = int(started.group(1))
        deadline = time.time() + 60  # it sets nice 19 itself, first thing after start-up
        while os.getpriority(os.PRIO_PROCESS, pid) != 19 and time.time() < deadline:
            time.sleep(0.2)
        assert os.getpriority(os.PRIO_PROCESS, pid) == 19  # still running: it takes minutes
        assert _greedy(base)  # served (eagerly) while the builder works
        m = _wait_for(log, READY, 600)
        text = log.read_text()
        assert "compile builder done" in text
        assert int(m.group(1)) > 0 and m.group(2) == "0" and m.group(3) == "0", m.group(0)
        assert PACKAGE_BUILT.search(text) and not PACKAGE_BUILT.search(text[text.index("compile builder done"):])
        compiled_ids = _greedy(base)
    folders = os.listdir(tmp_path / "compile")
    assert len(folders) == 1 and cache_complete(str(tmp_path / "compile" / folders[0]))
    # --max-running-requests 3: the batch-1 graph and the one for 2-3 rows
    assert {"decode-1.pt2", "decode-2-3.pt2"} <= set(os.listdir(tmp_path / "compile" / folders[0]))

    for base in _launch_server(tmp_path_factory, smollm2_dir, ARGS, env, log_paths=logs):
        log = logs[-1]
        m = _wait_for(log, READY, 300)
        text = log.read_text()
        assert "complete: loading it" in text and "compile builder started" not in text
        assert int(m.group(1)) > 0 and m.group(2) == "0" and m.group(3) == "0", m.group(0)
        assert not PACKAGE_BUILT.search(text)  # loaded, not built again
        assert len(PACKAGE_LOADED.findall(text)) == 2 and "AOTInductor packages" in text
        assert _greedy(base) == compiled_ids
    assert os.listdir(tmp_path / "compile") == folders
