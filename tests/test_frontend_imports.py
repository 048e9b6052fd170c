"""The frontend process (launch.py's own: HTTP, tokenizer, launcher) never imports torch:
importing it took 2-3 s of CPU before the ranks could even be spawned, in every server
start. Checked in a fresh interpreter that walks the frontend's start-up path."""
from __future__ import annotations

import subprocess
import sys

from conftest import ROOT

FRONTEND_START = """
import sys
from srt.entrypoints import http_server, launcher, torchrun  # noqa: F401
from srt.entrypoints.launcher import dist_config, new_port_args
from srt.frontend.dp_dispatch import DPDispatcher
from srt.server_args import ServerArgs

args = ServerArgs(model_path=sys.argv[1], tp_size=2)
assert dist_config(args, run_dir="/tmp").device_backend == "auto"  # resolved by each rank
new_port_args(args, None)
http_server.prefetch_tokenizer(args).result(timeout=60)
DPDispatcher(2, "shortest_queue").pick([1, 2, 3])
print(sorted(m for m in ("torch", "xgrammar") if m in sys.modules))
"""


def test_the_frontend_starts_without_torch(smollm2_dir):
    out = subprocess.run([sys.executable, "-c", FRONTEND_START, smollm2_dir], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_prefix_aware_routing_and_custom_processors_still_load_torch_where_used():
    code = ("import sys; from srt.frontend.dp_dispatch import DPDispatcher; "
            "d = DPDispatcher(2, 'prefix_aware'); d.pick([1, 2, 3]); d.done(0); "
            "assert d.pick([1, 2, 3]) == 0 and 'torch' in sys.modules; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
