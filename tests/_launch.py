"""Launch a test worker on several CPU processes (the project's launcher) and collect what each rank wrote."""

from __future__ import annotations

import io
import json
import os
import pathlib
from collections.abc import Mapping, Sequence

import pytest

from nvalchemi_jaxbridge.torch.launch import launch

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_ranks(worker: pathlib.Path, world: int, out_dir: pathlib.Path, args: Sequence[str] = (), *,
              result: str = "rank{rank}.json", timeout_s: float = 240, env: Mapping[str, str] | None = None
              ) -> list[dict]:
    """`worker OUT_DIR *args` on `world` processes (JAX on the CPU); the JSON each rank wrote to `result`.

    A non-zero exit fails the test with the end of the launcher's log.
    """
    full_env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), **(env or {}))
    full_env.pop("XLA_FLAGS", None)
    log = io.StringIO()
    code = launch([str(worker), str(out_dir), *args], world, timeout_s=timeout_s, env=full_env, out=log)
    if code != 0:
        pytest.fail(f"{world}-process run exited with {code}; log:\n{log.getvalue()[-6000:]}")
    return [json.loads((out_dir / result.format(rank=r)).read_text()) for r in range(world)]
