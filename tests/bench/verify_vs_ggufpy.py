"""Baseline for docs/BENCHMARKS.md: gguf-py dequantize + numpy statistics over every tensor of a
GGUF, the work `gguftool verify` does without --hash. Prints bytes, seconds and GB/s.
usage: python3 tests/bench/verify_vs_ggufpy.py MODEL.gguf   (pip install gguf numpy)"""
import sys, time
import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

path = sys.argv[1]
t0 = time.perf_counter()
r = GGUFReader(path)
total = 0
for t in r.tensors:
    x = dequantize(t.data, t.tensor_type).astype(np.float32).ravel()
    x64 = x.astype(np.float64)
    _ = (x64.mean(), x64.std(), x.min(), x.max(), np.abs(x).max(), np.count_nonzero(x == 0),
         np.isnan(x).sum(), np.isinf(x).sum())
    total += t.n_bytes
dt = time.perf_counter() - t0
print(f"gguf-py: {total} bytes in {dt:.2f} s = {total / dt / 1e9:.3f} GB/s")
