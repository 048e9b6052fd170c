"""The decode graphs as AOTInductor packages: built once, loaded without tracing.

A graph compiled by ``torch.compile`` is rebuilt at every start even when Inductor's
cache holds its code: Dynamo traces the model again, AOTAutograd functionalizes it again
(torch bypasses its AOTAutograd cache whenever freezing is on) and the freezing passes
run again, minutes of Python on 2 cores (docs/speed.md, "Restarts"). And every step pays
Dynamo's guards on the module tree (~1.1 ms at batch 1) and its Python around the graph.

So on CPU at TP=1 each decode graph is exported (``torch.export``) as a function of
tensors only -- the batch's tokens, positions, KV slots, slot table and mask, and the KV
pool's per-layer buffers, which it writes in place -- and compiled ahead of time by
AOTInductor with the same options (``freezing``: the weights folded in and prepacked;
max-autotune up to 16 rows) into a ``.pt2`` package in the rank's keyed compile folder
(``compiled/cache.py``). Loading a package is a shared library and its constants: about a
second, no tracing. The call is the generated C++ directly: no guards.

The pool's token count is a dynamic dimension, so a package serves any KV-pool size; the
batch and key-count dimensions are dynamic where the graph serves a range of batches.
TP > 1 (collectives inside the graph), torchao's tensor subclasses and CUDA keep
``torch.compile`` (compiled/decode.py).
"""
from __future__ import annotations

import copy
import logging
import os
import shutil
import tempfile
import time
from typing import Callable

import torch
from torch import nn
from torch.export import Dim
from torch.utils import _pytree as pytree

from srt.model_executor.forward_batch import ForwardBatch, ForwardMode
from srt.layers.cpu_decode_attention_op import decode_attention_op_wanted
from srt.layers.cpu_gemv import gemv_wanted
from srt.layers.cpu_kernels import load_cpu_kernels

logger = logging.getLogger(__name__)

PACKAGE_SUFFIX = ".pt2"


class _PoolView:
    """The KV pool's interface the layers use (``set_kv`` and the buffers), over the
    graph's own input tensors, so export sees the pool as inputs it mutates rather than as
    constants to fold in."""

    def __init__(self, k_buffer: list[torch.Tensor], v_buffer: list[torch.Tensor]):
        self.k_buffer, self.v_buffer = k_buffer, v_buffer

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k_buffer[layer_id].index_copy_(1, loc, k.transpose(0, 1))
        self.v_buffer[layer_id].index_copy_(1, loc, v.transpose(0, 1))


class DecodeGraph(nn.Module):
    """A decode step of ``model`` as a function of tensors: what gets exported."""

    def __init__(self, model: nn.Module, attn_backend):
        super().__init__()
        self.model, self.attn_backend = model, attn_backend

    def forward(self, input_ids, positions, out_cache_loc, kv_slots, kv_valid, k_buffer, v_buffer):
        # req_pool_indices and seq_lens are not read by a decode forward once the slot
        # table is built (outside the graph); out_cache_loc stands in for their shape.
        fb = ForwardBatch(ForwardMode.DECODE, input_ids, positions, out_cache_loc, out_cache_loc,
                          out_cache_loc, [], [], [], None, _PoolView(k_buffer, v_buffer))
        fb.attn_backend = self.attn_backend
        fb.decode_kv_slots, fb.decode_kv_valid = kv_slots, kv_valid
        return self.model(fb)


def _module_tree_copy(module: nn.Module) -> nn.Module:
    """New module objects (and parameter / buffer dicts) over the same tensors and other
    attributes."""
    clone = copy.copy(module)
    clone._parameters, clone._buffers = dict(module._parameters), dict(module._buffers)
    clone._modules = {name: None if m is None else _module_tree_copy(m) for name, m in module._modules.items()}
    return clone


def graph_inputs(fb: ForwardBatch) -> tuple:
    pool = fb.token_to_kv_pool
    return (fb.input_ids, fb.positions, fb.out_cache_loc, fb.decode_kv_slots, fb.decode_kv_valid,
            pool.k_buffer, pool.v_buffer)


def flat_graph_inputs(inputs: tuple) -> list[torch.Tensor]:
    """``graph_inputs``' tensors in pytree's order: the five batch tensors, then each list."""
    *batch, k_buffers, v_buffers = inputs
    return [*batch, *k_buffers, *v_buffers]


def _dynamic_shapes(lo: int, hi: int, num_layers: int) -> tuple:
    tokens = Dim("pool_tokens", min=2)
    keys = Dim("keys", min=2)
    pool = [{1: tokens}] * num_layers
    if lo == hi:  # one batch size: only the key count and the pool vary
        return (None, None, None, {1: keys}, {1: keys}, pool, pool)
    rows = Dim("rows", min=lo, max=hi)
    return ({0: rows}, {0: rows}, {0: rows}, {0: rows, 1: keys}, {0: rows, 1: keys}, pool, pool)


def build_package(model: nn.Module, attn_backend, fb: ForwardBatch, lo: int, hi: int, options: dict,
                  path: str, log_prefix: str) -> None:
    """Export the decode step at ``fb``'s shapes (the example batch: its size is where
    max-autotune times the GEMMs) for batches ``lo``..``hi`` and compile it into ``path``
    (written aside, then renamed: a half-written package is never loaded)."""
    t = time.monotonic()
    # Export swaps the traced module's parameters for fake tensors while it traces; a copy
    # of the module tree that shares the parameters keeps the served model untouched (the
    # rank may be serving eagerly from another thread meanwhile).
    graph = DecodeGraph(_module_tree_copy(model), attn_backend).eval()
    # Example inputs made outside inference mode (the step's own are inference tensors,
    # which export does not take); the pool's stand-ins are never written (only traced).
    with torch.inference_mode(False), torch.no_grad():
        args = graph_inputs(fb)
        args = (*(t.clone() for t in args[:5]), [torch.empty_like(t) for t in args[5]],
                [torch.empty_like(t) for t in args[6]])
        program = torch.export.export(graph, args, dynamic_shapes=_dynamic_shapes(lo, hi, len(args[5])))
    exported = time.monotonic()
    tmp = f"{path}.{os.getpid()}.tmp{PACKAGE_SUFFIX}"
    torch._inductor.aoti_compile_and_package(program, package_path=tmp, inductor_configs=dict(options))
    os.replace(tmp, path)
    logger.info("%s decode package for batches %d-%d built (export %.1f s, compile %.1f s): %s",
                log_prefix, lo, hi, exported - t, time.monotonic() - exported, os.path.basename(path))


def load_package(path: str) -> Callable[[ForwardBatch], torch.Tensor]:
    """The package's runner. Torch's loader extracts the package (the shared library with
    the weights inside: ~300-500 MB) into a fresh folder under ``$TMPDIR`` and removes it
    only when the runner is destroyed, which a server never does before it exits (or is
    killed): every start would leave one such folder per graph in /tmp. So the loader
    extracts into a folder of ours, removed as soon as the library is mapped (Linux keeps
    a mapped file's data until it is unmapped)."""
    if gemv_wanted() or decode_attention_op_wanted():  # the graphs may call gramsync's ops: register them
        load_cpu_kernels()
    tempfile.gettempdir()  # Python's own temp folder decided now, not inside ours
    extract = tempfile.mkdtemp(prefix="gramsync-aoti-load-")
    previous = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = extract
    try:
        runner = torch._inductor.aoti_load_package(path)
    finally:
        if previous is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = previous
        shutil.rmtree(extract, ignore_errors=True)

    # The loader's own __call__ parses the package's input and output specs and flattens
    # the arguments (two lists of a tensor per layer) with pytree at every call: ~30 us a
    # step. The specs are read once here, the inputs flattened by their known layout, and
    # the layout checked against the package's spec at the first call.
    loader = runner.loader
    in_spec, out_spec = (pytree.treespec_loads(s) for s in loader.get_call_spec())
    checked = False

    def run(fb: ForwardBatch) -> torch.Tensor:
        nonlocal checked
        inputs = graph_inputs(fb)
        if not checked:
            if pytree.tree_structure((inputs, {})) != in_spec:
                raise RuntimeError(f"decode package {path}: its inputs are not graph_inputs()'s layout")
            checked = True
        return pytree.tree_unflatten(loader.boxed_run(flat_graph_inputs(inputs)), out_spec)

    return run


class DecodePackages:
    """A rank's decode packages: in its keyed compile folder (kept across restarts), or in
    a folder of its own, removed once loaded, where the compile cache is off."""

    def __init__(self, folder: str | None, attn_backend, log_prefix: str):
        self._temporary = folder is None
        self.folder = folder or tempfile.mkdtemp(prefix="gramsync-aoti-")
        self.attn_backend, self.log_prefix = attn_backend, log_prefix

    def path(self, label: str) -> str:
        return os.path.join(self.folder, f"decode-{label}{PACKAGE_SUFFIX}")

    def load_or_build(self, model: nn.Module, fb: ForwardBatch, lo: int, hi: int, options: dict,
                      label: str) -> Callable[[ForwardBatch], torch.Tensor]:
        path = self.path(label)
        if not os.path.exists(path):
            build_package(model, self.attn_backend, fb, lo, hi, options, path, self.log_prefix)
        t = time.monotonic()
        run = load_package(path)
        logger.info("%s decode package for batches %s loaded in %.2f s", self.log_prefix, label,
                    time.monotonic() - t)
        return run

    def done(self) -> None:
        """Every graph is loaded (the loader keeps its own copy of what it needs)."""
        if self._temporary:
            shutil.rmtree(self.folder, ignore_errors=True)
