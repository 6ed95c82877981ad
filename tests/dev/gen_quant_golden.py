#!/usr/bin/env python3
"""Golden dequantization data from gguf-py, for gguf/tests/quant_golden.rs.

For every ggml type gguf-py can dequantize, build random block bytes (fixed seed) whose f16 scale
fields hold finite values, run `gguf.quants.dequantize`, and write

    tests/fixtures/quant-golden/<TYPE>.bin   the raw blocks
    tests/fixtures/quant-golden/<TYPE>.f32   gguf-py's output, little-endian f32
    tests/fixtures/quant-golden/MANIFEST.json  versions, seed, block counts, sha256 of every file

The Rust test compares every element bit for bit; it never needs Python.

How to rerun (needs network access to PyPI once; CI never runs this):

    python3 -m venv /tmp/gguf-venv && /tmp/gguf-venv/bin/pip install gguf==0.19.0
    /tmp/gguf-venv/bin/python tests/dev/gen_quant_golden.py        # from the repo root

Output is deterministic for a given gguf/numpy version (numpy's PCG64 stream with SEED).

Scale fields: a random f16 bit pattern would be Inf/NaN 1/32 of the time, which tests nothing
about the format, so every f16 scale is drawn as either a random *finite* bit pattern
(covers zero, subnormals and huge values) or a realistic weight scale (|d| ~ 1e-4..1e-1).
All other bytes (quant indices, sub-scales, sign bits, E8M0/UE4M3 scales) are uniform random,
so MXFP4 scales near 2^127 overflow to Inf exactly as in ggml.
"""

from __future__ import annotations

import hashlib
import json
import sys
from importlib.metadata import version
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGML_QUANT_SIZES
from gguf.quants import dequantize

SEED = 0x6767_7566  # "gguf"
OUT = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "quant-golden"

# Byte offsets of the f16 scale fields inside one block (ggml-common.h layouts, spec §5).
F16_FIELDS: dict[T, list[int]] = {
    T.Q4_0: [0],
    T.Q4_1: [0, 2],
    T.Q5_0: [0],
    T.Q5_1: [0, 2],
    T.Q8_0: [0],
    T.Q2_K: [80, 82],
    T.Q3_K: [108],
    T.Q4_K: [0, 2],
    T.Q5_K: [0, 2],
    T.Q6_K: [208],
    T.TQ1_0: [52],
    T.TQ2_0: [64],
    T.MXFP4: [],
    T.NVFP4: [],
    T.IQ2_XXS: [0],
    T.IQ2_XS: [0],
    T.IQ2_S: [0],
    T.IQ3_XXS: [0],
    T.IQ3_S: [0],
    T.IQ1_S: [0],
    T.IQ1_M: [],  # its f16 is spread over the top nibbles of the scales, set below
    T.IQ4_NL: [0],
    T.IQ4_XS: [0],
}


def finite_f16(rng: np.random.Generator, n: int) -> np.ndarray:
    """n finite f16 bit patterns: half arbitrary finite bits, half realistic weight scales."""
    bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint32).astype(np.uint16)
    exp_all_ones = (bits & 0x7C00) == 0x7C00
    bits = np.where(exp_all_ones, bits & ~np.uint16(0x4000), bits).astype(np.uint16)
    realistic = (rng.choice([-1.0, 1.0], size=n) * 10.0 ** rng.uniform(-4, -1, size=n)).astype(np.float16)
    pick = rng.random(n) < 0.5
    return np.where(pick, bits, realistic.view(np.uint16)).astype(np.uint16)


def blocks_for(qtype: T, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    _, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint16).astype(np.uint8)
    for off in F16_FIELDS[qtype]:
        raw[:, off:off + 2] = finite_f16(rng, n_blocks).view(np.uint8).reshape(n_blocks, 2)
    if qtype == T.IQ1_M:
        d = finite_f16(rng, n_blocks)
        scales = raw[:, 48:56].copy().view(np.uint16).reshape(n_blocks, 4)
        for k in range(4):
            nib = (d >> np.uint16(4 * k)) & np.uint16(0xF)
            scales[:, k] = (scales[:, k] & np.uint16(0x0FFF)) | (nib << np.uint16(12))
        raw[:, 48:56] = scales.view(np.uint8).reshape(n_blocks, 8)
    # Edge scales every decoder must get right, not left to chance: E8M0 subnormal halves
    # (e = 0, 1) and 2^127 (overflows to Inf with the larger values); UE4M3 zero, the 0x7F
    # "NaN" pattern (decodes to 0), bit 7 set (ignored) and the largest value.
    if qtype == T.MXFP4:
        raw[:4, 0] = [0, 1, 254, 255]
    if qtype == T.NVFP4:
        raw[0, 0:4] = [0x00, 0x7F, 0x80, 0xFF]
        raw[1, 0:4] = [0x01, 0x08, 0x7E, 0x38]
    return raw


def plain_values(qtype: T, n: int, rng: np.random.Generator) -> np.ndarray:
    """Plain float types: random bits plus the special values every converter must get right."""
    if qtype == T.F32:
        specials = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x00000001, 0x007FFFFF,
                             0x3F800000, 0x7F7FFFFF], dtype=np.uint32)
        bits = rng.integers(0, 1 << 32, size=n - len(specials), dtype=np.uint64).astype(np.uint32)
        return np.concatenate([specials, bits]).view(np.uint8)
    specials = np.array([0, 0x8000, 0x7C00, 0xFC00, 0x0001, 0x03FF, 0x0400, 0x3C00, 0x7BFF, 0x7F80, 0xFF80,
                         0x0080, 0x8001], dtype=np.uint16)
    bits = rng.integers(0, 1 << 16, size=n - len(specials), dtype=np.uint32).astype(np.uint16)
    if qtype == T.F16:
        # NaN payload handling differs between conversion routines and says nothing about the
        # format; the Rust comparison is NaN-aware, so keep NaNs out of the random part.
        nan = ((bits & 0x7C00) == 0x7C00) & ((bits & 0x03FF) != 0)
        bits = np.where(nan, bits & ~np.uint16(0x4000), bits).astype(np.uint16)
    return np.concatenate([specials, bits]).view(np.uint8)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def main() -> int:
    rng = np.random.default_rng(SEED)
    OUT.mkdir(parents=True, exist_ok=True)
    manifest = {
        "tool": "tests/dev/gen_quant_golden.py",
        "gguf_version": version("gguf"),
        "numpy_version": np.__version__,
        "seed": SEED,
        "types": {},
    }
    order = [T.F32, T.F16, T.BF16] + list(F16_FIELDS)
    for qtype in order:
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        if block_size == 1:
            raw = plain_values(qtype, 256, rng)
        else:
            # ~2-8 KiB of expected output per type: 8 super-blocks or 16-32 small blocks.
            n_blocks = 8 if block_size >= 256 else (2048 // block_size if block_size >= 64 else 32)
            raw = blocks_for(qtype, n_blocks, rng).reshape(-1)
        raw = np.ascontiguousarray(raw, dtype=np.uint8)
        out = dequantize(raw, qtype).astype(np.float32, copy=False).reshape(-1)
        n_blocks = raw.size // type_size
        assert out.size == n_blocks * block_size, qtype.name
        bin_bytes = raw.tobytes()
        f32_bytes = out.astype("<f4").tobytes()
        (OUT / f"{qtype.name}.bin").write_bytes(bin_bytes)
        (OUT / f"{qtype.name}.f32").write_bytes(f32_bytes)
        manifest["types"][qtype.name] = {
            "n_blocks": n_blocks,
            "n_elements": int(out.size),
            "sha256_bin": sha256(bin_bytes),
            "sha256_f32": sha256(f32_bytes),
        }
    (OUT / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    total = sum(p.stat().st_size for p in OUT.iterdir())
    print(f"wrote {len(manifest['types'])} types to {OUT} ({total} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
