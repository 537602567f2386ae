"""Packing the same input in separate processes gives byte-identical manifests."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from chunking import ChunkingConfig, Manifest, pack
from chunking.synthetic import finetune, synthetic_state_dict

REPO = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import sys, torch
from chunking import ChunkingConfig, Manifest, pack
from chunking.synthetic import synthetic_state_dict
sd = synthetic_state_dict(3 << 20, dtype=torch.bfloat16, seed=5, tensor_bytes=1 << 20)
sd["ünï.cöde.µ"] = torch.arange(7, dtype=torch.int16)
sd["scalar"] = torch.tensor(2.5, dtype=torch.float64)
if sys.argv[2] == "reversed":
    sd = dict(reversed(list(sd.items())))
cfg = ChunkingConfig(chunk_size=1 << 16, codec=sys.argv[3])
sys.stdout.buffer.write(pack(sd, model="det", version=3, config=cfg, created_at=1700000000.25).manifest.to_bytes())
"""


def test_two_processes_produce_byte_identical_manifests() -> None:
    # "auto" yields both raw and zstd chunks; the second process also sees the dict in reverse order.
    procs = [
        subprocess.Popen([sys.executable, "-c", SCRIPT, "x", order, "auto"], stdout=subprocess.PIPE, cwd=REPO)
        for order in ("forward", "reversed")
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs[0] == outs[1] and len(outs[0]) > 100
    codecs = {c.codec for c in Manifest.from_bytes(outs[0]).chunks}
    assert "raw" in codecs and any(c.startswith("zstd") for c in codecs)


def test_synthetic_models_are_reproducible() -> None:
    a = synthetic_state_dict(1 << 20, seed=3, tensor_bytes=1 << 18)
    b = synthetic_state_dict(1 << 20, seed=3, tensor_bytes=1 << 18)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert sum(v.nbytes for v in a.values()) >= 1 << 20
    cfg = ChunkingConfig(chunk_size=1 << 16)
    assert pack(a, model="m", config=cfg).manifest.fingerprint == pack(b, model="m", config=cfg).manifest.fingerprint
    ft = finetune(a, 0.5, seed=1)
    assert pack(ft, model="m", config=cfg).manifest.fingerprint != pack(a, model="m", config=cfg).manifest.fingerprint
