"""tools/summarise_run.py, which turns a run's TensorBoard log into the README's evidence figures."""

import subprocess
import sys

from conftest import ROOT


def test_summarise_run_reads_returns_at_steps(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path))
    for i in range(300):  # returns 0, 1, ..., 299 at steps 1000, 2000, ...
        writer.add_scalar("charts/episodic_return", float(i), (i + 1) * 1000)
    writer.add_scalar("charts/SPS", 123.0, 300_000)
    writer.close()
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "summarise_run.py"), str(tmp_path), "--at", "150000",
                          "400000"], capture_output=True, text=True, check=True).stdout
    # the 100 episodes up to step 150,000 have returns 50..149: mean 99.5
    assert "150,000 steps: mean return   99.50 over the last 100 episodes" in out
    assert "400,000 steps: not reached" in out
    assert "SPS at step 300,000: 123" in out
