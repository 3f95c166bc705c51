"""Compile every Triton kernel of kascade for an H100 / H200 (sm_90) on this machine, no GPU needed.

    TRITON_INTERPRET=0 python tests/ops/compile_sm90.py [NAME ...] [--resources]   ->  one JSON line per variant

The interpreter that runs the kernel tests on CPUs accepts code that the GPU compiler refuses (a kernel reading a
plain Python global, say), and shared memory only runs out on the device; this compiles each kernel as the
launchers configure it, through Triton's real front end and NVIDIA back end (ptxas included), and reports the
shared memory per program, whether ptxas serialises its wgmma instructions, and with --resources the registers and
spills (as this machine's Triton compiles it: with the GPU machine's Triton, 3.6.0, on the path they matched Nsight
Compute's reading on the H200, e.g. the sparse decode pass at D = 128: 157 registers, 39,424 bytes of shared
memory). tests/ops/test_triton_compiles.py runs it, with the GPU machine's Triton where CI installed it.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import tempfile

assert os.environ.get("TRITON_INTERPRET", "0") != "1", "compiling needs TRITON_INTERPRET unset"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kascade.ops.triton import decode as td  # noqa: E402
from kascade.ops.triton import fp8 as tf  # noqa: E402
from kascade.ops.triton import int8 as ti  # noqa: E402
from kascade.ops.triton import prefill as tp  # noqa: E402
from kascade.ops.triton import step as ts  # noqa: E402
from kascade.ops.triton import topk  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
BF16, I32, I64, F32, FP8, I8 = "*bf16", "*i32", "*i64", "*fp32", "*fp8e4nv", "*i8"
# Pointer arguments by name (others that start with a capital letter are fp32 buffers); scalar arguments are int32
# unless named here.
POINTERS = {"Q": BF16, "K": BF16, "V": BF16, "Out": BF16, "Idx": I32, "Cnt": I32, "Meta": I32, "BT": I32,
            "Hist": I32, "Done": I32, "State": I32, "KvStart": I32, "RowStart": I32, "Vals": F32, "X": BF16, "X8": FP8}
SCALARS = {"qk_scale": "fp32", "mass": "fp32", "S": "i32", "C": "i32", "KMAX": "i32", "L": "i32", "W": "i32"}
# Integer arguments that the launchers' calls make multiples of 16 (Triton specialises a launch on that).
DIVISIBLE = ("keys_per_split", "sc_row")


def variants():
    """(name, kernel, constexprs, num_warps, num_stages[, options]) as the launchers make them (Llama shapes: G = 4,
    D = 128; the default model's: G = 3, D = 64; Gemma's head size: G = 2, D = 256)."""
    for D, G in ((128, 4), (64, 3), (256, 2)):
        base = dict(H=8, G=G, GP=td._gp(G), D=D, PAGE=1, PAGED=False, F32=False, NHIST=topk.NHIST, RNE=False,
                    HAS_CNT=False, MAXB=1, SB=td._merge_block(64, D))
        for kind, flags in (("score", dict(SPARSE=False, HAS_V=False, WRITE_SCORES=True, DIRECT=False)),
                            ("dense_scores", dict(SPARSE=False, HAS_V=True, WRITE_SCORES=True, DIRECT=False)),
                            ("dense", dict(SPARSE=False, HAS_V=True, WRITE_SCORES=False, DIRECT=False)),
                            ("sparse", dict(SPARSE=True, HAS_V=True, WRITE_SCORES=False, DIRECT=False))):
            bn, nw, ns = td._default_config(D, kind)
            maxb = 8 if kind == "sparse" else 1
            yield f"decode {kind} D{D}", td._split_kernel, {**base, **flags, "BLOCK_N": bn, "MAXB": maxb}, nw, ns
        bn, nw, ns = td._default_config(D, "score")
        for q8 in ("fp8", "int8"):  # FP8 / INT8 scoring: e4m3 / int8 Q and K (their names say which)
            yield (f"decode score {q8} D{D}", td._split_kernel,
                   {**base, "SPARSE": False, "HAS_V": False, "WRITE_SCORES": True, "DIRECT": False, "BLOCK_N": bn,
                    "FP8": True, "FP8_MMA": True}, nw, ns)
        yield (f"decode merge D{D}", td._merge_kernel, dict(H=8, G=G, D=D, SB=td._merge_block(64, D), RNE=False),
               4, 3)
        yield (f"decode sparse paged int64 D{D}", td._split_kernel,
               {**base, "SPARSE": True, "HAS_V": True, "WRITE_SCORES": False, "DIRECT": False, "PAGED": True,
                "PAGE": 16, "HAS_CNT": True, "MAXB": 8, "BLOCK_N": td._default_config(D, "sparse")[0]}, 4, 3)
        T = 32
        for kind, has_v in (("dense", True), ("lse", False)):
            c = tp._launch(kind, D)
            BQ, Mr = tp._rows(G, c.block_m)
            yield (f"prefill {kind} D{D}", tp._dense_kernel,
                   dict(G=G, D=D, BQ=BQ, M=Mr, BLOCK_N=c.block_n, HAS_V=has_v, WRITE_LSE=True, F32=False, RNE=False),
                   c.num_warps, c.num_stages)
        for q8 in ("fp8", "int8"):  # FP8 / INT8 scoring's passes: e4m3 / int8 Q and K (their names say which)
            c = tp._launch("lse", D)
            BQ, Mr = tp._rows(G, c.block_m)
            yield (f"prefill lse {q8} D{D}", tp._dense_kernel,
                   dict(G=G, D=D, BQ=BQ, M=Mr, BLOCK_N=c.block_n, HAS_V=False, WRITE_LSE=True, F32=False, RNE=False,
                        FP8=True, FP8_MMA=True), c.num_warps, c.num_stages)
            M, NSUB, MR = tp._score_rows(G, T)
            c = tp._launch("score", D)
            yield (f"prefill score {q8} D{D}", tp._score_kernel,
                   dict(HQ=8 * G, G=G, T=T, D=D, M=M, NSUB=NSUB, MR=MR, BLOCK_N=c.block_n, F32=False,
                        NHIST=topk.NHIST, ZERO_HIST=True, POLY=c.fma_exp, FP8=True, FP8_MMA=True),
                   c.num_warps, c.num_stages)
        block_r = max(1, min(64, 4096 // D))
        yield f"quantize fp8 D{D}", tf._quantize_kernel, dict(D=D, DP=D, BLOCK_R=block_r), 4, 3
        yield f"quantize int8 D{D}", ti._quantize_kernel, dict(D=D, DP=D, BLOCK_R=block_r), 4, 3
        # G = 6: two blocks, 128 + 64 rows, with the first reloaded; each D also with the fma_exp (8 or 0) that is not
        # its default (the sweep's)
        fma = tp._launch("score", D).fma_exp
        for Gs, poly in ((G, fma), (G, 8 - fma), *(((6, fma),) if D == 128 else ())):
            M, NSUB, MR = tp._score_rows(Gs, T)
            c = tp._launch("score_reloaded" if NSUB > 1 else "score", D)
            yield (f"prefill score D{D}" + (f" G{Gs}" if Gs != G else "") + (f" fma{poly}" if poly else ""),
                   tp._score_kernel, dict(HQ=8 * Gs, G=Gs, T=T, D=D, M=M, NSUB=NSUB, MR=MR, BLOCK_N=c.block_n,
                                          F32=False, NHIST=topk.NHIST, ZERO_HIST=True, POLY=poly),
                   c.num_warps, c.num_stages)
        M, NRB = tp._tile_rows(G, T)
        c = tp._launch("sparse", D)  # maxnreg: the launch's register bound, if any
        yield (f"prefill sparse D{D}", tp._sparse_kernel,
               dict(G=G, T=T, TP=32, D=D, M=M, NRB=NRB, BLOCK_N=c.block_n, MAXB=256, F32=False, RNE=False,
                    HAS_CNT=True, PREFETCH=c.prefetch), c.num_warps, c.num_stages,
               *([{"maxnreg": c.maxnreg}] if c.maxnreg else []))
    ch = topk.TOPK_LAUNCH["decode"].keys_per_program  # (prefill's the same: the radix and write passes serve both)
    yield "topk pool", topk._pool_kernel, dict(H=8, G=4, GP=4, S_PAD=64, CH=ch, NHIST=topk.NHIST, HIST=True), 4, 3
    yield ("topk hist", topk._hist_kernel,
           dict(CH=topk.TOPK_LAUNCH["prefill"].keys_per_program, NHIST=topk.NHIST), 4, 3)
    for level in (2, 3, 5):
        yield f"topk radix L{level}", topk._radix_kernel, dict(H=8, CH=ch, NHIST=topk.NHIST, LEVEL=level), 4, 3
    yield "topk write", topk._write_kernel, dict(H=8, CH=ch, C_PAD=64, PAGED=False), 4, 3
    yield "topk write rank", topk._write_kernel, dict(H=8, CH=ch, C_PAD=64, PAGED=False, RANK=True), 4, 3
    # the decode step's geometry and metadata; a scalar argument equal to 1 arrives as a constant (a query at slot 1,
    # a mask of one slot, k_min = 1), which has no tensor methods
    for has_q, ones in ((True, {}), (False, {}), (False, {"q_given": 1, "W": 1})):
        yield (f"step mask{' q' if has_q else ''}{' ones' if ones else ''}", ts._mask_kernel,
               dict(HAS_Q=has_q, B=2, BLOCK=16 if ones else 1024, **ones), 4, 3)
    for has_start, ones in ((True, {}), (False, {"k_min": 1})):
        yield (f"step meta{' start' if has_start else ''}{' ones' if ones else ''}", ts._meta_kernel,
               dict(HAS_START=has_start, B=3, BP=4, **ones), 4, 3)
    for rows, ones in ((False, {}), (True, {}), (True, {"k_min": 1})):
        yield (f"step counts{' rows' if rows else ''}{' ones' if ones else ''}", ts._counts_kernel,
               dict(ROWS=rows, B=3, BP=4, **ones), 4, 3)


def signature(fn, consts: dict, name: str) -> tuple[dict, dict]:
    """The kernel's signature and the specialisation a launch on the GPU gives it: pointers and strides (and the
    other arguments that are multiples of 16 in the launchers' calls) marked divisible by 16, so that the code
    (vector widths, registers) is the GPU's."""
    sig = {}
    for a in fn.arg_names:
        if a in consts:
            sig[a] = "constexpr"
        elif a in SCALARS:
            sig[a] = SCALARS[a]
        elif a[0].isupper():
            sig[a] = POINTERS.get(a, F32)
        else:
            sig[a] = "i32"
    if "fp8" in name and "quantize" not in name:
        sig["Q"] = sig["K"] = FP8
    if "int8" in name:
        sig.update({"Q": I8, "K": I8} if "quantize" not in name else {"X8": I8})
    if name.startswith("step"):  # the mask's int64 (generate's), the slot and kv_start int64, the metadata int32
        sig.update({a: t for a, t in (("M", I64), ("Qp", I64), ("Start", I64), ("Ratio", "*fp64"),
                                      ("Factor", "*fp64"), ("Out", I64 if "mask" in name else I32)) if a in sig})
    if name.startswith("topk write"):  # the selection's indices (int32, the Triton steps'), a ranking's int64 keys
        sig["Out"] = I64 if "rank" in name else I32
    if "Idx" in sig:  # the index dtypes the launchers pass: int32 (the Triton steps') and int64
        sig["Idx"] = I64 if ("int64" in name or name.startswith("prefill")) else I32
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
             if sig[a].startswith("*") or a.startswith("stride_") or a in DIVISIBLE}
    return sig, attrs


def resources(cubin: bytes) -> str:
    """Registers, stack (spills) and shared memory of a compiled kernel, from the cuobjdump that Triton carries."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    return next((line.strip() for line in out.splitlines() if "REG:" in line), out.strip()[-200:])


def serialised(ptx: str) -> bool:
    """Whether ptxas serialises the kernel's wgmma instructions (its info C7515: each waited for before the next is
    issued, the tensor cores' pipelining lost: the prefill sparse kernel, under Triton 3.6, with its own-tile block
    after the loop -- a third of its speed). Asked of the ptxas that Triton carries, verbose."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        res = subprocess.run([tool, "-arch=sm_90a", "-v", src, "-o", os.path.join(d, "k.cubin")], capture_output=True,
                             text=True)
    return "C7515" in res.stdout + res.stderr


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("only", nargs="*", help="compile only the variants whose name contains one of these")
    ap.add_argument("--resources", action="store_true",
                    help="also report registers and spills (cuobjdump); with the GPU machine's Triton on the path "
                         "(pip install triton==3.6.0 --target DIR; PYTHONPATH=DIR:src) they are the GPU's")
    args = ap.parse_args()
    for name, fn, consts, nw, ns, *extra in variants():  # extra: further compile options of the launch
        if args.only and not any(o in name for o in args.only):
            continue
        # constexprs a launch leaves at their defaults (the FP8 switches) are constexprs here too
        consts = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.name not in consts
                     and p.default is not inspect.Parameter.empty}, **consts}
        sig, attrs = signature(fn, consts, name)
        row = {"kernel": name}
        try:
            k = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=TARGET,
                               options={"num_warps": nw, "num_stages": ns, **(extra[0] if extra else {})})
            row.update(ok=True, shared=k.metadata.shared, num_warps=nw, num_stages=ns,
                       serialised=serialised(k.asm["ptx"]))
            if args.resources:
                row["resources"] = resources(k.asm["cubin"])
        except Exception as e:  # noqa: BLE001 - reported, the test fails on it
            row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:2000]}")
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
