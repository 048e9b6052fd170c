"""gramsync launcher: ``python launch.py [flags]`` serves the model over HTTP.

With no flags it serves the embedded SmolLM2-135M-Instruct on 127.0.0.1:30000.
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
    from srt.entrypoints.http_server import launch_server
    from srt.server_args import ServerArgs

    args = build_parser().parse_args(argv)
    try:
        server_args = ServerArgs.from_cli_args(args)
    except ValueError as e:
        sys.exit(f"error: {e}")
    launch_server(server_args)


if __name__ == "__main__":
    main()
