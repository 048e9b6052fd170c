"""gramsync launcher: ``python launch.py [flags]`` serves the model over HTTP.

With no flags it serves the embedded SmolLM2-135M-Instruct on 127.0.0.1:30000.
``--tp-size/--dp-size`` start the ranks here; under ``torchrun`` each worker is one rank;
``--nnodes N --node-rank K --dist-init-addr host:port`` spreads them over N machines.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_OUR_PACKAGES = ("srt", "constrained", "sampling", "distributed")


def check_own_packages() -> None:
    """`srt` and `distributed` are also names of unrelated PyPI packages; refuse to run
    against them instead of failing later with a confusing import error."""
    for name in _OUR_PACKAGES:
        spec = importlib.util.find_spec(name)
        origin = os.path.dirname(spec.origin) if spec and spec.origin else None
        marker = origin and os.path.exists(os.path.join(os.path.dirname(origin), "launch.py"))
        if not marker:
            sys.exit(f"error: the imported package '{name}' ({origin}) is not gramsync's own. "
                     "Install gramsync into a dedicated virtual environment (`make setup`) "
                     "and run it from there.")


def build_parser() -> argparse.ArgumentParser:
    from srt.environ import format_env_table
    from srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(
        prog="launch.py", description="gramsync: grammar-constrained LLM serving",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=format_env_table())
    ServerArgs.add_cli_args(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    if _HERE not in sys.path:
        sys.path.insert(0, _HERE)
    check_own_packages()
    if argv is None:  # the command line: run it again with the allocator preloaded
        from srt.model_executor.cpu_allocator import reexec_with_allocator

        reexec_with_allocator()
    from srt.entrypoints.http_server import launch_server
    from srt.entrypoints.torchrun import torchrun_main, under_torchrun
    from srt.server_args import ServerArgs

    args = build_parser().parse_args(argv)
    try:
        server_args = ServerArgs.from_cli_args(args)
    except ValueError as e:
        sys.exit(f"error: {e}")
    if under_torchrun():  # each torchrun worker is one scheduler rank
        torchrun_main(server_args)
    elif server_args.node_rank > 0:  # --nnodes N without torchrun: this node's ranks only
        import logging

        import setproctitle

        from srt.entrypoints.launcher import prepare_server_args, run_worker_node

        from srt.security.cluster_secret import ClusterSecretError, require_secret

        try:
            require_secret(server_args.cluster_secret_file)
        except ClusterSecretError as e:
            sys.exit(f"error: {e}")
        setproctitle.setproctitle(f"gramsync::node{server_args.node_rank}")
        logging.basicConfig(level=server_args.log_level.upper(), format=(
            f"[%(asctime)s node{server_args.node_rank}] %(levelname)s %(name)s: %(message)s"))
        sys.exit(run_worker_node(prepare_server_args(server_args)))
    else:
        from srt.security.cluster_secret import ClusterSecretError

        try:
            launch_server(server_args)
        except (RuntimeError, ClusterSecretError) as e:  # e.g. a rank failed to start: its name and reason
            sys.exit(f"gramsync: {e}")


if __name__ == "__main__":
    main()
