"""Where a GPU is visible, the one test that trains on it: a tiny run of each script at each precision. The rest of
the suite is CPU-only (conftest hides GPUs from this process and every process it starts)."""

import math
import os
import subprocess
import sys

import pytest
import torch

from conftest import GPU_ENV, PATIENCE_S, ROOT, SCRIPTS, TINY_FLAGS, read_scalars


def gpu_visible() -> bool:
    """Asked of a fresh process with the environment as it came (this one hides GPUs); no driver, no question."""
    if not os.path.exists("/proc/driver/nvidia/version"):
        return False
    code = "import torch; print(torch.cuda.is_available())"
    asked = subprocess.run(
        [sys.executable, "-c", code], env=GPU_ENV, capture_output=True, text=True, timeout=PATIENCE_S
    )
    return asked.stdout.strip() == "True"


def test_the_suite_is_cpu_only():
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "" and not torch.cuda.is_available()


@pytest.mark.skipif(not gpu_visible(), reason="no GPU visible")
@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("name", SCRIPTS)
def test_tiny_run_on_a_gpu(name, precision, tmp_path):
    """A tiny run on CUDA at each precision, then its --resume with a raised budget (the checkpoint's tensors were
    saved from the GPU and load back onto it)."""
    argv = [sys.executable, str(ROOT / name), *TINY_FLAGS[name], "--precision", precision]
    done = subprocess.run(argv, cwd=tmp_path, env=GPU_ENV, capture_output=True, text=True, timeout=PATIENCE_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert " on cuda:" in done.stdout and f"precision {precision}" in done.stdout
    (run_dir,) = (tmp_path / "runs").iterdir()
    argv = [sys.executable, str(ROOT / name), "--resume", str(run_dir), "--total-timesteps", "256"]
    done = subprocess.run(argv, cwd=tmp_path, env=GPU_ENV, capture_output=True, text=True, timeout=PATIENCE_S)
    assert done.returncode == 0 and "resumed from" in done.stdout, done.stderr[-3000:]
    scalars = read_scalars(tmp_path)
    for tag in ("losses/policy_loss", "losses/value_loss", "aux_phase/joint_loss", "charts/SPS"):
        assert scalars[tag] and all(math.isfinite(v) for v in scalars[tag]), tag
    assert len(scalars["losses/value_loss"]) == 4
