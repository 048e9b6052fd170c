"""Everything that needs a GPU, verified and timed in one run: ``make gpu-check``.

    python benchmark/gpu_check.py [--junit gpu-tests.xml] [--skip-tests] [--skip-bench]

1. Every CUDA test (``pytest -m gpu``: the Triton bitmask and attention kernels against
   their references, CUDA graphs against eager on the real model, the sampler on CUDA and
   the FlashInfer sampler where it is installed).
2. GPU timings, each beside its reference in the same run: the Triton bitmask kernel
   against torch's unpack + masked_fill, Triton decode attention at real lengths against
   the gathered torch reference, the decode step with CUDA graphs against eager, and an
   NCCL all-reduce at TP=2 where two GPUs exist.
3. A summary: one line per check, ``gpu-check <name>: PASS|FAIL|SKIP <detail>``.

Exit status: 0 when every check passed or skipped for a stated reason and at least one
ran; 1 when any failed; 2 when this machine has no CUDA device (nothing was verified).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmark"))


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # PASS, FAIL or SKIP
    detail: str


def summary_line(c: Check) -> str:
    return f"gpu-check {c.name}: {c.status} {c.detail}".rstrip()


def exit_status(checks: list[Check], has_cuda: bool) -> int:
    if not has_cuda:
        return 2
    if any(c.status == "FAIL" for c in checks):
        return 1
    return 0 if any(c.status == "PASS" for c in checks) else 2


def pytest_checks(junit_path: Path) -> list[Check]:
    """Run the CUDA tests; one Check per test case, read back from pytest's JUnit XML."""
    # A module that cannot be imported on this machine (a dev extra missing) is reported as
    # an error case, and the CUDA tests of every other module still run.
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
           "--continue-on-collection-errors", f"--junitxml={junit_path}", "tests"]
    proc = subprocess.run(cmd, cwd=ROOT, timeout=3600)
    if not junit_path.exists():
        return [Check("pytest -m gpu", "FAIL", f"pytest exited {proc.returncode} without a report")]
    return junit_checks(junit_path) + pytest_exit_checks(proc.returncode)


def pytest_exit_checks(returncode: int) -> list[Check]:
    """pytest's own verdict beside the cases: 0 and 1 (some failed: their cases say which)
    are told by the report; any other exit (a usage error in collection, an internal error,
    no test collected) means CUDA tests may not have run, and must not read as a pass."""
    if returncode in (0, 1):
        return []
    meaning = {2: "interrupted", 3: "internal error", 4: "usage error", 5: "no test collected"}
    return [Check("pytest -m gpu", "FAIL",
                  f"pytest exited {returncode} ({meaning.get(returncode, 'unknown')}): see its output above")]


def junit_checks(junit_path: Path) -> list[Check]:
    checks = []
    for case in ET.parse(junit_path).getroot().iter("testcase"):
        name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        if bad is not None:
            checks.append(Check(name, "FAIL", (bad.get("message") or "")[:200]))
        elif skipped is not None:
            checks.append(Check(name, "SKIP", (skipped.get("message") or "")[:200]))
        else:
            checks.append(Check(name, "PASS", f"{float(case.get('time', 0)):.1f} s"))
    return checks or [Check("pytest -m gpu", "FAIL", "no test collected")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--junit", default=str(ROOT / "gpu-tests.xml"))
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--skip-bench", action="store_true")
    args = ap.parse_args()

    import torch

    import gpu_timings

    has_cuda = torch.cuda.is_available()
    print(gpu_timings.environment_line())
    checks: list[Check] = []
    if not has_cuda:
        checks.append(Check("cuda", "SKIP", "no CUDA device on this machine: nothing was verified"))
    else:
        if not args.skip_tests:
            checks += pytest_checks(Path(args.junit))
        if not args.skip_bench:
            checks += [Check(*row) for row in gpu_timings.run_all()]
    print("\n== gpu-check summary ==")
    for c in checks:
        print(summary_line(c))
    counts = {s: sum(c.status == s for c in checks) for s in ("PASS", "FAIL", "SKIP")}
    print(f"gpu-check: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    return exit_status(checks, has_cuda)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
