"""Two processes on CPU (torchrun, gloo): DPPO with pruning and packing finishes without hanging, every rank
draws the same global masks, and both ranks end with the same parameters, including when a rank keeps
nothing."""

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).parent / "multiprocess_worker.py"


@pytest.mark.parametrize("sampling,rate", [("systematic", "0.5"), ("topk", "0.05")])
def test_two_ranks_agree_and_finish(tmp_path, tiny_model_dir, sampling, rate):
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    assert torchrun, "torchrun comes with torch"
    with socket.socket() as free:  # a free loopback port for the rendezvous
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    run = subprocess.run(
        [
            torchrun,
            "--nproc_per_node",
            "2",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(port),
            str(WORKER),
            tiny_model_dir,
            str(tmp_path),
            sampling,
            rate,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["world"] == 2 for r in ranks)
    assert ranks[0]["masks"] == ranks[1]["masks"] and ranks[0]["masks"]
    assert ranks[0]["fingerprint"] == pytest.approx(ranks[1]["fingerprint"], rel=1e-6)
    assert all(r["finite"] for r in ranks)
    if sampling == "topk":  # one row kept in a batch of 32: one rank has nothing to train on
        assert any(0 in pair for pair in zip(ranks[0]["local_kept"], ranks[1]["local_kept"]))
