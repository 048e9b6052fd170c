"""The decode step compiled with torch.compile (Inductor), with a safe eager fallback.

What is compiled: the whole model forward of a DECODE batch (embedding, every layer with
its attention over the paged pool, final norm, LM head) as one graph. Inductor's
``freezing`` folds the weights in as constants and prepacks them for oneDNN, which is where
most of the speed comes from on CPU (docs/speed.md), and the layers' small ops (norms,
rotary, residual adds, SiLU) fuse into a few loops. Up to 16 rows a step is a weight
read: on a CPU with AVX-512 (bf16 also needs AVX512-BF16) those graphs' linears call
gramsync's own GEMV (``srt/layers/cpu_gemv.py``: 0.75-0.9x oneDNN's step there), whose
panel packing freezing folds at compile time; elsewhere they are compiled with
max-autotune, which picks Inductor's C++ GEMM template per weight shape where it beats
ATen (fp32, and bf16 with AMX; bf16 without AMX leaves the template out:
``small_batch_options``).

Graphs: batch 1 (static), batches 2-16 (dynamic; 2-4 and 5-16 for bf16 on a CPU with AMX
tiles, where oneDNN's matmul beats the GEMVs from 5 rows) and batches 17 to
``--torch-compile-max-bs`` (dynamic, oneDNN: compute-bound there), each dynamic graph
keeping the batch size and the longest sequence dynamic so it serves its whole range
without recompiling. We chose this over padding to one graph per bucket because each
bucket is another full compile (over a minute each on 2 cores) and padding computes rows
nobody asked for. Larger batches run eagerly; prefill has its own compiled path.
Inductor's work is kept on disk per checkpoint, flags, torch and CPU
(``compiled/cache.py``), so a restart loads it instead of compiling again (docs/speed.md
"Restarts"). On CPU at TP=1 the same graphs (same options, same batch ranges) are built as
AOTInductor packages instead (``aoti_decode.py``): a restart loads them without tracing,
and a step runs the generated code with no Dynamo guards in front of it.

When: a first compile takes four to seven minutes on 2 cores (three graphs and the
prefill's), so it runs aside at start-up (``compiled/builder.py``, then a background thread
that loads the build) while the server already answers with the eager step, and the scheduler switches to the compiled step once every graph exists (fp32
outputs are identical, tested). At TP > 1 the warm-up's collectives stay local
(``without_peers``: the peers are serving), and every rank switches in the same agreed
iteration (``compiled/switch.py``). Any failure (no C++ compiler, an unsupported op) logs
a warning and the step stays eager (at TP > 1 on every rank, by the same agreement).
Prefill has its own compiled path (``compiled/prefill.py``), warmed up first on the same
thread.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from srt.model_executor.compiled.aoti_decode import DecodePackages
from srt.model_executor.compiled.cache import cpu_flags
from srt.model_executor.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

# Tensors of a decode ForwardBatch whose first dim is the batch size.
_BATCH_DIM_FIELDS = ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens",
                     "decode_kv_slots", "decode_kv_valid")


_FREEZE = {"freezing": True}
_AUTOTUNE = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}
# Up to this many rows a decode step is a weight read, where Inductor's C++ GEMM template
# (picked per weight shape by max-autotune against ATen) streams the weights ~1.6-2x faster
# than oneDNN's packed GEMM (fp32 AVX2, SmolLM2 shapes: 32 vs 57 ms at 2 rows, 39 vs 78 at
# 8, 65 vs 99 at 16; docs/speed-history.md). Above it the batch is compute and oneDNN is the faster.
SMALL_BATCH_MAX = 16
# The small graph is traced (and autotuned) at 8 rows, not 16: max-autotune times each
# GEMM alone, with its weight warm in L3, and at 16 rows it then picked oneDNN for the MLP's
# gate_up, which in the real step (weights streaming from memory) took 1.1 ms per call
# where the template takes ~0.6; at 8 it picks the template for every shape, which serves
# 16 rows as fast as a graph traced at 16 (fp32 AVX2, docs/speed-history.md).
SMALL_BATCH_TRACE = 8


def small_batch_options(dtype: torch.dtype, flags: list[str], dense: bool = True) -> dict:
    """The options of the graphs up to SMALL_BATCH_MAX rows. bf16 without AMX leaves the
    C++ template out: its bf16 micro-kernel there widens every weight to fp32 (no AMX tile
    kernel), and max-autotune, timing each GEMM with its weight warm in cache, still picks
    it for batch 1, where in the real step (weights streaming from memory) oneDNN's packed
    bf16 GEMM is faster: batch-1 step 13.4 against 10.0 ms, 2-16 rows equal (AMD EPYC,
    AVX512-BF16, docs/speed-history.md). With AMX, and in fp32, the template stays a candidate,
    and so it does for a CPU int4 model (``dense=False``: no dense bf16 GEMM left, and the
    template's weight-only int8 kernel beats ATen's for its LM head: batch-1 step 3.4-3.8
    against 4.1-4.6 ms, AMD EPYC)."""
    if dtype == torch.bfloat16 and "amx_bf16" not in flags and dense:
        return {**_AUTOTUNE, "max_autotune_gemm_backends": "ATEN"}
    return _AUTOTUNE


def _has_dense_linear(model: torch.nn.Module) -> bool:
    """False where every linear layer runs a weight-only int4 / int8 kernel (CPU int4) in
    every graph of up to SMALL_BATCH_MAX rows."""
    from srt.layers.cpu_qgemv import QUANTIZED, SmallBatchQuantized

    def quantized(w) -> bool:
        if isinstance(w, SmallBatchQuantized) and w.max_rows >= SMALL_BATCH_MAX:
            w = w.quantized
        return isinstance(w, QUANTIZED)

    layers = [m for m in model.modules() if hasattr(m, "packed_weight")]
    return not layers or any(not quantized(m.packed_weight) for m in layers)


@dataclass(frozen=True)
class _Graph:
    """One compiled graph and the batch sizes it serves."""
    lo: int
    hi: int
    compiled: Callable | None  # None where the graph is an AOTInductor package
    label: str
    trace_bs: int
    options: dict


class CompiledDecode:
    def __init__(self, model: torch.nn.Module, max_bs: int, log_prefix: str,
                 packages: DecodePackages | None = None):
        """``packages``: build and load each graph as an AOTInductor package there
        (aoti_decode.py: CPU, TP=1) instead of ``torch.compile``'s graphs."""
        self.max_bs = max_bs
        self.log_prefix = log_prefix
        self.failed = False
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._eager = model
        self._packages = packages
        self._runners: dict[str, Callable] = {}  # label -> loaded package (packages only)
        # freezing: weights become constants (oneDNN-prepacked); needs no-grad/inference.
        # Batch 1 is static (Dynamo specializes a dimension of size 1 anyway); the others
        # keep B and S dynamic so a graph serves its whole range without recompiling.
        small_hi = min(SMALL_BATCH_MAX, max_bs)
        dtype = next(model.parameters()).dtype
        small = small_batch_options(dtype, cpu_flags(), _has_dense_linear(model))
        ranges = [(1, 1, 1, small)]  # lo, hi, trace batch, options
        # With AMX (bf16) the GEMVs serve up to 4 rows and oneDNN above: a graph each, so
        # each knows statically which it runs (cpu_gemv.gemv_max_rows).
        from srt.layers.cpu_gemv import gemv_max_rows

        split = gemv_max_rows(dtype)
        for lo, hi in ([(2, split), (split + 1, small_hi)] if 2 <= split < small_hi else [(2, small_hi)]):
            if hi >= lo:
                ranges.append((lo, hi, max(lo, min(hi, SMALL_BATCH_TRACE)), small))
        if max_bs > small_hi:
            ranges.append((small_hi + 1, max_bs, max_bs, _FREEZE))
        graphs = []
        for lo, hi, trace_bs, options in ranges:
            compiled = None if packages else torch.compile(model, dynamic=False if hi == 1 else None,
                                                           options=dict(options))
            graphs.append(_Graph(lo, hi, compiled, "1" if hi == 1 else f"{lo}-{hi}", trace_bs, options))
        self._graphs = tuple(graphs)

    def _graph_for(self, bs: int) -> _Graph:
        return next(g for g in self._graphs if g.lo <= bs <= g.hi)

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and not self.failed

    @property
    def warmed_up(self) -> bool:
        """The warm-up thread has finished (compiled or failed): nothing compiles beside us."""
        return self._ready.is_set()

    def can_run(self, fb: ForwardBatch) -> bool:
        return self.ready and fb.batch_size <= self.max_bs

    @property
    def kind(self) -> str:
        return "AOTInductor packages" if self._packages else "torch.compile"

    def __call__(self, fb: ForwardBatch) -> torch.Tensor:
        if self._packages is not None:
            return self._run_package(fb)
        graph = self._graph_for(fb.batch_size)
        if fb.batch_size > 1:  # B and S dynamic: no recompiles as the batch changes
            for name in _BATCH_DIM_FIELDS:  # bounded: the 2-16 graph knows its rows are few (cpu_gemv)
                torch._dynamo.mark_dynamic(getattr(fb, name), 0, min=graph.lo, max=graph.hi)
        torch._dynamo.mark_dynamic(fb.decode_kv_slots, 1)
        torch._dynamo.mark_dynamic(fb.decode_kv_valid, 1)
        try:
            # Dynamo lifts the weights as freezable constants only when the *global*
            # Inductor flag is on while it traces (torch.compile's options reach Inductor,
            # not Dynamo): without this every weight stays a graph input and is never
            # prepacked. Patched per call because a recompile traces inside a served step.
            with torch._inductor.config.patch(freezing=True):
                return graph.compiled(fb)
        except Exception as e:  # noqa: BLE001 - any compiler failure falls back to eager
            self.failed = True
            logger.warning("%s torch.compile failed (%s: %s); decoding eagerly from now on",
                           self.log_prefix, type(e).__name__, str(e)[:500])
            return self._eager(fb)

    def _run_package(self, fb: ForwardBatch) -> torch.Tensor:
        graph = self._graph_for(fb.batch_size)
        try:
            run = self._runners.get(graph.label)
            if run is None:  # the warm-up's step for this graph: build (if need be) and load
                run = self._runners[graph.label] = self._packages.load_or_build(
                    self._eager, fb, graph.lo, graph.hi, graph.options, graph.label)
            return run(fb)
        except Exception as e:  # noqa: BLE001 - any compiler or loader failure falls back to eager
            self.failed = True
            logger.warning("%s AOTInductor decode graph failed (%s: %s); decoding eagerly from now on",
                           self.log_prefix, type(e).__name__, str(e)[:500])
            return self._eager(fb)

    def start(self, run_compiled_step: Callable[[int], None], background: bool,
              first: Callable[[], None] | None = None, done: Callable[[], None] | None = None) -> None:
        """Compile every graph now, not inside a request.

        ``run_compiled_step(bs)`` must build its batch as the scheduler does (outside
        inference mode) and run it through ``self`` as ``ModelRunner.forward`` does (in
        inference mode): Dynamo guards on how each tensor was made, and a mismatch would
        recompile inside the first served steps. ``first`` runs before, on the same thread
        (the compiled prefill's warm-up: one compile at a time on the node's cores);
        ``done`` after, whatever the outcome (it checks ``ready`` itself)."""
        if background:
            self._thread = threading.Thread(target=self._warm_up, args=(run_compiled_step, first, done),
                                            name="compile-decode", daemon=True)
            self._thread.start()
        else:
            self._warm_up(run_compiled_step, first, done)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until compiling has finished (or failed); True if the compiled step is in use."""
        self._ready.wait(timeout)
        return self.ready

    def _warm_up(self, run_compiled_step: Callable[[int], None], first: Callable[[], None] | None,
                 done: Callable[[], None] | None) -> None:
        if first is not None:
            first()
        guarded_warm_up(self, "decode step", lambda: self._compile_graphs(run_compiled_step))
        if self._packages is not None:
            self._packages.done()
        if done is not None:
            done()

    def _compile_graphs(self, run_compiled_step: Callable[[int], None]) -> None:
        t = time.monotonic()
        # Each graph is traced at its trace_bs: Inductor prepacks the frozen weights (and
        # max-autotune picks its GEMM kernels) for the trace-time batch size.
        for graph in self._graphs:
            t_graph = time.monotonic()
            logger.info("%s compiling the decode step (batch %s) ...", self.log_prefix, graph.label)
            with torch.no_grad():  # grad mode is thread-local; the step sets inference mode
                run_compiled_step(graph.trace_bs)
            if self.failed:
                return
            logger.info("%s batch %s graph ready in %.1f s", self.log_prefix, graph.label,
                        time.monotonic() - t_graph)
        logger.info("%s decode step compiled (%s) in %.1f s; using it for batches up to %d",
                    self.log_prefix, self.kind, time.monotonic() - t, self.max_bs)


def guarded_warm_up(step, what: str, compile_graphs: Callable[[], None]) -> None:
    """Run ``compile_graphs``; a failure marks ``step`` failed (it stays eager) instead of
    killing the rank. ``step``'s ready event is set either way."""
    try:
        compile_graphs()
    except Exception as e:  # noqa: BLE001 - a warm-up failure must not kill the rank
        step.failed = True
        logger.warning("%s compiling the %s failed (%s: %s); staying eager",
                       step.log_prefix, what, type(e).__name__, str(e)[:500])
    finally:
        step._ready.set()
