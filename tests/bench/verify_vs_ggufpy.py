"""Baseline for docs/BENCHMARKS.md: gguf-py dequantize + numpy statistics over every tensor of a
GGUF, the work `gguftool verify` does without --hash. Large tensors are processed in row chunks
(dequantizing a 1.8 GB expert tensor at once needs ~40 GB of float64). Prints bytes, s and GB/s.
usage: python3 tests/bench/verify_vs_ggufpy.py MODEL.gguf   (pip install gguf numpy)"""
import sys, time
import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

CHUNK = 64 << 20  # raw bytes per step

path = sys.argv[1]
t0 = time.perf_counter()
r = GGUFReader(path)
total = 0
for t in r.tensors:
    raw = t.data.reshape(-1, t.data.shape[-1]) if t.data.ndim > 1 else t.data.reshape(1, -1)
    rows = max(1, CHUNK // max(1, raw.nbytes // raw.shape[0]))
    n = s = ss = 0.0
    mn, mx, amax, zeros, nans, infs = np.inf, -np.inf, 0.0, 0, 0, 0
    for i in range(0, raw.shape[0], rows):
        x = dequantize(raw[i:i + rows], t.tensor_type).astype(np.float32).ravel()
        x64 = x.astype(np.float64)
        n += x.size; s += x64.sum(); ss += (x64 * x64).sum()
        mn = min(mn, float(x.min())); mx = max(mx, float(x.max())); amax = max(amax, float(np.abs(x).max()))
        zeros += int(np.count_nonzero(x == 0)); nans += int(np.isnan(x).sum()); infs += int(np.isinf(x).sum())
    total += t.n_bytes
dt = time.perf_counter() - t0
print(f"gguf-py: {total} bytes in {dt:.2f} s = {total / dt / 1e9:.3f} GB/s")
