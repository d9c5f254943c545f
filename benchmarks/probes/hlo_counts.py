"""Counts in optimized HLO dumps of decode rounds (``XLA_FLAGS=--xla_dump_to=DIR
--xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*decode_round.*``): per module, the weight
products by output shape (``gemm_fusion`` calls), the instructions XLA's rematerialization pass
made (names with ``.remat``) by kind and shape, and the entry parameters' bytes on the device and
in pinned host memory (layout memory space ``S(5)``).

    python benchmarks/probes/hlo_counts.py DUMP_DIR --out FILE.json [--meta key=value ...]

No JAX needed: it reads the ``*after_optimizations.txt`` texts only.
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4,
          "s64": 8, "u64": 8, "f64": 8}
_ARRAY = re.compile(r"(" + "|".join(_BYTES) + r")\[([\d,]*)\](\{[^}]*\})?")


def _shape(text: str) -> str:
    """``f32[8,8,1536]{2,1,0}`` -> ``f32[8,8,1536]`` (layouts dropped)."""
    return re.sub(r"\{[^}]*\}", "", text)


def param_bytes(header: str) -> dict:
    """Entry parameters' bytes by memory space, from the module's first line."""
    m = re.search(r"entry_computation_layout=\{\((.*)\)->", header)
    out = {"device": 0, "pinned_host": 0}
    for dtype, dims, layout in _ARRAY.findall(m.group(1) if m else ""):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        out["pinned_host" if layout and "S(5)" in layout else "device"] += n * _BYTES[dtype]
    return out


def count(text: str) -> dict:
    """One module's counts (the module docstring)."""
    gemms, remat = collections.Counter(), collections.Counter()
    for line in text.splitlines():
        m = re.match(r"\s*%(\S+) = (\S+) (\S+)\(", line)
        if not m:
            continue
        name, shape, op = m.group(1), _shape(m.group(2)), m.group(3)
        if op == "fusion" and "calls=%gemm_fusion" in line:
            gemms[shape] += 1
        if ".remat" in name:
            remat[f"{re.sub(r'[.0-9]+$', '', name.split('.remat')[0])} {shape}"] += 1
    return dict(params_bytes=param_bytes(text.split("\n", 1)[0]),
                gemm_fusions=sum(gemms.values()), gemm_fusions_by_shape=dict(gemms.most_common()),
                rematerialized=sum(remat.values()), rematerialized_by_kind=dict(remat.most_common()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dump_dir")
    ap.add_argument("--out", required=True)
    ap.add_argument("--meta", nargs="*", default=[], help="key=value pairs for the JSON")
    a = ap.parse_args()
    files = sorted(glob.glob(os.path.join(a.dump_dir, "**", "*after_optimizations.txt"),
                             recursive=True))
    if not files:
        raise SystemExit(f"no *after_optimizations.txt under {a.dump_dir}")
    modules = {}
    for f in files:
        with open(f) as fh:
            modules[os.path.basename(f)] = count(fh.read())
    out = dict(meta=dict(kv.split("=", 1) for kv in a.meta), modules=modules)
    with open(a.out, "w") as fh:
        json.dump(out, fh, indent=1)
    for name, c in modules.items():
        gib = {k: round(v / 2**30, 2) for k, v in c["params_bytes"].items()}
        print(f"{name}: params GiB {gib}, {c['gemm_fusions']} weight products, "
              f"{c['rematerialized']} rematerialized instructions")


if __name__ == "__main__":
    main()
