"""Test helpers that read Hugging Face directories with the safetensors library itself."""

import hashlib
import json
import os
import sys

import torch
from safetensors import safe_open


def read_hf_tensors(d: str) -> dict[str, torch.Tensor]:
    index = os.path.join(d, "model.safetensors.index.json")
    files = (
        sorted(set(json.load(open(index))["weight_map"].values())) if os.path.exists(index) else ["model.safetensors"]
    )
    out = {}
    for f in files:
        with safe_open(os.path.join(d, f), "pt") as fh:
            for n in fh.keys():
                out[n] = fh.get_tensor(n)
    return out


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def tree_digest(d: str) -> dict[str, str]:
    """Every file under `d` with the hash of its bytes and its mtime: to show an input is untouched."""
    out = {}
    for root, _, files in os.walk(d):
        for f in files:
            p = os.path.join(root, f)
            out[os.path.relpath(p, d)] = hashlib.sha256(open(p, "rb").read()).hexdigest() + f"@{os.stat(p).st_mtime_ns}"
    return out


def eprt_report(monkeypatch, capsys, *args) -> tuple[int, str]:
    """`eprt-report ARGS` in this process: its exit status and everything it printed."""
    from eprt.commands import report as report_command

    monkeypatch.setattr(sys, "argv", ["eprt-report", *map(str, args)])
    try:
        code = report_command.main()
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out + out.err
