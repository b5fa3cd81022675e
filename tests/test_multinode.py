"""More than one machine, on this one: two torchrun launches with --nnodes 2 (a c10d rendezvous on
the loopback address), two processes each, train the smoke pipeline as one 4-process run does,
across a checkpoint and --resume. The 4-process run is written as its equal, one process with
--grad-accum 4 (test_distributed.py checks that A processes and 1 process × A micro-batches train
alike). The nodes share the run folder (rank 0 writes it; every rank reads its checkpoints on
--resume), the base and the prompts (every rank reads them), as docs/real_models.md's command asks."""

import os
import subprocess
import sys

import train
from tests.helpers import ROOT
from tests.test_distributed import assert_same_training, free_port


def two_nodes(flags, tag):
    """Two torchrun agents, as node 0 and node 1 would be started, meeting at a c10d rendezvous on
    127.0.0.1 (the first to come hosts it); each runs 2 processes of train.py. Returns their outputs."""
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", tag, "--max-restarts", "0",
           str(ROOT / "train.py"), *map(str, flags)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    nodes = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [node.communicate(timeout=300) for node in nodes]
    for node, (out, err) in zip(nodes, outs):
        assert node.returncode == 0, out[-3000:] + err[-3000:]
    return [out for out, _ in outs]


def test_two_nodes_of_two_processes_train_and_resume_as_four_processes(smoke_base, tmp_path):
    flags = lambda out, steps: ["--preset", "smoke", "--eval-prompts", "0", "--init", smoke_base, "--prompts-per-step", 4,
                                "--steps", steps, "--out", tmp_path / out]
    assert train.cli([str(f) for f in flags("one", 2) + ["--grad-accum", 4]]) == 0
    first = two_nodes(flags("nodes", 1), "first")
    assert sum(out.count("world size 4") for out in first) == 1  # global rank 0, on one of the nodes, alone prints
    second = two_nodes(flags("nodes", 2) + ["--resume"], "second")
    assert sum(out.count("resumed from step 1") for out in second) == 1
    assert_same_training(tmp_path / "one", tmp_path / "nodes")
