"""The decode graphs as AOTInductor packages (srt/model_executor/compiled/aoti_decode.py) against the eager step.

The suite's tiny model (tests/tiny_model.py, cut to one layer, fp32; on SmolLM2 the
package held 244 MB of constants and took twice as long), real ``torch.export`` and
AOTInductor compile (~30 s on 2 cores): a package built for batches 2-4 on one KV
pool serves another pool of another size and batch, writes the eager step's K/V into it
in place (and nothing else), and gives the eager step's logits; loading leaves no
extracted copy in the temp folder; building leaves the
served model's parameters as they were; a package folder of its own is removed once
loaded. The scheduler-level checks (greedy tokens equal to eager, the builder, a restart
that loads without building) are in test_compiled_decode.py and test_compile_cache.py.
"""
from __future__ import annotations

import os
import tempfile
import zipfile

import pytest
import torch

from srt.model_executor.compiled.aoti_decode import DecodePackages
from srt.model_executor.forward_batch import ForwardBatch, ForwardMode
from srt.layers.cpu_gemv import cpu_runs
from srt.mem_cache.memory_pool import MHATokenToKVPool


@pytest.fixture(scope="module")
def runner(tiny_dir):
    from distributed.parallel_state import SINGLE_RANK, RankInfo
    from srt.model_executor.model_config import ModelConfig
    from srt.model_executor.model_runner import ModelRunner
    from srt.server_args import ServerArgs, parse_model_overrides

    overrides = '{"num_hidden_layers": 1}'
    args = ServerArgs(model_path=tiny_dir, dtype="float32", max_running_requests=4, max_total_tokens=256,
                      json_model_override_args=overrides, disable_torch_compile=True)
    old = os.environ.get("GRAMSYNC_CPU_PACKED_LINEAR")
    os.environ["GRAMSYNC_CPU_PACKED_LINEAR"] = "0"  # plain weights, as wherever the step compiles
    try:
        return ModelRunner(args, ModelConfig.from_path(tiny_dir, None, parse_model_overrides(overrides)),
                           RankInfo(), SINGLE_RANK)
    finally:
        if old is None:
            os.environ.pop("GRAMSYNC_CPU_PACKED_LINEAR")
        else:
            os.environ["GRAMSYNC_CPU_PACKED_LINEAR"] = old


def _pool(runner, tokens: int, seed: int) -> MHATokenToKVPool:
    ref = runner.token_to_kv_pool
    pool = MHATokenToKVPool(tokens, len(ref.k_buffer), ref.k_buffer[0].shape[0], ref.k_buffer[0].shape[2],
                            torch.float32, "cpu")
    g = torch.Generator().manual_seed(seed)
    for t in pool.k_buffer + pool.v_buffer:
        t.copy_(torch.randn(t.shape, generator=g))
    return pool


def _batch(pool: MHATokenToKVPool, bs: int, keys: int) -> ForwardBatch:
    """``bs`` rows of ``keys``-slot tables (row i reads slots from 10 * i, its last
    ``i`` keys masked as padding), each row's new token written to slot 200 + i."""
    g = torch.Generator().manual_seed(bs)
    ids = torch.randint(0, 1000, (bs,), generator=g)
    lens = torch.tensor([keys - i for i in range(bs)])
    slots = torch.arange(keys).unsqueeze(0) + 10 * torch.arange(bs).unsqueeze(1)
    fb = ForwardBatch(ForwardMode.DECODE, ids, lens - 1, torch.arange(bs) + 200, torch.arange(bs), lens,
                      lens.tolist(), [1] * bs, (lens - 1).tolist(), None, pool)
    fb.decode_kv_valid = torch.arange(keys).unsqueeze(0) < lens.unsqueeze(1)
    fb.decode_kv_slots = torch.where(fb.decode_kv_valid, slots, slots[:, :1])
    return fb


def _extracted() -> set[str]:
    """Folders torch's package loader (or ours) extracted into under the temp folder."""
    tmp = tempfile.gettempdir()
    return {n for n in os.listdir(tmp) if n.startswith(("aotinductor_", "gramsync-aoti-load-"))}


@pytest.mark.timeout(600)
def test_package_serves_another_pool_and_batch_as_eager_does(runner, tmp_path, monkeypatch):
    model = runner.model
    params = {name: p for name, p in model.named_parameters()}
    values = {name: p.detach().clone() for name, p in params.items()}
    packages = DecodePackages(str(tmp_path), runner.attn_backend, "[test]")
    before = _extracted()
    with torch.inference_mode():
        run = packages.load_or_build(model, _batch(_pool(runner, 256, 0), 3, 64), 2, 4,
                                     {"freezing": True}, "2-4")
    assert os.path.exists(packages.path("2-4"))
    # Where the CPU has AVX512, the graph's matmuls run the hand-written GEMV (cpu_gemv.py):
    # the logits below are then its, checked against the eager step's oneDNN / MKL ones.
    with zipfile.ZipFile(packages.path("2-4")) as z:
        meta = "".join(z.read(n).decode() for n in z.namelist() if n.endswith(".wrapper.json"))
    assert ("gramsync::small_linear" in meta) == cpu_runs(torch.float32)
    assert "gramsync::decode_attention" in meta  # attention reads the pool in place (cpu_decode_attention.cpp)
    assert _extracted() == before  # the loader's copy of the library is not left behind
    # The served model kept its own parameter objects, real and unchanged.
    assert {name: p for name, p in model.named_parameters()} == params
    assert all(not isinstance(p, torch._subclasses.FakeTensor) and torch.equal(p, values[n])
               for n, p in params.items())

    for bs, keys in ((4, 100), (2, 37)):
        served, eager = _pool(runner, 512, bs), _pool(runner, 512, bs)  # another pool size
        with torch.inference_mode():
            got = run(_batch(served, bs, keys))
            with monkeypatch.context() as m:  # the reference: eager on the torch attention path
                m.setenv("GRAMSYNC_CPU_DECODE_ATTENTION", "0")
                want = model(_batch(eager, bs, keys))
        assert got.shape == want.shape == (bs, runner.model_config.vocab_size)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
        for a, b in zip(served.k_buffer + served.v_buffer, eager.k_buffer + eager.v_buffer):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)  # the new slots written alike
        untouched = _pool(runner, 512, bs)
        written = torch.zeros(served.k_buffer[0].shape[1], dtype=torch.bool)  # slot 0: the dummy
        written[200:200 + bs] = True
        assert torch.equal(served.k_buffer[0][:, ~written], untouched.k_buffer[0][:, ~written])
        assert not torch.equal(served.k_buffer[0][:, written], untouched.k_buffer[0][:, written])


def test_a_folder_of_its_own_is_removed_once_loaded(runner):
    packages = DecodePackages(None, runner.attn_backend, "[test]")
    assert os.path.isdir(packages.folder)
    packages.done()
    assert not os.path.exists(packages.folder)


@pytest.mark.timeout(600)
def test_cpu_int4_model_builds_a_package_that_matches_its_eager_step(tiny_dir, tmp_path):
    """``--torchao-config int4wo-32`` on CPU (int4 decoder on torch's op, int8 LM head on ours
    or torch's, plain tensors) exports and compiles like the plain model, and the package's
    logits are the eager int4 step's."""
    pytest.importorskip("torchao")
    from distributed.parallel_state import SINGLE_RANK, RankInfo
    from srt.layers.cpu_int8_linear import Int8Weight
    from srt.layers.cpu_qgemv import PanelInt8, SmallBatchQuantized
    from srt.model_executor.model_config import ModelConfig
    from srt.model_executor.model_runner import ModelRunner
    from srt.server_args import ServerArgs, parse_model_overrides

    overrides = '{"num_hidden_layers": 1}'
    args = ServerArgs(model_path=tiny_dir, dtype="float32", max_running_requests=2, max_total_tokens=256,
                      json_model_override_args=overrides, disable_torch_compile=True,
                      torchao_config="int4wo-32")
    runner = ModelRunner(args, ModelConfig.from_path(tiny_dir, None, parse_model_overrides(overrides)),
                         RankInfo(), SINGLE_RANK)
    head = runner.model.lm_head.packed_weight
    # Our int8 GEMV where the CPU has AVX512-BF16, else torch's kernel (bf16 activations either way).
    assert isinstance(head, SmallBatchQuantized) and isinstance(head.quantized, (Int8Weight, PanelInt8))
    packages = DecodePackages(str(tmp_path), runner.attn_backend, "[test]")
    with torch.inference_mode():
        run = packages.load_or_build(runner.model, _batch(_pool(runner, 256, 0), 1, 64), 1, 1,
                                     {"freezing": True}, "1")
        for keys in (64, 30):
            served, eager = _pool(runner, 512, keys), _pool(runner, 512, keys)
            got = run(_batch(served, 1, keys))
            want = runner.model(_batch(eager, 1, keys))
            assert got.shape == want.shape == (1, runner.model_config.vocab_size)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)  # equal bit for bit here


def test_flat_inputs_follow_pytree_order():
    """The package is called with ``flat_graph_inputs`` instead of the loader's pytree
    flattening: the same tensors, in the same order, for any layer count."""
    from torch.utils import _pytree as pytree

    from srt.model_executor.compiled.aoti_decode import flat_graph_inputs

    for layers in (1, 3):
        inputs = (*(torch.zeros(1) for _ in range(5)), [torch.zeros(2) for _ in range(layers)],
                  [torch.zeros(3) for _ in range(layers)])
        flat = flat_graph_inputs(inputs)
        leaves = pytree.tree_leaves((inputs, {}))
        assert len(flat) == len(leaves) == 5 + 2 * layers
        assert all(a is b for a, b in zip(flat, leaves))
