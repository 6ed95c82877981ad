"""Write a 400 GB *sparse* GGUF (valid header, 1,000 Q4_K tensors of 400 MB each, data never
written so it takes no disk), to show `gguftool info` reads only the header region.
usage: python3 tests/bench/info_sparse_400g.py OUT.gguf"""
import struct, sys

out = sys.argv[1]
def s(x): b = x.encode(); return struct.pack("<Q", len(b)) + b
n_t, ne0, ne1 = 1000, 6144, 116_000   # Q4_K: 144 bytes per 256 elements -> ~400 MB per tensor
kv = [("general.architecture", 8, s("llama")), ("general.alignment", 4, struct.pack("<I", 32))]
h = b"GGUF" + struct.pack("<IQQ", 3, n_t, len(kv))
for k, t, v in kv:
    h += s(k) + struct.pack("<I", t) + v
nbytes = ne0 // 256 * 144 * ne1
off = 0
for i in range(n_t):
    h += s(f"t.{i}.weight") + struct.pack("<IQQIQ", 2, ne0, ne1, 12, off)
    off += (nbytes + 31) // 32 * 32
pad = (-len(h)) % 32
with open(out, "wb") as f:
    f.write(h + b"\0" * pad)
    f.truncate(len(h) + pad + off)
print(f"{out}: {len(h) + pad + off} bytes (sparse)")
