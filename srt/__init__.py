"""gramsync serving runtime. ``from srt import Engine`` for offline generation."""


def __getattr__(name):
    # Lazy: importing srt (e.g. in a scheduler subprocess) must not pull in the frontend.
    if name == "Engine":
        from srt.entrypoints.engine import Engine

        return Engine
    raise AttributeError(name)


GRAMSYNC_PACKAGE = True  # launch.py checks this to tell our `srt` from the PyPI one
