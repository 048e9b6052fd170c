"""gramsync's version: the installed package's metadata, else pyproject.toml (a source
checkout that was never installed), else "unknown"."""
from __future__ import annotations

import importlib.metadata
import os


def _version() -> str:
    try:
        return importlib.metadata.version("gramsync")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        import tomllib

        path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyproject.toml")
        with open(path, "rb") as f:
            return str(tomllib.load(f)["project"]["version"])
    except (ImportError, OSError, KeyError, ValueError):
        return "unknown"


__version__ = _version()
