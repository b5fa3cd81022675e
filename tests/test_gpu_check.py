"""benchmarks/gpu_check.py, the first GPU's command, where there is none: it checks its flags (a bad one
is one line naming it, exit status 2, nothing written), says in one line that there is no CUDA device and
exits 0; and its smoke section runs on the CPU (`--device cpu`), in both precisions, writing the table as
JSON (its parity check in both precisions: tests/test_precision.py); a section or preset that raises is
one FAIL row and the others still run."""

import json

import pytest
import torch

from benchmarks import gpu_check
from infra.processes import cli


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_without_cuda_it_checks_its_flags_and_says_so_in_one_line(no_cuda, tmp_path, capsys):
    assert cli(gpu_check.main, ["--json", str(tmp_path / "table.json"), "--work", str(tmp_path / "work")]) == 0
    out, err = capsys.readouterr()
    assert out == "gpu_check: no CUDA device here; flags checked, nothing run\n" and err == ""
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("flags, words", [(["--sections", "smoke,speed"], "--sections smoke,speed: choose from smoke, "),
                                          (["--presets", "mar_huge"], "--presets mar_huge: choose from mar_base, harmon, nova"),
                                          (["--memory-tokens", "60"], "--memory-tokens"),
                                          (["--json", "/proc/table.json"], "--json /proc: cannot create files in /proc"),
                                          (["--device", "tpu"], "--device: invalid choice: 'tpu'")])
def test_a_bad_flag_is_one_line(no_cuda, flags, words, tmp_path, capsys):
    assert cli(gpu_check.main, [*flags, "--work", str(tmp_path / "work")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: ") and words in err and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []


def test_the_smoke_section_on_the_cpu(tmp_path, capsys):
    rows = gpu_check.main(["--device", "cpu", "--sections", "smoke", "--work", str(tmp_path / "work"),
                           "--json", str(tmp_path / "table.json"), "--threads", "1"])
    table = json.loads((tmp_path / "table.json").read_text())
    runs = ("plain fp32", "checkpointed fp32", "plain bf16")  # the CPU's default precision, then the other
    assert [r["check"] for r in table["rows"]] == [row[0] for row in rows] == [
        name for m in ("small", "harmon", "nova")
        for name in [f"smoke {m} {run}" for run in runs] + [f"smoke {m}: checkpointed - plain, step 0"]]
    checks = {r["check"]: r for r in table["rows"]}
    for model in ("small", "harmon", "nova"):
        for run in runs:  # each run's recorded = recomputed ℓ, bit for bit on the CPU in either precision
            assert checks[f"smoke {model} {run}"]["result"] == "ok"
            assert ", max |Δℓ| recorded - recomputed 0 nats" in checks[f"smoke {model} {run}"]["figures"]
        assert checks[f"smoke {model}: checkpointed - plain, step 0"]["figures"] == "Δ loss 0, Δ grad_norm 0, Δ logp_parity_err 0"
    assert "| check | result | figures |" in capsys.readouterr().out


def test_a_failing_section_is_a_fail_row_and_the_next_section_still_runs(tmp_path, monkeypatch, capsys):
    def smoke(opts, out):  # one row, then out of memory
        out(("smoke small plain fp32", "ok", "exit 0"))
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore lines")
    monkeypatch.setattr(gpu_check, "smoke", smoke)
    monkeypatch.setattr(gpu_check, "nccl", lambda opts, out: [("torchrun, 1 process, gloo", "ok", "exit 0")])
    rows = gpu_check.main(["--device", "cpu", "--sections", "smoke,nccl", "--work", str(tmp_path / "work"),
                           "--json", str(tmp_path / "table.json")])
    assert rows == [("smoke small plain fp32", "ok", "exit 0"),
                    ("smoke: not finished", "FAIL", "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"),
                    ("torchrun, 1 process, gloo", "ok", "exit 0")]
    assert [tuple(r.values()) for r in json.loads((tmp_path / "table.json").read_text())["rows"]] == rows
    assert "Traceback" in capsys.readouterr().err


def test_one_presets_failure_leaves_the_others_rows(tmp_path, monkeypatch):
    def released_preset(opts, preset, out):
        if preset == "harmon":
            raise ValueError("no such weights")
        out((f"parity {preset}, 64 tokens", "ok", "0 nats"))
        return [(f"parity {preset}, 64 tokens", "ok", "0 nats")]
    monkeypatch.setattr(gpu_check, "released_preset", released_preset)
    rows = gpu_check.main(["--device", "cpu", "--sections", "parity", "--work", str(tmp_path / "work"),
                           "--json", str(tmp_path / "table.json")])
    assert rows == [("parity mar_base, 64 tokens", "ok", "0 nats"), ("parity, memory harmon: not finished", "FAIL", "ValueError: no such weights"),
                    ("parity nova, 64 tokens", "ok", "0 nats")]
