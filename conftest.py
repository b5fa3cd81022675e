"""Fixtures shared by the test files."""

import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smoke_base(tmp_path_factory):
    """A pretrained smoke-size base model (train.py in a subprocess), shared by the train.py tests."""
    out = tmp_path_factory.mktemp("base")
    cmd = [sys.executable, str(Path(__file__).resolve().parent / "train.py"),
           "--preset", "smoke", "--stage", "pretrain", "--out", str(out)]
    res = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return out / "base.pt"
