"""Owns the model and the KV cache of one rank; runs a forward pass and sampling."""
from __future__ import annotations

import logging
from functools import partial
from typing import Optional, Sequence

import psutil
import torch

from distributed.communication import tp_min_int, without_peers
from distributed.parallel_state import RankInfo, TPGroup
from distributed.pipeline import PipelineGroup
from sampling.check_first import can_check_first, greedy_if_allowed
from sampling.logprobs import log_softmax_rows
from sampling.sampler import Sampler
from sampling.sampling_params import MAX_TOP_LOGPROBS
from sampling.sampling_batch_info import SamplingBatchInfo
from srt import environ
from srt.model_executor.compiled.aoti_decode import DecodePackages
from srt.model_executor.compiled.builder import BuildOrder, CompileBuilder
from srt.model_executor.compiled.cache import cache_complete, cpu_flags, inductor_cache_counts, mark_complete, use_compile_cache
from srt.model_executor.compiled.decode import CompiledDecode
from srt.model_executor.extend_as_decode import extend_as_decode
from srt.model_executor.compiled.prefill import CompiledPrefill
from srt.model_executor.compiled.switch import CompiledSwitch
from srt.model_executor.cuda_graph_runner import CudaGraphRunner, real_length_inputs
from srt.model_executor.forward_batch import ForwardBatch, ForwardMode
from srt.model_executor.gguf_int4 import gguf_int4_choice, load_gguf_int4
from srt.layers.attention import create_attention_backend
from srt.layers.attention.layer import prepare_attention
from srt.layers.weight_packing import pack_linear_weights
from srt.layers.quantization import apply_torchao_config
from srt.layers.linear_attention.state_batch import build_state_batch
from srt.mem_cache.linear_state_pool import LinearStatePool, state_pool_for
from srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool, TokenToKVPoolAllocator
from srt.mem_cache.prompt_logprob_pool import PromptLogprobPool
from srt.model_executor.model_config import ModelConfig
from srt.model_executor.model_loader import load_model
from srt.model_executor.pipeline_forward import PipelineForward, stage_layers
from srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 matmuls run 2-4x faster than fp32 (measured on Zen 4)."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(server_args: ServerArgs, device: str) -> torch.dtype:
    if server_args.dtype != "auto":
        return _DTYPES[server_args.dtype]
    if device.startswith("cuda"):
        return torch.bfloat16
    # Without native bf16 (e.g. AVX2-only CPUs) bf16 matmuls are emulated and slower than fp32.
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


class ModelRunner:
    def __init__(self, server_args: ServerArgs, model_config: ModelConfig,
                 rank_info: RankInfo, tp: TPGroup, builder_folder: Optional[str] = None,
                 pipeline: Optional[PipelineGroup] = None):
        self.server_args = server_args
        self.model_config = model_config
        self.rank_info = rank_info
        self.tp = tp
        # --pp-size > 1: this stage's layers; start-up agreements span the DP group.
        self.pipeline = pipeline
        self.ctrl = pipeline.ctrl if pipeline is not None else tp
        self.stage = stage_layers(model_config.num_hidden_layers, rank_info.pp_rank, rank_info.pp_size,
                                  server_args.pp_layer_partition)
        self.device = server_args.resolved_device()
        if self.device == "cuda":
            torch.cuda.set_device(rank_info.local_rank)
            self.device = f"cuda:{rank_info.local_rank}"
        self.dtype = resolve_dtype(server_args, self.device)
        self.model = load_model(model_config, tp, self.dtype, self.device, self.stage,
                                server_args.ep_size)
        self.is_hybrid = self.model.is_hybrid  # GDN layers: a state pool, eager steps (hybrid_limits.py)
        self.state_bytes_per_slot = self._state_bytes_per_slot()
        if server_args.torchao_config and self.model.has_experts:
            raise ValueError(f"--torchao-config {server_args.torchao_config}: quantized experts are not "
                             f"built yet, and {model_config.architecture}'s weights are mostly experts; "
                             "serve it unquantized (docs/models.md)")
        if server_args.torchao_config:
            apply_torchao_config(self.model, server_args.torchao_config, self.device, rank_info.log_prefix)
        self.gguf_int4 = self._load_gguf_int4()
        # oneDNN-packed weights for the eager step; with torchao's int4 only a layer that
        # neither the int4 nor the int8 kernel took (none where torch has both); a GGUF's
        # codes keep their dense rows for the compiled graphs unless it runs eagerly.
        if self.device == "cpu" and environ.GRAMSYNC_CPU_PACKED_LINEAR.get() and (
                self._torchao_int4() or not (server_args.torchao_config or self._want_compile())):
            pack_linear_weights(self.model, self.dtype, rank_info.log_prefix)
        elif self.device == "cpu" and environ.GRAMSYNC_CPU_PACKED_LINEAR.get() and self.gguf_int4:
            pack_linear_weights(self.model, self.dtype, rank_info.log_prefix, compiled=True)
        # Every rank of the DP group must allocate identically: take the group's minimum.
        self.max_total_num_tokens = tp_min_int(self._profile_max_num_tokens(), self.ctrl)
        self.max_running_requests = server_args.max_running()
        self.context_len = model_config.context_len
        self._init_memory_pool()
        self.sampler = Sampler(rank_info.log_prefix)
        self.attn_backend = create_attention_backend(server_args.attention_backend, self.device)
        self.compiled_decode = self.compiled_prefill = self.compile_builder = None
        if self._want_compile():
            self._start_compiling(builder_folder)
        self.compiled_switch = CompiledSwitch(self.compiled_decode, self.compiled_prefill, self.ctrl,
                                              rank_info.log_prefix)
        self.cuda_graph_runner = self._capture_cuda_graphs() if self._want_cuda_graph() else None
        self.pipeline_forward = None if pipeline is None else PipelineForward(
            self.model, pipeline, self.attn_backend, self.dtype, self.device,
            server_args.pp_max_micro_batch_size, self.state_pool)

    def _load_gguf_int4(self) -> bool:
        """A 4-bit GGUF on CPU serves its own codes (gguf_int4.py); the log says what is
        served and why, on every start from a GGUF."""
        prefix = self.rank_info.log_prefix
        use, why = gguf_int4_choice(self.server_args, self.model_config.model_path, self.device, self.model)
        if use:
            try:
                load_gguf_int4(self.model, self.model_config.model_path, prefix)
            except ValueError as e:  # the same file and layout on every rank: they all fall back
                use, why = False, f"not every linear layer can take them ({e})"
        if why:
            logger.info("%s weights: %s (%s)", prefix, "the GGUF's own 4-bit codes, int8 LM head" if use
                        else f"dense {str(self.dtype).removeprefix('torch.')}", why)
        return use

    def _start_compiling(self, builder_folder: Optional[str]) -> None:
        """Compile the decode step (and, on CPU, the prefill) from the rank's compile cache:
        at once where a complete build is there, else after a builder process made it
        (``compiled/builder.py``), else (cache off, ``--wait-for-torch-compile``) here. Serve
        eagerly meanwhile unless ``--wait-for-torch-compile``; at TP > 1 the ranks switch
        in one agreed step (CompiledSwitch), and the warm-ups' collectives stay local.
        ``builder_folder``: this is the builder process (compiled/builder.py), building there."""
        args, prefix = self.server_args, self.rank_info.log_prefix
        max_bs = min(args.torch_compile_max_bs, self.max_running_requests)
        folder = builder_folder
        if self.device == "cpu" and folder is None:
            folder = use_compile_cache(args, self.model_config.model_path, self.dtype, self.tp.size,
                                       self.tp.rank, max_bs, prefix,
                                       weights="gguf-int4" if self.gguf_int4 else "checkpoint")
        packages = DecodePackages(folder, self.attn_backend, prefix) if self._decode_as_packages() else None
        decode = self.compiled_decode = CompiledDecode(self.model, max_bs, prefix, packages)
        prefill = self.compiled_prefill = CompiledPrefill(self.model, prefix) if self.device == "cpu" else None
        background = not args.wait_for_torch_compile
        first = [partial(prefill.warm_up, self._run_warm_up_prefill)] if prefill else []
        if folder and builder_folder is None and background and not cache_complete(folder):
            try:
                self.compile_builder = CompileBuilder(BuildOrder(
                    args, self.model_config.model_path, self.rank_info, self.tp.rank, self.tp.size,
                    self.tp.name, self.max_total_num_tokens, folder, torch.get_num_threads()), prefix)
                first.insert(0, self.compile_builder.wait)
            except OSError as e:  # no process to spare: compile in the warm-up thread instead
                logger.warning("%s could not start the compile builder (%s); compiling in process", prefix, e)

        def done() -> None:
            ok = decode.ready and (prefill is None or prefill.ready)
            if ok and folder:
                mark_complete(folder)
            logger.info("%s compiled steps %s (Inductor's cache: %s)", prefix, "ready" if ok else "not in use",
                        inductor_cache_counts())

        decode.start(self._run_warm_up_step, background=background,
                     first=lambda: [step() for step in first], done=done)

    def _decode_as_packages(self) -> bool:
        """AOTInductor packages for the decode graphs (aoti_decode.py): on CPU at TP=1, on
        plain weights or CPU int4 (torch's own int4 / int8 ops on plain tensors); torchao's
        tensor subclasses (int8wo) and TP's in-graph collectives keep torch.compile."""
        return (self.device == "cpu" and self.tp.is_single
                and (not self.server_args.torchao_config or self._cpu_int4())
                and environ.GRAMSYNC_AOTI_DECODE.get())

    def _torchao_int4(self) -> bool:
        return self.device == "cpu" and (self.server_args.torchao_config or "").startswith("int4wo-")

    def _cpu_int4(self) -> bool:
        """torch's CPU int4 kernel in the linear layers: torchao's int4 or a GGUF's own codes."""
        return self._torchao_int4() or self.gguf_int4

    def _want_compile(self) -> bool:
        args = self.server_args
        # Stages and hybrid models run eagerly (for now).
        if args.disable_torch_compile or self.pipeline is not None or self.is_hybrid:
            return False
        if args.enable_torch_compile:
            return True
        # auto: measured faster on CPU (docs/speed.md); on CUDA, CUDA graphs instead;
        # torchao's quantized tensors (int8wo) took over 5 minutes to compile here. CPU int4
        # at TP=1 builds AOTInductor packages like the plain model (~1 minute a graph).
        return (environ.GRAMSYNC_TORCH_COMPILE_AUTO.get() and self.device == "cpu"
                and (not (args.torchao_config or self.gguf_int4) or (self._cpu_int4() and self.tp.is_single)))

    def _want_cuda_graph(self) -> bool:
        args = self.server_args
        # torch_native builds host-side metadata per step, and a compiled step is not captured.
        return (self.device.startswith("cuda") and not args.disable_cuda_graph and self.pipeline is None
                and not self.is_hybrid
                and self.attn_backend.name == "triton" and self.compiled_decode is None)

    def _capture_cuda_graphs(self) -> CudaGraphRunner | None:
        runner = CudaGraphRunner(self.model, min(self.server_args.cuda_graph_max_bs, self.max_running_requests),
                                 self._graph_batch, self.device, self.rank_info.log_prefix)
        try:
            runner.capture()
            ok = runner.self_check(atol=1e-2, check_inputs=self._graph_check_inputs)
        except Exception as e:  # noqa: BLE001 - a capture failure must not kill the rank
            logger.warning("%s CUDA graph capture failed (%s: %s)", self.rank_info.log_prefix,
                           type(e).__name__, str(e)[:500])
            ok = False
        finally:
            self.req_to_token_pool.req_to_token.zero_()  # as before the check: no request yet
        if not tp_min_int(int(ok), self.ctrl):  # every rank replays, or none does
            logger.warning("%s CUDA graphs disabled; decoding eagerly", self.rank_info.log_prefix)
            runner.disable()
            return None
        logger.info("%s CUDA graphs captured for decode batches %s", self.rank_info.log_prefix,
                    runner.batch_sizes)
        return runner

    def _graph_check_inputs(self, bs: int) -> dict:
        """Start-up only (no request yet): the self-check's batch at serving lengths."""
        return real_length_inputs(bs, self.req_to_token_pool.req_to_token, self.token_to_kv_pool)

    def _graph_batch(self, t: dict) -> ForwardBatch:
        bs = t["seq_lens"].shape[0]
        fb = ForwardBatch(ForwardMode.DECODE, t["input_ids"], t["positions"], t["out_cache_loc"],
                          t["req_pool_indices"], t["seq_lens"], [1] * bs, [1] * bs, [0] * bs,
                          self.req_to_token_pool, self.token_to_kv_pool)
        self._prepare(fb)
        return fb

    def _run_warm_up_step(self, bs: int) -> None:
        fb = self._warm_up_batch(bs)  # made as the scheduler makes batches: normal tensors
        with torch.inference_mode(), without_peers(self.tp):  # as forward() runs a decode step
            self._prepare(fb)
            self.compiled_decode(fb)

    def _run_warm_up_prefill(self, lens: list[int], logit_rows: Optional[list[int]]) -> None:
        """A prefill of fresh sequences of ``lens`` tokens whose K/V all go to the dummy
        slot 0 (never a request's); attention reads only the batch's own new keys."""
        dev, total = self.device, sum(lens)
        zeros = torch.zeros(total, dtype=torch.int64, device=dev)
        positions = torch.cat([torch.arange(n, device=dev) for n in lens])
        fb = ForwardBatch(ForwardMode.EXTEND, zeros, positions, zeros.clone(),
                          torch.zeros(len(lens), dtype=torch.int64, device=dev),
                          torch.tensor(lens, device=dev), list(lens), list(lens), [0] * len(lens),
                          self.req_to_token_pool, self.token_to_kv_pool, logit_rows=logit_rows)
        with torch.inference_mode(), without_peers(self.tp):  # as forward() runs it
            self._prepare(fb)
            self.compiled_prefill(fb)

    def _warm_up_batch(self, bs: int) -> ForwardBatch:
        """A decode batch that writes only the dummy KV slot 0 (never a request's slot)."""
        dev, seq = self.device, bs + 5  # seq != bs: Dynamo must not assume they are equal
        zeros = torch.zeros(bs, dtype=torch.int64, device=dev)
        lens = torch.full((bs,), seq, dtype=torch.int64, device=dev)
        # Its slot table is row 0 of req_to_token: zeros until a request takes that row, and
        # any slots read then are only read; the one write goes to the dummy slot 0.
        return ForwardBatch(ForwardMode.DECODE, zeros, zeros.clone(), zeros.clone(), zeros.clone(),
                            lens, [seq] * bs, [1] * bs, [seq - 1] * bs, self.req_to_token_pool,
                            self.token_to_kv_pool)

    def _kv_layers(self) -> int:
        """This stage's layers that keep KV (a hybrid model's full-attention layers only)."""
        return self.model.attention_layer_count() if self.is_hybrid else self.stage.end - self.stage.start

    def _kv_bytes_per_token(self) -> int:
        cfg = self.model_config
        return MHATokenToKVPool.bytes_per_token(
            self._kv_layers(), cfg.num_kv_heads_per_rank(self.tp.size), cfg.head_dim,
            self.dtype) + self.logprob_bytes_per_token()

    def _state_bytes_per_slot(self) -> int:
        """A hybrid model's recurrent state per running request (every GDN layer of the stage)."""
        layers = self.model.linear_layers() if self.is_hybrid else []
        if not layers:
            return 0
        conv, rec = layers[0].state_shapes()
        return LinearStatePool.bytes_per_slot(len(layers), conv, rec, self.dtype)

    def logprob_bytes_per_token(self) -> int:
        """Prompt logprobs kept with the radix cache: part of each KV token's budget."""
        args = self.server_args
        if args.disable_radix_cache or args.disable_prompt_logprob_cache:
            return 0
        return PromptLogprobPool.bytes_per_token(MAX_TOP_LOGPROBS)

    def _profile_max_num_tokens(self) -> int:
        """KV pool size from --max-total-tokens or this rank's free memory."""
        if self.server_args.max_total_tokens is not None:
            return self.server_args.max_total_tokens
        if self.device.startswith("cuda"):
            free, _ = torch.cuda.mem_get_info()
            frac = self.server_args.mem_fraction_static or 0.85
        else:
            free = psutil.virtual_memory().available
            frac = self.server_args.mem_fraction_static or 0.1
        # The state pool (one slot per running request) comes out of the same budget.
        states = self.state_bytes_per_slot * self.server_args.state_slots()
        tokens = (int(free * frac) - states) // self._kv_bytes_per_token()
        if tokens < 2:
            raise RuntimeError(f"Not enough memory for the KV cache ({free} bytes free"
                               + (f", {states} of the budget for the recurrent states" if states else "") + ").")
        return tokens

    def _init_memory_pool(self) -> None:
        cfg = self.model_config
        self.req_to_token_pool = ReqToTokenPool(
            self.max_running_requests, self.context_len + 1, self.device)
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(
            self.max_total_num_tokens, self.device)
        self.token_to_kv_pool = MHATokenToKVPool(
            self.max_total_num_tokens, self._kv_layers(),
            cfg.num_kv_heads_per_rank(self.tp.size), cfg.head_dim, self.dtype, self.device)
        lp_bytes = self.logprob_bytes_per_token()
        self.prompt_logprob_pool = PromptLogprobPool(
            self.max_total_num_tokens, MAX_TOP_LOGPROBS, self.rank_info.is_entry_rank,
            self.device) if lp_bytes else None
        logger.info("%s KV cache: %d tokens (%.1f MiB, of which prompt-logprob cache %.1f MiB, "
                    "%d B/token)", self.rank_info.log_prefix, self.max_total_num_tokens,
                    self.max_total_num_tokens * self._kv_bytes_per_token() / 2**20,
                    self.max_total_num_tokens * lp_bytes / 2**20, lp_bytes)
        # Running requests' slots first (slot = table row), then the radix cache's checkpoints.
        self.state_pool = state_pool_for(self.model, self.server_args.state_slots(), self.device)
        if self.state_pool is not None:
            kv_per_token = self._kv_bytes_per_token() - lp_bytes
            logger.info("%s recurrent-state pool: %d slots (%d running requests, %d radix-cache "
                        "checkpoints) x %.2f MiB = %.1f MiB (%d GDN layers; a slot is %d tokens of KV)",
                        self.rank_info.log_prefix, self.state_pool.num_slots, self.max_running_requests,
                        self.state_pool.num_slots - self.max_running_requests,
                        self.state_bytes_per_slot / 2**20, self.state_pool.nbytes / 2**20,
                        self.state_pool.num_layers, self.state_bytes_per_slot // max(kv_per_token, 1))

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Logits of the rows the batch samples from; at --pp-size > 1 only the last stage
        has them, and the others get an empty ``[rows, 0]`` (srt/model_executor/pipeline_forward.py)."""
        if self.pipeline_forward is not None:
            return self.pipeline_forward(fb)
        switch = self.compiled_switch
        if fb.mode is ForwardMode.EXTEND and self.compiled_decode is not None:
            as_decode = extend_as_decode(fb, self.compiled_decode.max_bs)
            if as_decode is not None and switch.use_decode(as_decode[0]):
                decode, last_rows = as_decode
                self._prepare(decode)
                logits = self.compiled_decode(decode)
                return logits if last_rows is None else logits[last_rows]
        self._prepare(fb)
        if fb.mode is ForwardMode.DECODE:
            if switch.use_decode(fb):
                return self.compiled_decode(fb)
        elif switch.use_prefill():
            return self.compiled_prefill(fb)
        graphs = self.cuda_graph_runner
        if graphs is not None and graphs.can_run(fb):
            return graphs(fb)
        return self.model.forward(fb)

    def _prepare(self, fb: ForwardBatch) -> None:
        prepare_attention(self.attn_backend, fb)  # once per step, outside the layers
        if self.state_pool is not None:
            fb.linear_state = build_state_batch(fb, self.state_pool)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, info: SamplingBatchInfo,
               logprob_rows: Sequence[int] = (), check_first: bool = False,
               ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(token ids [B], logprobs [len(logprob_rows), V] of those rows or None): the
        logprobs describe the distribution --logprobs-mode names (sampling/logprobs.py).
        ``check_first``: a greedy batch may skip its grammar mask where every grammar allows
        the unmasked argmax (sampling/check_first.py; the same tokens)."""
        info.mask_checked_first = False
        if check_first and can_check_first(info, logprob_rows):
            info.vocab_mask = None  # penalties, processors and bias only
            info.apply_logits_bias(logits)
            ids = greedy_if_allowed(logits, info)
            if ids is not None:
                info.vocab_mask, info.mask_checked_first = None, True
                return ids, None
            info.update_regex_vocab_mask()  # rejected: mask what is already biased, then sample
            info.apply_vocab_mask(logits)
            return self.sampler(logits, info), None
        info.update_regex_vocab_mask()
        raw = self.server_args.logprobs_mode == "raw_logprobs"
        rows = torch.tensor(list(logprob_rows), dtype=torch.int64, device=logits.device) if logprob_rows else None
        logprobs = None
        if rows is not None and raw:
            logprobs = log_softmax_rows(logits[rows])
        info.apply_logits_bias(logits)
        if rows is not None and not raw:  # before the sampler, which may work in place
            logprobs = log_softmax_rows(logits[rows], info.temperatures[rows])
        return self.sampler(logits, info), logprobs
