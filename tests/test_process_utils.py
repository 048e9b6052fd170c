"""freeze_startup_heap: the objects alive at start-up leave the collector's full passes."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_freeze_moves_the_startup_heap_out_of_collections():
    # In a child: freezing is process-wide and would change the collector for the rest of pytest.
    code = textwrap.dedent(
        """
        import gc, sys
        from srt.process_utils import freeze_startup_heap
        startup = [object() for _ in range(1000)]
        assert gc.get_freeze_count() == 0
        seconds = freeze_startup_heap()
        frozen = gc.get_freeze_count()
        assert frozen >= 1000, frozen
        assert 0.0 <= seconds < 30.0, seconds
        # What serving allocates afterwards is still collected (cycles included).
        class Node: pass
        a, b = Node(), Node(); a.b, b.a = b, a
        del a, b
        assert gc.collect() >= 2
        assert gc.get_freeze_count() == frozen
        print("ok", frozen)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ok ")
