"""For test modules whose verdicts need trained weights (the model must close a JSON
document, a tool call or a sentence by itself within a few dozen tokens; a random one
rambles): ``server = real_weights("server")`` at module level makes that module's ``server``
the real SmolLM2's (``smollm2_server`` in conftest.py), and likewise for the other shared
servers. The rest of the suite shares the tiny model's (tests/tiny_model.py)."""
import pytest

REAL = {"server": "smollm2_server", "server_llguidance": "smollm2_server_llguidance",
        "server_auto": "smollm2_server_auto", "tp2_server": "smollm2_tp2_server"}


def real_weights(name: str):
    """A fixture named ``name`` that is the real model's server of the same flags."""
    target = REAL[name]

    @pytest.fixture(scope="session", name=name)
    def _real(request):
        return request.getfixturevalue(target)

    return _real
