"""lm-evaluation-harness itself against a live server, through ``local-completions``.

Three local tasks (tests/lm_eval_tasks: YAML + JSONL written for this repo, nothing is
downloaded) cover lm-eval's three request types: ``gramsync_mc`` (multiple choice:
loglikelihood), ``gramsync_rolling`` (perplexity: loglikelihood_rolling) and
``gramsync_gen`` (generate_until, stopping at a newline). lm-eval runs in a subprocess
under a timeout, fully offline (HF_HUB_OFFLINE, HF_DATASETS_OFFLINE), tokenizing on the
client side with the tokenizer the server names in ``/get_model_info``.

Checks: every item of every task was scored; each loglikelihood lm-eval reports equals the
in-process transformers model's log-probability of the continuation given the context (same
weights, same dtype as the server), its ``is_greedy`` wherever the model is decisive; each
rolling loglikelihood equals the model's log-probability of the whole document; each
generation equals the server's own greedy ``/generate`` of the same tokens.
"""
from __future__ import annotations

import glob
import json
import math
import os
import subprocess
import sys
import time

import pytest
import torch

from process_helpers import stop_process_group

pytest.importorskip("lm_eval", reason="lm-eval is in the dev extras: pip install -e '.[dev]'")

TASKS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lm_eval_tasks")
DATA = {"gramsync_mc": "gramsync_mc.jsonl", "gramsync_rolling": "gramsync_rolling.jsonl",
        "gramsync_gen": "gramsync_gen.jsonl"}
LM_EVAL_TIMEOUT_S = 180  # the lm-eval run (~15 s here)
GEN_MAX_TOKENS = 12  # gramsync_gen.yaml's max_gen_toks
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "HF_HUB_DISABLE_TELEMETRY": "1", "TOKENIZERS_PARALLELISM": "false"}

# Tolerances, by the server's dtype, against transformers in that same dtype. Measured: the
# server's bf16 against transformers' bf16 (both on this CPU) within 4e-4 per token; float32
# sums in another order. Dropping a token or shifting the slice by one moves a sum by that
# token's whole logprob: several nats for most tokens here, and the mean error catches it
# where one item's last token is nearly certain. ``tie``: a greedy decision closer than this
# is not asserted.
TOL = {
    torch.bfloat16: dict(token=0.02, mean=0.01, tie=0.02),
    torch.float16: dict(token=0.02, mean=0.01, tie=0.02),
    torch.float32: dict(token=2e-3, mean=1e-3, tie=2e-3),
}


def _read_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# -- the server, its tokenizer and the in-process reference ------------------------------
@pytest.fixture(scope="module")
def model_info(server):
    import httpx

    return httpx.get(server + "/get_model_info", timeout=10).json()


@pytest.fixture(scope="module")
def server_args(server):
    import httpx

    from srt.server_args import ServerArgs

    info = httpx.get(server + "/get_server_info", timeout=10).json()
    return ServerArgs(model_path=info["model_path"], dtype=info["dtype"], device=info["device"])


@pytest.fixture(scope="module")
def server_device(server_args) -> str:
    return server_args.resolved_device()


@pytest.fixture(scope="module")
def server_dtype(server_args, server_device) -> torch.dtype:
    """The dtype the server runs in (``--dtype auto`` resolved as the server resolves it)."""
    from srt.model_executor.model_runner import resolve_dtype

    return resolve_dtype(server_args, server_device)


@pytest.fixture(scope="module")
def tokenizer(model_info):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_info["tokenizer_path"])


@pytest.fixture(scope="module")
def reference(smollm2_dir, server_dtype, server_device):
    """Log-probabilities [T, V] (float64, on the CPU) of every position of a token sequence,
    from transformers' model of the same weights in the server's dtype, on its device."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=server_dtype).to(server_device).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([ids], device=server_device)).logits[0]
        return torch.log_softmax(logits.double(), -1).cpu()

    return logprobs


def _run_lm_eval(base: str, tokenizer_path: str, tasks: list[str], out_dir: str, *,
                 batch_size: int, num_concurrent: int) -> dict[str, list[dict]]:
    """Run ``python -m lm_eval`` (local-completions) and return each task's logged samples.
    No retries (a retrying client would hide a failed request) and a short request timeout."""
    model_args = ",".join([
        f"base_url={base}/v1/completions", "model=smollm2", f"tokenizer={tokenizer_path}",
        "tokenizer_backend=huggingface", f"num_concurrent={num_concurrent}", "max_retries=1",
        "timeout=60", "max_length=2048",
    ])
    cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args,
           "--batch_size", str(batch_size), "--tasks", ",".join(tasks), "--include_path", TASKS_DIR,
           "--output_path", out_dir, "--log_samples", "--seed", "1234"]
    env = {**os.environ, **OFFLINE_ENV}
    env.pop("OPENAI_API_KEY", None)
    proc = subprocess.Popen(cmd, cwd=out_dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=LM_EVAL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        stop_process_group(proc, term_wait=5)
        output, _ = proc.communicate()
        pytest.fail(f"lm-eval did not finish in {LM_EVAL_TIMEOUT_S} s:\n"
                    f"{output.decode(errors='replace')[-4000:]}")
    text = output.decode(errors="replace")
    assert proc.returncode == 0, f"lm-eval exited with {proc.returncode}:\n{text[-6000:]}"
    samples = {}
    for task in tasks:
        files = glob.glob(os.path.join(out_dir, "**", f"samples_{task}_*.jsonl"), recursive=True)
        assert len(files) == 1, f"{task}: expected one samples file, found {files}\n{text[-3000:]}"
        samples[task] = sorted(_read_jsonl(files[0]), key=lambda s: s["doc_id"])
    return samples


@pytest.fixture(scope="module")
def lm_eval_samples(server, model_info, tmp_path_factory):
    """The three tasks in one run: batches of 4 prompts per request (``prompt`` is a list
    of token-id lists), two requests in flight."""
    out = str(tmp_path_factory.mktemp("lm_eval"))
    t0 = time.time()
    samples = _run_lm_eval(server, model_info["tokenizer_path"], list(DATA), out, batch_size=4, num_concurrent=2)
    print(f"lm-eval run: {time.time() - t0:.1f} s")
    return samples


# -- lm-eval's tokenization, as its API models do it (client side, no special tokens) ----
def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's TemplateLM._encode_pair for causal models: the context's trailing spaces
    move to the continuation; the continuation's tokens are the whole text's tokens past
    the context's."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = _encode(tokenizer, context + continuation)
    ctx = _encode(tokenizer, context)
    return ctx, whole[len(ctx):]


def _score(reference, ctx: list[int], cont: list[int]) -> tuple[list[float], list[float], int]:
    """Per continuation token: its logprob, and its distance below the best token's (0 when
    it is the argmax); and the greedy token after the continuation."""
    lp = reference(ctx + cont)
    rows = lp[len(ctx) - 1: len(ctx) + len(cont) - 1]
    token_lps = [rows[i, t].item() for i, t in enumerate(cont)]
    below = [(rows[i].max() - rows[i, t]).item() for i, t in enumerate(cont)]
    return token_lps, below, int(lp[-1].argmax())


def _runner_up_gap(reference, ctx: list[int], cont: list[int]) -> float:
    """The smallest margin, over continuation tokens that are the argmax, between them and
    the next best token (how safely the reference calls the continuation greedy)."""
    lp = reference(ctx + cont)
    rows = lp[len(ctx) - 1: len(ctx) + len(cont) - 1]
    top2 = torch.topk(rows, 2, dim=-1).values
    return (top2[:, 0] - top2[:, 1]).min().item()


# -- the tests ---------------------------------------------------------------------------
def test_tokenizer_path_is_the_local_model_directory(model_info, smollm2_dir, tokenizer):
    """lm-eval tokenizes on the client: /get_model_info names a local directory with the
    tokenizer files, loadable without a hub, and it is the embedded model's."""
    path = model_info["tokenizer_path"]
    assert os.path.isdir(path), path
    assert os.path.realpath(path) == os.path.realpath(smollm2_dir)
    assert os.path.isfile(os.path.join(path, "tokenizer.json"))
    assert os.path.isfile(os.path.join(path, "tokenizer_config.json"))
    assert tokenizer.decode(_encode(tokenizer, "Question: 2 + 2?")) == "Question: 2 + 2?"


def test_multiple_choice_loglikelihoods_match_in_process_model(lm_eval_samples, tokenizer, reference,
                                                              server_dtype):
    tol = TOL[server_dtype]
    docs = _read_jsonl(os.path.join(TASKS_DIR, DATA["gramsync_mc"]))
    samples = lm_eval_samples["gramsync_mc"]
    assert [s["doc_id"] for s in samples] == list(range(len(docs))), "every question scored once"
    errors, greedy_checked, eos_next = [], 0, 0
    for doc, s in zip(docs, samples):
        assert s["doc"] == doc
        args = [s["arguments"][f"gen_args_{i}"] for i in range(len(s["arguments"]))]
        assert len(args) == len(doc["choices"]) == len(s["resps"]), f"doc {s['doc_id']}: every choice scored"
        for choice, arg, resp in zip(doc["choices"], args, s["resps"]):
            assert arg["arg_1"] == " " + choice
            (ll, is_greedy), = resp
            ll, is_greedy = float(ll), {"True": True, "False": False}[str(is_greedy)]
            assert math.isfinite(ll)
            assert ll < 0, (
                f"doc {s['doc_id']} {choice!r}: lm-eval scored no token (loglikelihood {ll}): it sums "
                "token_logprobs[ctxlen:-1], so the response must list the prompt's tokens and then "
                "the one generated token, even when that token is EOS")
            ctx, cont = _encode_pair(tokenizer, arg["arg_0"], arg["arg_1"])
            token_lps, below, next_id = _score(reference, ctx, cont)
            eos_next += next_id == tokenizer.eos_token_id
            err = abs(ll - sum(token_lps))
            errors.append(err)
            assert err < tol["token"] * len(cont), (
                f"doc {s['doc_id']} {choice!r}: lm-eval {ll:.4f} vs in-process {sum(token_lps):.4f} "
                f"(tokens {cont}, per token {[round(x, 4) for x in token_lps]})")
            # is_greedy, wherever the reference is decisive about it.
            if max(below) > tol["tie"]:
                assert not is_greedy, f"doc {s['doc_id']} {choice!r}: not the argmax, reported greedy"
                greedy_checked += 1
            elif max(below) == 0 and _runner_up_gap(reference, ctx, cont) > tol["tie"]:
                assert is_greedy, f"doc {s['doc_id']} {choice!r}: the argmax, reported not greedy"
                greedy_checked += 1
    mean = sum(errors) / len(errors)
    print(f"multiple choice: {len(errors)} loglikelihoods, mean |err| {mean:.4f}, max {max(errors):.4f}; "
          f"is_greedy checked on {greedy_checked}")
    assert mean < tol["mean"], f"mean |lm-eval - in-process| = {mean:.4f}"
    assert greedy_checked >= len(errors) // 2
    # lm-eval asks for one generated token and drops it ([ctxlen:-1]); these data include
    # continuations after which the model's greedy token is EOS, which must be listed too.
    assert eos_next >= 1


def test_rolling_loglikelihoods_match_in_process_model(lm_eval_samples, tokenizer, reference,
                                                       server_dtype):
    """loglikelihood_rolling: lm-eval scores [prefix token] + the document in one window
    (the documents are far below max_length); the prefix is the tokenizer's BOS."""
    tol = TOL[server_dtype]
    docs = _read_jsonl(os.path.join(TASKS_DIR, DATA["gramsync_rolling"]))
    samples = lm_eval_samples["gramsync_rolling"]
    assert [s["doc_id"] for s in samples] == list(range(len(docs))), "every document scored once"
    prefix = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    errors = []
    for doc, s in zip(docs, samples):
        (ll,), = s["resps"]
        ll = float(ll)
        tokens = _encode(tokenizer, doc["text"])
        token_lps, _, _ = _score(reference, [prefix], tokens)
        err = abs(ll - sum(token_lps))
        errors.append(err / len(tokens))
        # Per-token errors of a document partly cancel: sqrt(n) growth.
        assert err < tol["token"] * math.sqrt(len(tokens)), (
            f"doc {s['doc_id']}: lm-eval {ll:.3f} vs in-process {sum(token_lps):.3f} ({len(tokens)} tokens)")
        assert s["word_perplexity"][0] == pytest.approx(ll)
    mean = sum(errors) / len(errors)
    print(f"rolling: {len(docs)} documents, mean |err| per token {mean:.2e}")
    assert mean < tol["mean"] / 4, f"mean |lm-eval - in-process| per token = {mean:.4f}"


def test_generations_match_server_greedy(lm_eval_samples, server, tokenizer, server_dtype):
    """Each generate_until answer is the server's own greedy ``/generate`` of the same
    tokens (same stops, same budget), sent alone. Where bf16 noise (other prompts in the
    batch, the prompt's prefix cached or not) flips a near-tie, the two may part: only at a
    token whose top-2 margin is tiny."""
    import httpx

    tol = TOL[server_dtype]
    docs = _read_jsonl(os.path.join(TASKS_DIR, DATA["gramsync_gen"]))
    samples = lm_eval_samples["gramsync_gen"]
    assert [s["doc_id"] for s in samples] == list(range(len(docs))), "every question answered once"
    stops = ["\n", tokenizer.eos_token]  # lm-eval adds the EOS string to the task's `until`
    equal = 0
    with httpx.Client(base_url=server, timeout=60) as client:
        for doc, s in zip(docs, samples):
            assert s["doc"] == doc
            context = s["arguments"]["gen_args_0"]["arg_0"]
            assert context.endswith(f"\n\nQuestion: {doc['question']}\nAnswer:")
            (text,), = s["resps"]
            assert isinstance(text, str) and "\n" not in text
            r = client.post("/generate", json={
                "input_ids": _encode(tokenizer, context),
                "sampling_params": {"temperature": 0, "max_new_tokens": GEN_MAX_TOKENS, "stop": stops},
                "return_logprob": True, "top_logprobs_num": 2})
            assert r.status_code == 200, r.text
            ref = r.json()
            if text == ref["text"]:
                equal += 1
                continue
            # Where do they part? The first reference token whose text leaves lm-eval's.
            ids, tops = ref["output_ids"], ref["meta_info"]["output_top_logprobs"]
            k = next((k for k in range(len(ids)) if not text.startswith(tokenizer.decode(ids[:k + 1]))), None)
            assert k is not None, f"doc {s['doc_id']}: lm-eval {text!r} vs /generate {ref['text']!r}"
            margin = tops[k][0][0] - tops[k][1][0]
            assert margin < tol["tie"], (
                f"doc {s['doc_id']}: lm-eval {text!r} vs /generate {ref['text']!r}, parting at token {k} "
                f"whose top-2 margin is {margin:.3f}")
    print(f"generate_until: {equal}/{len(docs)} answers identical to /generate")
    assert equal >= 0.9 * len(docs)
    # The 3-shot prompt makes the model answer (SmolLM2-135M gets ~24 of these 30 right).
    assert sum(bool(s["resps"][0][0].strip()) for s in samples) >= len(docs) // 2
