"""The package is mypy-clean (the house style promises typed public functions)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="mypy is in the test extras; install them")
def test_package_is_mypy_clean() -> None:
    result = subprocess.run([sys.executable, "-m", "mypy", "--no-error-summary", "infinity"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
