"""``ServerArgs``: the one frozen configuration object; CLI flags are generated from it."""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import typing
from dataclasses import dataclass, field
from typing import Optional, Sequence


def _f(default, help: str, choices: Optional[Sequence] = None):
    return field(default=default, metadata={"help": help, "choices": choices})


# Running requests by default: a CPU step is compute-bound from about 16 rows (docs/speed.md
# "Running batch size on CPU"); on CUDA the previous default stays.
CPU_MAX_RUNNING_REQUESTS = 16
CUDA_MAX_RUNNING_REQUESTS = 64
TORCHAO_CONFIGS = ("int8wo", "int4wo-32", "int4wo-64", "int4wo-128", "int4wo-256")


def parse_model_overrides(text: Optional[str]) -> dict:
    """``--json-model-override-args`` as a dict; ValueError unless it is a JSON object."""
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--json-model-override-args is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError("--json-model-override-args must be a JSON object of config fields")
    return value


@dataclass(frozen=True)
class ServerArgs:
    # Model and tokenizer
    model_path: Optional[str] = _f(None, "Hugging Face directory or .gguf file (default: the embedded SmolLM2-135M-Instruct).")
    tokenizer_path: Optional[str] = _f(None, "Tokenizer directory (default: the model's).")
    served_model_name: Optional[str] = _f(None, "Model name reported by /v1/models (default: derived from the path).")
    chat_template: Optional[str] = _f(None, "Jinja chat template file overriding the tokenizer's.")
    context_length: Optional[int] = _f(None, "Maximum context length (default: from the model config).")
    json_model_override_args: Optional[str] = _f(None, "A JSON object of model config fields to override (SGLang's flag), e.g. '{\"num_hidden_layers\": 4}' serves the checkpoint's first 4 layers (tests, debugging).")
    dtype: str = _f("auto", "Weight and activation dtype (auto: bfloat16 on CUDA and on CPUs with native bf16 (AVX512-BF16/AMX), else float32).", ["auto", "float32", "float16", "bfloat16"])
    device: str = _f("auto", "cpu, cuda or auto.", ["auto", "cpu", "cuda"])
    # HTTP
    host: str = _f("127.0.0.1", "HTTP host.")
    port: int = _f(30000, "HTTP port.")
    graceful_shutdown_timeout: float = _f(20.0, "On SIGTERM: refuse new requests (503), let running ones finish for up to this many seconds, then end the rest with an error and exit 0 (docs/multi-rank.md 'Graceful shutdown'; SIGINT: at once).")
    # Security (docs/security.md)
    api_key: Optional[str] = _f(None, "Every endpoint but /health and /metrics needs 'Authorization: Bearer <key>' (default: $GRAMSYNC_API_KEY; unset: no key).")
    admin_api_key: Optional[str] = _f(None, "Key for the admin endpoints (/abort_request, /get_server_info); the --api-key does not grant them (default: $GRAMSYNC_ADMIN_API_KEY; unset: --api-key guards them).")
    max_request_bytes: int = _f(32 * 1024 * 1024, "Largest HTTP request body accepted (413 past it).")
    cluster_secret_file: Optional[str] = _f(None, "Multi-node: file holding the secret every node shares; only holders can use the cluster sockets (default: $GRAMSYNC_CLUSTER_SECRET; node 0 generates and prints one if neither is set).")
    # Memory and scheduling
    max_total_tokens: Optional[int] = _f(None, "KV-cache pool size in tokens (default: from --mem-fraction-static).")
    mem_fraction_static: Optional[float] = _f(None, "Fraction of free memory for the KV cache (default: 0.85 on CUDA, 0.1 of RAM on CPU).")
    max_running_requests: Optional[int] = _f(None, "Maximum requests decoding at once. Default: 16 on CPU (from about 16 rows a CPU decode step is compute-bound: more rows lengthen every stream's gap between tokens and add little throughput; docs/speed.md 'Running batch size on CPU'), 64 on CUDA.")
    max_mamba_cache_size: Optional[int] = _f(None, "Hybrid Gated DeltaNet models (Qwen3.5, Qwen3-Next; SGLang's flag): recurrent-state slots in all, one per running request plus the radix cache's state checkpoints; each costs one request's state (docs/models.md 'Hybrid models'). Default: 3 x --max-running-requests with the radix cache, else --max-running-requests.")
    max_queued_requests: Optional[int] = _f(None, "Most requests waiting to run (queued or compiling their grammar) per DP group; past it a new request gets 503 at once (SGLang's flag; default: unbounded).")
    chunked_prefill_size: Optional[int] = _f(None, "Most prompt tokens prefilled in one step while requests are decoding: a longer prompt is split into chunks, with a decode step for the running requests after each (with none running, a step takes up to --max-prefill-tokens). -1 disables. Default: 256 on CPU, 8192 on CUDA (docs/speed.md 'Chunked prefill').")
    max_prefill_tokens: int = _f(8192, "Token budget of one prefill batch (a longer single prompt still runs alone).")
    enable_mixed_chunk: bool = _f(False, "Run each prefill chunk and the running requests' decode rows in one forward (SGLang's flag): decoding never pauses for an arriving prompt (docs/speed.md 'Mixed chunks').")
    stream_interval: int = _f(1, "Send stream chunks every this many decode steps.")
    random_seed: Optional[int] = _f(None, "Seed for unseeded sampling (default: random, shared by all ranks).")
    # Speed (docs/speed.md)
    attention_backend: str = _f("auto", "Attention kernels: torch_native (plain torch; the CPU backend) or triton (CUDA); auto picks by device.", ["auto", "torch_native", "triton"])
    enable_torch_compile: bool = _f(False, "Compile the decode step and the prefill with torch.compile even where the default would not (GRAMSYNC_TORCH_COMPILE_AUTO=0, int8wo, int4 at TP > 1).")
    disable_torch_compile: bool = _f(False, "Never compile; run every step eagerly (default: compile the decode step and the prefill on CPU at any TP, where they measure faster).")
    wait_for_torch_compile: bool = _f(False, "Report ready only once the decode step and the prefill are compiled (benchmarks). Default: serve eagerly while they compile in the background.")
    torch_compile_max_bs: int = _f(64, "Largest decode batch run by the compiled step; larger batches run eagerly.")
    disable_radix_cache: bool = _f(False, "Do not keep computed KV in the radix prefix cache: every request prefills its whole prompt.")
    disable_prompt_logprob_cache: bool = _f(False, "Do not keep prompt logprobs with the radix cache: a request asking for prompt logprobs prefills every position from its logprob start again (the cache costs 165 bytes per KV token, counted in the KV budget; docs/evaluation.md 'Scoring at cache speed').")
    disable_cuda_graph: bool = _f(False, "CUDA: run the decode step eagerly instead of replaying CUDA graphs captured per batch-size bucket at start-up.")
    cuda_graph_max_bs: int = _f(128, "CUDA: largest decode batch captured as a CUDA graph (buckets 1, 2, 4, 8, then every 8); larger batches run eagerly.")
    torchao_config: Optional[str] = _f(None, "Weight-only quantization with torchao: int8wo, or int4wo-<group size> (32, 64, 128, 256).")
    # Sampling
    enable_custom_logit_processor: bool = _f(False, "Allow requests to carry a custom logit processor (a CustomLogitProcessor class importable on the server).")
    # Constrained generation
    grammar_backend: str = _f("auto", "Grammar backend: auto (default: xgrammar, and per request llguidance for specs xgrammar rejects or only approximates, such as oneOf), xgrammar, llguidance, none (reject constraints), or a name registered with register_grammar_backend (see --grammar-backend-plugins).")
    logprobs_mode: str = _f("processed_logprobs", "What returned logprobs describe: processed_logprobs, the distribution the token was drawn from (after penalties, grammar mask, logit bias and temperature); raw_logprobs, the model's own (vLLM's flag).", ["processed_logprobs", "raw_logprobs"])
    speculative_algorithm: Optional[str] = _f("auto", "Speculative decoding (SGLang's flag; docs/speed.md 'Speculative decoding'): NGRAM drafts a request's next tokens from its own prompt and output (the longest recent suffix seen before, and what followed it), cut where its grammar forbids one, and each decode step verifies them exactly as extra rows; a step drafts only where its plan expects a gain. auto (the default): NGRAM on CPU with one pipeline stage and dense or torchao weights; off where a GGUF's 4-bit codes are served (a verify step's rows would read other numerics), with --pp-size > 1 (not built) and on CUDA (not measured yet). none: off.", ["auto", "NGRAM", "none"])
    speculative_num_draft_tokens: int = _f(8, "NGRAM: most tokens drafted per request per step (the draft is sized below this by the request's acceptance so far).")
    speculative_ngram_min_match_window_size: int = _f(1, "NGRAM: shortest suffix of the request's tokens that counts as a match (SGLang's flag).")
    speculative_ngram_max_match_window_size: int = _f(12, "NGRAM: longest suffix tried first (SGLang's flag).")
    disable_grammar_fast_forward: bool = _f(False, "Never append the tokens a grammar forces (the rest of a JSON key, a fixed separator) without a decode step each; by default they are appended and their KV computed as extra rows of the next decode step.")
    grammar_backend_plugins: Optional[str] = _f(None, "Comma-separated modules every scheduler rank imports before creating the grammar backend (they call register_grammar_backend).")
    constrained_json_disable_any_whitespace: bool = _f(False, "JSON constraints allow no whitespace between tokens (compact separators ',' and ':').")
    constrained_json_whitespace_pattern: Optional[str] = _f(None, "Regex for the whitespace allowed between JSON tokens (llguidance; with auto, JSON requests then go to llguidance).")
    constrained_json_max_whitespace: int = _f(16, "Most whitespace characters allowed between two JSON tokens, so a weak model cannot loop on whitespace (0: unbounded).")
    constrained_json_unbounded_numbers: bool = _f(False, "JSON number literals may have any number of digits. Default: a schema's integers without bounds stay in the int64 range and other numbers within 15 integer, 10 fraction and 3 exponent digits, so a weak model cannot write digits until max_new_tokens; bounds a schema sets are kept.")
    grammar_compile_threads: int = _f(2, "Threads per rank that compile grammars in the background.")
    grammar_cache_size: int = _f(1024, "Compiled grammars (and compile failures) kept per rank, least recently used evicted.")
    reasoning_parser: Optional[str] = _f(None, "Thinking-model format (docs/reasoning.md): replies split into reasoning_content and content, constraints start after the think-end token, thinking_budget is accepted. qwen3 (the output opens <think>), deepseek-r1 (always thinks; the prompt opens it), qwen3.5 / qwen3-thinking (the prompt opens <think>; enable_thinking false closes it).", ["qwen3", "deepseek-r1", "qwen3.5", "qwen3-thinking"])
    tool_call_parser: Optional[str] = _f(None, "Tool-call format (docs/tools.md): hermes (also qwen25, qwen: <tool_call> JSON), qwen3_coder (Qwen3-Coder / Qwen3.5 / 3.6 XML), llama3, pythonic (Llama 3.2 / 4), mistral (v3 [TOOL_CALLS] list), mistral_v11 ([TOOL_CALLS]NAME[ARGS]), deepseekv3, deepseekv31. Not given: chosen from the chat template (the log says which and why), else hermes. The grammar, the history rendering and the parser follow it.", ["hermes", "qwen25", "qwen", "qwen3_coder", "llama3", "pythonic", "mistral", "mistral_v11", "deepseekv3", "deepseekv31"])
    # Parallelism
    tp_size: int = _f(1, "Tensor-parallel size: ranks that shard one copy of the model.")
    dp_size: int = _f(1, "Data-parallel size: independent TP groups; the frontend spreads requests over them.")
    ep_size: int = _f(1, "Expert-parallel size (mixture-of-experts models): 1 splits every expert over the --tp-size ranks along its intermediate dimension; equal to --tp-size places whole experts on the ranks instead (docs/models.md).")
    pp_size: int = _f(1, "Pipeline-parallel size (docs/multi-rank.md 'Pipeline parallelism'): stages that each hold consecutive decoder layers, each stage --tp-size ranks; a DP group is --pp-size x --tp-size ranks.")
    pp_max_micro_batch_size: Optional[int] = _f(None, "Most sequences in one pipeline micro-batch; default: each step is split into --pp-size micro-batches of about equal tokens.")
    pp_layer_partition: Optional[str] = _f(None, "Decoder layers per pipeline stage, comma-separated (e.g. 16,14); default: an even split, the remainder on the first stages.")
    load_balance_method: str = _f("round_robin", "How the frontend picks a DP group for a request: round_robin, shortest_queue (fewest requests in flight), or prefix_aware (the group whose radix cache most likely holds the prompt's prefix, within a load slack; else the shortest queue).", ["round_robin", "shortest_queue", "prefix_aware"])
    nnodes: int = _f(1, "Number of nodes (without torchrun: start launch.py on each with --node-rank).")
    node_rank: int = _f(0, "This node's rank (node 0 runs the HTTP frontend).")
    dist_init_addr: Optional[str] = _f(None, "host:port of node 0 for torch.distributed init (required with --nnodes > 1; one node needs none: its ranks meet through a file store in the private run directory).")
    dist_timeout: float = _f(600.0, "Seconds the ranks wait for each other: the rendezvous at start-up and every collective after it (a lost peer fails the rank after this).")
    watchdog_timeout: float = _f(300.0, "Seconds a scheduler iteration may take before its rank exits and the server goes down with it (0: off).")
    # Logging and metrics
    log_level: str = _f("info", "Log level.", ["debug", "info", "warning", "error"])
    enable_metrics: bool = _f(False, "Serve Prometheus metrics at GET /metrics (docs/operations.md 'Metrics'); 404 without this flag.")

    @property
    def world_size(self) -> int:
        """Scheduler ranks in all: DP groups of pipeline stages of TP ranks."""
        return self.tp_size * self.pp_size * self.dp_size

    def _check_pipeline(self) -> None:
        if self.pp_size < 1:
            raise ValueError("--pp-size must be at least 1")
        if self.ep_size not in (1, self.tp_size):
            raise ValueError(f"--ep-size must be 1 (experts split over the TP ranks) or --tp-size "
                             f"({self.tp_size}: whole experts per rank), got {self.ep_size}")
        if self.pp_max_micro_batch_size is not None and self.pp_max_micro_batch_size < 1:
            raise ValueError("--pp-max-micro-batch-size must be at least 1")
        if self.pp_layer_partition is not None:
            parts = self.pp_layer_partition.split(",")
            if not all(p.strip().isdigit() and int(p) > 0 for p in parts) or len(parts) != self.pp_size:
                raise ValueError(f"--pp-layer-partition must be {self.pp_size} positive layer counts, "
                                 f"one per stage (e.g. 16,14), got {self.pp_layer_partition!r}")
        if self.pp_size > 1 and self.speculative_algorithm == "NGRAM":
            raise ValueError("--speculative-algorithm is not supported with --pp-size > 1 yet")

    def __post_init__(self):
        if self.tp_size < 1 or self.dp_size < 1:
            raise ValueError("--tp-size and --dp-size must be at least 1")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in [0, --nnodes) (got {self.node_rank} of {self.nnodes})")
        self._check_pipeline()
        if self.world_size % self.nnodes:
            what = "--tp-size x --dp-size" if self.pp_size == 1 else "--tp-size x --pp-size x --dp-size"
            raise ValueError(f"{what} ({self.world_size} ranks) must "
                             f"split evenly over --nnodes {self.nnodes}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("--nnodes > 1 needs --dist-init-addr host:port (node 0's address)")
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"--dist-init-addr must be host:port, got {self.dist_init_addr!r}")
        if self.json_model_override_args is not None:
            parse_model_overrides(self.json_model_override_args)  # a clear error now, not in a rank
        if self.dist_timeout <= 0 or self.watchdog_timeout < 0:
            raise ValueError("--dist-timeout must be positive and --watchdog-timeout at least 0")
        if self.graceful_shutdown_timeout < 0:
            raise ValueError("--graceful-shutdown-timeout must be at least 0")
        if self.max_request_bytes < 1024:
            raise ValueError("--max-request-bytes must be at least 1024")
        if self.max_running_requests is not None and self.max_running_requests < 1:
            raise ValueError("--max-running-requests must be at least 1")
        if self.max_mamba_cache_size is not None and self.max_mamba_cache_size < self.max_running():
            raise ValueError(f"--max-mamba-cache-size ({self.max_mamba_cache_size}) must be at least "
                             f"--max-running-requests ({self.max_running()}): a slot per running request")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError("--max-queued-requests must be at least 0")
        if self.max_total_tokens is not None and self.max_total_tokens < 2:
            raise ValueError("--max-total-tokens must be at least 2")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError("--mem-fraction-static must be in (0, 1)")
        if self.grammar_compile_threads < 1 or self.grammar_cache_size < 1:
            raise ValueError("--grammar-compile-threads and --grammar-cache-size must be at least 1")
        if self.enable_torch_compile and self.disable_torch_compile:
            raise ValueError("--enable-torch-compile and --disable-torch-compile exclude each other")
        if self.chunked_prefill_size is not None and (self.chunked_prefill_size == 0
                                                      or self.chunked_prefill_size < -1):
            raise ValueError("--chunked-prefill-size must be positive, or -1 to disable chunking")
        if self.torch_compile_max_bs < 1 or self.cuda_graph_max_bs < 1:
            raise ValueError("--torch-compile-max-bs and --cuda-graph-max-bs must be at least 1")
        if self.torchao_config is not None and self.torchao_config not in TORCHAO_CONFIGS:
            raise ValueError(f"--torchao-config must be one of {', '.join(TORCHAO_CONFIGS)} "
                             f"(got {self.torchao_config!r})")
        if self.speculative_num_draft_tokens < 1:
            raise ValueError("--speculative-num-draft-tokens must be at least 1")
        if not 1 <= self.speculative_ngram_min_match_window_size <= self.speculative_ngram_max_match_window_size:
            raise ValueError("--speculative-ngram-min-match-window-size must be at least 1 and at most "
                             "--speculative-ngram-max-match-window-size")
        if self.constrained_json_max_whitespace < 0:
            raise ValueError("--constrained-json-max-whitespace must be at least 0")
        if self.constrained_json_whitespace_pattern is not None and self.grammar_backend == "xgrammar":
            raise ValueError("--constrained-json-whitespace-pattern needs --grammar-backend "
                             "llguidance or auto (xgrammar has no whitespace patterns)")

    def resolved(self) -> "ServerArgs":
        """Fix choices that every rank must share before spawning ranks: the random seed and
        the running-request cap (so the ranks and /get_server_info show the same number)."""
        seed = self.random_seed if self.random_seed is not None else random.randint(0, 2**30)
        return dataclasses.replace(self, random_seed=seed, max_running_requests=self.max_running())

    def max_running(self) -> int:
        """--max-running-requests, or its default for the device."""
        if self.max_running_requests is not None:
            return self.max_running_requests
        return CPU_MAX_RUNNING_REQUESTS if self.resolved_device() == "cpu" else CUDA_MAX_RUNNING_REQUESTS

    def state_slots(self) -> int:
        """Hybrid models' recurrent-state slots (--max-mamba-cache-size, or its default)."""
        if self.max_mamba_cache_size is not None:
            return self.max_mamba_cache_size
        return self.max_running() * (1 if self.disable_radix_cache else 3)

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            kind = hints[f.name]
            if typing.get_origin(kind) is typing.Union:  # Optional[X]
                kind = next(a for a in typing.get_args(kind) if a is not type(None))
            kwargs = {"default": f.default, "help": f.metadata.get("help", "")}
            if kind is bool:
                parser.add_argument(flag, action="store_true", **kwargs)
                continue
            if f.metadata.get("choices"):
                kwargs["choices"] = f.metadata["choices"]
            parser.add_argument(flag, type=kind, **kwargs)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> "ServerArgs":
        return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})
