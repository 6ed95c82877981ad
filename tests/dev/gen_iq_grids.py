#!/usr/bin/env python3
"""Write the lookup tables of the ggml IQ / FP4 quant formats to gguf/data/iq_tables.bin.

The Rust crate embeds that file with `include_bytes!` and decodes it once (gguf::quant::tables);
the tables are data taken from gguf-py's published implementation, not code of ours.

How to rerun (needs network access to PyPI once; CI never runs this):

    python3 -m venv /tmp/gguf-venv && /tmp/gguf-venv/bin/pip install gguf==0.19.0
    /tmp/gguf-venv/bin/python tests/dev/gen_iq_grids.py            # from the repo root

The output is deterministic; rerunning with the same gguf version rewrites identical bytes.
Afterwards run `cargo test -p gguf --test quant_golden` (the golden data checks the tables).

File format (all integers little-endian):

    magic   8 bytes  b"GGIQTAB1"
    count   u32      number of tables
    count x table:
        name_len u8, name (ASCII)
        kind     u8   0 = u8 values, 1 = i8 values
        rows     u32
        cols     u32
        values   rows*cols bytes, row-major

Tables: the grids of IQ2_XXS/IQ2_XS/IQ2_S/IQ3_XXS/IQ3_S/IQ1_S (gguf-py stores them hex-packed with
2-3 bits per value and expands them in `init_grid`; we store the expanded byte values, as ggml's
`iq2xxs_grid` etc. hold them), the sign table `ksigns_iq2xs`, and the 16-entry value tables of
IQ4_NL/IQ4_XS and MXFP4/NVFP4.
"""

from __future__ import annotations

import struct
import sys
from importlib.metadata import version
from pathlib import Path

import numpy as np
from gguf import quants

EXPECTED_GGUF = "0.19.0"
OUT = Path(__file__).resolve().parents[2] / "gguf" / "data" / "iq_tables.bin"


def grid_of(cls, signed: bool) -> np.ndarray:
    cls.init_grid()
    g = cls.grid.reshape(cls.grid_shape)
    as_int = np.rint(g).astype(np.int64)
    assert np.array_equal(as_int.astype(np.float32), g), f"{cls.__name__}: grid is not integral"
    lo, hi = (-128, 127) if signed else (0, 255)
    assert as_int.min() >= lo and as_int.max() <= hi, cls.__name__
    return as_int


def table(name: str, values: np.ndarray, signed: bool) -> bytes:
    values = np.asarray(values, dtype=np.int64)
    if values.ndim == 1:
        values = values.reshape(1, -1)
    rows, cols = values.shape
    raw = values.astype(np.int8 if signed else np.uint8).tobytes()
    head = struct.pack("<B", len(name)) + name.encode("ascii")
    return head + struct.pack("<BII", 1 if signed else 0, rows, cols) + raw


def main() -> int:
    have = version("gguf")
    if have != EXPECTED_GGUF:
        print(f"warning: gguf {have} installed, tables were defined against {EXPECTED_GGUF}", file=sys.stderr)

    tables = [
        table("iq2xxs_grid", grid_of(quants.IQ2_XXS, False), False),
        table("iq2xs_grid", grid_of(quants.IQ2_XS, False), False),
        table("iq2s_grid", grid_of(quants.IQ2_S, False), False),
        table("iq3xxs_grid", grid_of(quants.IQ3_XXS, False), False),
        table("iq3s_grid", grid_of(quants.IQ3_S, False), False),
        table("iq1s_grid", grid_of(quants.IQ1_S, True), True),
        table("ksigns_iq2xs", np.frombuffer(quants.IQ2_XXS.ksigns, dtype=np.uint8), False),
        table("kvalues_iq4nl", np.array(quants.IQ4_NL.kvalues), True),
        table("kvalues_mxfp4", np.array(quants.MXFP4.kvalues), True),
    ]
    # IQ1_M shares IQ1_S's grid in gguf-py; fail loudly if a future version splits them.
    assert quants.IQ1_M.grid_hex == quants.IQ1_S.grid_hex
    assert quants.NVFP4.kvalues == quants.MXFP4.kvalues

    data = b"GGIQTAB1" + struct.pack("<I", len(tables)) + b"".join(tables)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_bytes(data)
    print(f"wrote {OUT} ({len(data)} bytes, {len(tables)} tables, gguf {have})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
