"""The prefill (EXTEND) step compiled with torch.compile around its attention.

Prefill of many short prompts (evaluation harnesses scoring hundreds of ~64-token
prompts) is linear layers, LM head and small ops; measured on the in-process scheduler
(benchmark/bench_scoring.py, bf16, 2 cores), the eager step spent ~9% in norms, rotary,
SiLU and adds, one pass over memory each. Compiled, they fuse into a few loops: ~5% more
tokens/s scoring prompts (docs/speed.md, "Evaluate the served model").

What is compiled: each decoder layer's two halves around attention
(``pre_attention``: residual add, norm, q/k/v projection, rotary;
``post_attention``: o_proj, residual add, norm, MLP) and the final norm + LM head
(the LM's ``logits``). Attention stays eager between them, except a MIXED step's decode
rows' (``decode_attention``, one graph for every layer): it loops over the batch's
sequences (SDPA per sequence), whose number and lengths change every step. Each half is
one graph shared by all layers (the layer's weights are graph inputs, not constants), with
the token count dynamic, so a few graphs serve every prefill batch.

When and where: on CPU, wherever the decode step compiles (``--disable-torch-compile``
turns both off). It compiles on the decode step's warm-up thread, before the decode graphs
(~10 s), and serves once that whole warm-up is over (``--wait-for-torch-compile`` waits
for it; at TP > 1 from the step every rank agreed on, ``compiled/switch.py``); until then
prefill runs eagerly. Any compiler failure logs a warning and prefill stays eager.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

import torch

from srt.model_executor.compiled.decode import guarded_warm_up
from srt.model_executor.forward_batch import ForwardMode
from srt.layers.attention.torch_native import decode_attention

logger = logging.getLogger(__name__)


class LayerHalves:
    """Compiled ``pre_attention`` / ``post_attention`` / ``logits`` of ``model``'s layer and
    LM classes (models/decoder_stack.py ``LayerHalves``)."""

    def __init__(self, model: torch.nn.Module):
        layer = type(model.model.layers[model.stage.start])
        self.pre = torch.compile(layer.pre_attention, dynamic=True)
        self.post = torch.compile(layer.post_attention, dynamic=True)
        self.head = torch.compile(type(model).logits, dynamic=True)
        # A MIXED step's decode rows (--enable-mixed-chunk): batched attention over the pool,
        # eager ~3x slower (bf16, 25 rows x 250 keys: 3.3 vs 1.2 ms per layer).
        self.decode_attention = torch.compile(decode_attention, dynamic=True)


class CompiledPrefill:
    def __init__(self, model: torch.nn.Module, log_prefix: str):
        self.log_prefix = log_prefix
        self.failed = False
        self.steps = 0  # prefill steps run through the compiled graphs (warm-up included)
        self._ready = threading.Event()
        self._model = model
        self._halves = LayerHalves(model)

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and not self.failed

    def __call__(self, fb) -> torch.Tensor:
        self.steps += 1
        if fb.mode is ForwardMode.MIXED:
            fb.decode_part.decode_attention = self._halves.decode_attention
        try:
            return self._model.forward(fb, self._halves)
        except Exception as e:  # noqa: BLE001 - any compiler failure falls back to eager
            self.failed = True
            logger.warning("%s torch.compile of the prefill failed (%s: %s); prefilling eagerly "
                           "from now on", self.log_prefix, type(e).__name__, str(e)[:500])
            return self._model.forward(fb)

    def warm_up(self, run_prefill: Callable[[list[int], Optional[list[int]]], None]) -> None:
        """Compile every graph now, not inside a request. ``run_prefill(lens, logit_rows)``
        must run a prefill of fresh sequences of those lengths through ``self`` as
        ``ModelRunner.forward`` does (inference mode), writing only the dummy KV slot."""
        guarded_warm_up(self, "prefill step", lambda: self._compile_graphs(run_prefill))

    def _compile_graphs(self, run_prefill) -> None:
        t = time.monotonic()
        logger.info("%s compiling the prefill step ...", self.log_prefix)
        with torch.no_grad():
            # Dynamic token counts from the first trace; a one-token prefill and one row
            # of logits are specialised by Dynamo, so they are traced here too, as is the
            # LM head over prompt-logprob rows (kept in the model's dtype).
            for lens, rows in (([7, 13], None), ([5, 9, 22], [4, 13, 35, 0, 1, 2]), ([1], None),
                               ([1], [0])):
                run_prefill(lens, rows)
                if self.failed:
                    return
            self._trace_decode_attention()
        logger.info("%s prefill step compiled in %.1f s", self.log_prefix, time.monotonic() - t)

    def _trace_decode_attention(self) -> None:
        """Two batch shapes (B and S dynamic from the second) on a small dummy pool; the
        pool's size is dynamic too, so the graph serves the real one."""
        attn = self._model.model.layers[0].self_attn.attn
        kvh, d = attn.num_kv_heads, attn.head_dim
        dtype = self._model.model.embed_tokens.weight.dtype
        for b, s in ((2, 7), (3, 11)):
            k = torch.zeros(kvh, 40 + s, d, dtype=dtype)
            slots = torch.zeros(b, s, dtype=torch.int64)
            valid = torch.ones(b, s, dtype=torch.bool)
            with torch.inference_mode():  # as the served step runs it
                self._halves.decode_attention(torch.zeros(b, attn.num_heads, d, dtype=dtype), k,
                                              k.clone(), slots, valid, kvh, attn.scaling)
