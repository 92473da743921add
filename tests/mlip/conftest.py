"""Model-level test switch: `JAXBRIDGE_TEST_CUDA_GRAPHS=fake` records every stage op with the CPU stand-in.

With it, `cuda_graphs="auto"` (every `DistributedMLIP` of the tests) records and replays the stages with
`FakeCapture`, which keeps the CUDA backend's buffers and replay rules, so the whole model-level suite
checks that a replayed stage gives the eager numbers:

    JAXBRIDGE_TEST_CUDA_GRAPHS=fake python -m pytest tests/mlip -n 0 -q
"""

from __future__ import annotations

import os

import pytest

FAKE_GRAPHS = os.environ.get("JAXBRIDGE_TEST_CUDA_GRAPHS", "") == "fake"


@pytest.fixture(autouse=FAKE_GRAPHS)
def fake_cuda_graphs(monkeypatch):
    from nvalchemi_jaxbridge.kernels import cuda_graphs

    monkeypatch.setattr(cuda_graphs, "default_backend", lambda device: cuda_graphs.FakeCapture())
