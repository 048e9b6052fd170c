"""``make gpu-check`` on a machine without a GPU, its report parsing, and the CUDA-graph
self-check's batch at serving lengths (built and run eagerly on CPU; the graphs
themselves need a GPU: tests/test_cuda_graph.py)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmark"))

import gpu_check  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU answer")
def test_without_cuda_it_says_nothing_was_verified_and_exits_2():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmark" / "gpu_check.py")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "gpu-check environment: torch" in proc.stdout and "no CUDA device" in proc.stdout
    assert "gpu-check cuda: SKIP no CUDA device on this machine: nothing was verified" in proc.stdout
    assert "gpu-check: 0 passed, 0 failed, 1 skipped" in proc.stdout


def test_junit_report_gives_one_check_per_case_and_the_exit_status(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text("""<testsuites><testsuite>
      <testcase classname="tests.test_a" name="test_ok" time="1.25"/>
      <testcase classname="tests.test_a" name="test_bad"><failure message="assert 1 == 2"/></testcase>
      <testcase classname="tests.test_b" name="test_boom"><error message="fixture failed"/></testcase>
      <testcase classname="tests.test_b" name="test_skip"><skipped message="flashinfer not installed"/></testcase>
    </testsuite></testsuites>""")
    checks = gpu_check.junit_checks(xml)
    assert [(c.name, c.status) for c in checks] == [
        ("test_a::test_ok", "PASS"), ("test_a::test_bad", "FAIL"),
        ("test_b::test_boom", "FAIL"), ("test_b::test_skip", "SKIP")]
    assert gpu_check.summary_line(checks[1]) == "gpu-check test_a::test_bad: FAIL assert 1 == 2"
    assert gpu_check.exit_status(checks, has_cuda=True) == 1
    assert gpu_check.exit_status([checks[0], checks[3]], has_cuda=True) == 0
    assert gpu_check.exit_status([checks[3]], has_cuda=True) == 2  # nothing ran
    assert gpu_check.exit_status([checks[0]], has_cuda=False) == 2


def test_a_pytest_run_that_stopped_in_collection_is_a_failure_not_a_pass():
    """The first run on a GPU stopped in collection (a usage error) after one skipped case;
    read from the report alone it looked like a pass."""
    skipped = [gpu_check.Check("test_lm_eval::", "SKIP", "collection skipped")]
    for code in (2, 3, 4, 5):
        checks = skipped + gpu_check.pytest_exit_checks(code)
        assert [c.status for c in checks] == ["SKIP", "FAIL"]
        assert gpu_check.exit_status(checks, has_cuda=True) == 1
    assert gpu_check.pytest_exit_checks(4)[0].detail.startswith("pytest exited 4 (usage error)")
    assert gpu_check.pytest_exit_checks(0) == gpu_check.pytest_exit_checks(1) == []


def test_sampler_row_says_how_many_speed_goals_were_met():
    import gpu_timings

    out = ("   64  248320 top-p   321 [23-3293]  2.165  3.902  0.6x\n\ngoal: >= 3x at batch 64\n"
           "  V=49152   top-p          0.1x  NOT met\n  V=248320  top-k+top-p    3.3x  met\n")
    assert gpu_timings.sampler_goal_detail(out) == (
        "valid draws; speed goal >= 3x at batch 64 met 1/2: V=49152 top-p 0.1x, V=248320 top-k+top-p 3.3x")
    assert gpu_timings.sampler_goal_detail("no goals") == "valid draws; no goal lines in its output"


def test_self_check_batch_is_at_serving_lengths_and_runs(smollm2_dir, smollm2_tokenizer):
    from srt.model_executor.cuda_graph_runner import real_length_inputs
    from tests.test_compiled_decode import _scheduler

    runner = _scheduler(smollm2_dir, smollm2_tokenizer, disable_torch_compile=True).runner
    table, pool = runner.req_to_token_pool.req_to_token, runner.token_to_kv_pool
    t = real_length_inputs(8, table, pool)
    lens = t["seq_lens"].tolist()
    assert lens[0] == 1 and lens[-1] == min(1024, pool.size // 8) and lens == sorted(lens)
    slots = torch.cat([table[r, :n] for r, n in enumerate(lens)])
    assert slots.unique().numel() == slots.numel() and int(slots.min()) >= 1 and int(slots.max()) <= pool.size
    assert torch.equal(t["positions"], t["seq_lens"] - 1)
    assert torch.equal(t["out_cache_loc"], torch.stack([table[r, n - 1] for r, n in enumerate(lens)]))
    assert float(pool.k_buffer[0][:, slots].abs().sum()) > 0  # keys written where the rows point
    with torch.inference_mode():
        logits = runner.model(runner._graph_batch(t))
    assert logits.shape[0] == 8 and bool(torch.isfinite(logits).all())
    table.zero_()
