"""A "grammar backend plugin" for tests that breaks the start-up of ONE scheduler rank.

Loaded with ``--grammar-backend-plugins fail_on_rank_plugin`` (tests/ on PYTHONPATH): every
rank imports it while building its scheduler; the rank named by ``GRAMSYNC_TEST_FAIL_RANK``
(e.g. ``DP0_TP1``, matched against the rank's process title) raises, the others go on.
"""
from __future__ import annotations

import os

import setproctitle

_rank = os.environ.get("GRAMSYNC_TEST_FAIL_RANK", "")
if _rank and setproctitle.getproctitle() == f"gramsync::scheduler_{_rank}":
    raise RuntimeError(f"injected start-up failure on {_rank}")
