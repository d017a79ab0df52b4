"""The GPU check script is ready to run: its dry run prints the plan and finds every step's command here."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_gpu_check_dry_run_passes_without_a_gpu(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "report")}
    run = subprocess.run([str(ROOT / "pipelines" / "gpu_check.sh"), "--dry-run"], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "CUDA tests" in run.stdout and "--device cuda" in run.stdout
    assert "dry run: ok" in run.stdout and not (tmp_path / "report").exists()  # a dry run writes nothing


def test_the_gpu_check_refuses_an_unknown_argument():
    run = subprocess.run([str(ROOT / "pipelines" / "gpu_check.sh"), "--frobnicate"], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 2 and "unknown argument --frobnicate" in run.stderr
