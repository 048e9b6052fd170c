"""Speculative decoding at TP=2 through the real server: both ranks draft, verify and accept
the same tokens step for step (their batch logs, VERIFIED lines included, are identical),
and the greedy outputs -- JSON extraction under a grammar, native and OpenAI APIs, n > 1,
streaming -- equal the TP=1 scheduler's without speculation (fp32)."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema

from conftest import _launch_server
from sampling.sampling_params import SamplingParams
from spec_workloads import extraction_messages, extraction_schema, rewrite_messages
from srt.transport.io_struct import TokenizedGenerateReq
from test_grammar_agreement_ranks import _identical_batch_logs, _read_log
from test_scheduler import make_scheduler, run_until_done


def _ids(tok, messages) -> list[int]:
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        return_dict=False))


def _bodies(tok):
    out = [{"input_ids": _ids(tok, extraction_messages(i)), "rid": f"x{i}", "sampling_params": {
        "temperature": 0, "max_new_tokens": 100, "json_schema": json.dumps(extraction_schema(i))}}
        for i in range(2)]
    out.append({"input_ids": _ids(tok, rewrite_messages()), "rid": "rw",
                "sampling_params": {"temperature": 0, "max_new_tokens": 50}})
    return out


def _reference(model_dir, tok, bodies) -> dict[str, list[int]]:
    """TP=1, in process, no speculation."""
    s = make_scheduler(model_dir, tok, max_total_tokens=4096, disable_torch_compile=True,
                       grammar_backend="xgrammar")
    reqs = [TokenizedGenerateReq(b["rid"], tuple(b["input_ids"]), SamplingParams.from_dict(
        {**b["sampling_params"], "json_schema": json.loads(b["sampling_params"]["json_schema"])}
        if "json_schema" in b["sampling_params"] else b["sampling_params"])) for b in bodies]
    outs = run_until_done(s, {0: reqs})
    s.grammar_manager.backend.shutdown()
    return {rid: o["ids"] for rid, o in outs.items()}


def test_tp2_speculation_matches_tp1_and_ranks_agree(tmp_path_factory, smollm2_dir, smollm2_tokenizer):
    tok = smollm2_tokenizer
    bodies = _bodies(tok)
    want = _reference(smollm2_dir, tok, bodies)
    logs = tmp_path_factory.mktemp("spec_logs")
    args = ["--tp-size", "2", "--dtype", "float32", "--speculative-algorithm", "NGRAM",
            "--grammar-backend", "xgrammar"]
    for base in _launch_server(tmp_path_factory, smollm2_dir, args, {"GRAMSYNC_BATCH_LOG_DIR": str(logs)}):
        with httpx.Client(base_url=base, timeout=120) as client:
            with ThreadPoolExecutor(3) as pool:
                got = list(pool.map(lambda b: client.post("/generate", json=b).json(), bodies))
            chat = client.post("/v1/chat/completions", json={
                "model": "smollm2", "messages": extraction_messages(0), "temperature": 0, "n": 2,
                "max_tokens": 100, "response_format": {"type": "json_schema", "json_schema": {
                    "name": "invoice", "schema": extraction_schema(0)}}}).json()
            streamed = _stream_text(client, extraction_messages(1), extraction_schema(1))
    for out in got:
        rid = out["meta_info"]["id"]
        assert out["output_ids"] == want[rid], rid
        meta = out["meta_info"]
        assert 0 < meta["spec_verify_ct"] < meta["completion_tokens"] - 1, meta
        assert meta["spec_accept_length"] > 1.0
    texts = {c["message"]["content"] for c in chat["choices"]}
    assert texts == {tok.decode(want["x0"], skip_special_tokens=True)}, texts  # n=2, greedy: one text
    jsonschema.validate(json.loads(texts.pop()), extraction_schema(0))
    assert streamed == tok.decode(want["x1"], skip_special_tokens=True)
    batches = _identical_batch_logs(logs)  # both ranks: same batches, 0 agreement mismatches
    assert any(mode == "DECODE" for _, mode, _ in batches)
    a = _read_log(logs / "batches_DP0_TP0.log")
    verified = [line for line in a if " VERIFIED " in line]
    assert len(verified) > 5


def _stream_text(client, messages, schema) -> str:
    text = ""
    with client.stream("POST", "/v1/chat/completions", json={
            "model": "smollm2", "messages": messages, "temperature": 0, "max_tokens": 100, "stream": True,
            "response_format": {"type": "json_schema", "json_schema": {"name": "job", "schema": schema}}}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:])["choices"]:
                    text += c["delta"].get("content") or ""
    return text
