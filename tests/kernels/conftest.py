"""Kernel tests: register the `thirdparty` marker (tests needing packages outside the test extra)."""


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "thirdparty: needs a third-party kernel package (nvalchemi-toolkit-ops + warp-lang)"
    )
