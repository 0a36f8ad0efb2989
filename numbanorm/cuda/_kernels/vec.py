"""16-byte loads and stores of a row: ``load_pair(row, q)`` -> ``(row[2q], row[2q + 1])``
and ``store_pair(row, q, lo, hi)`` for a 1-D uint64 row whose word ``2q`` starts on a
16-byte boundary.

numba-cuda loads at most one element per instruction, 8 bytes from a uint64 array
(``LDG.E.64`` on sm_90); a bandwidth-bound row kernel wants 16 (``LDG.E.128``:
half the load and store instructions, twice the bytes per request in flight).
These intrinsics emit one ``<2 x i64>`` load/store with align 16 through the
array's own data pointer, which NVVM keeps in the global address space as it
does for ordinary element loads.  The caller guarantees the alignment
(``common.vec_width`` checks the arrays' addresses and row length on the host);
no bounds check, like numba's own indexing.  The simulator cannot run an LLVM
intrinsic: there the names are ``numbanorm.cuda._simvec``'s Python versions of
the same operations (which raise on a misaligned or out-of-range access).

``pack_bf16x2(lo, hi)``: two float32 rounded to bfloat16 (nearest, ties to even)
in one uint32, ``lo`` in the low half -- one ``cvt.rn.bf16x2.f32`` (``F2FP.BF16``)
for two elements, where the integer rounding of ``common.store_fn`` takes about
five instructions for each.  ``pack_f16x2(lo, hi)``: two float32 rounded to float16
in one uint32, ``lo`` in the low half -- two ``cvt.rn.f16.f32`` joined by ``mov.b32``
(any compute capability), which ptxas makes one ``F2FP.F16.F32.PACK_AB`` (sm_90),
where narrowing into a float16 view of the word made the same F2FP and then moved the
halves apart and back (``PRMT``, ``LOP3``: about 3 more a pair).  ``unpack_f16x2(u)``:
the two float16 of a uint32 (low half first) as float32, exactly -- one ``HADD2.F32``
each, where widening the elements of a view of the word shifts the high half down
first.  ``min_s16x2(a, b)``: the halves' minima as signed 16-bit integers
(``min.s16x2``, sm_90: one instruction), which turns ``cvt``'s NaN 0x7FFF into 0x7FC0
and leaves every other bfloat16 alone.
"""

from .reduce import SIMULATED


def _intrinsics():
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    pair = types.UniTuple(types.uint64, 2)
    vec_t = ir.VectorType(ir.IntType(64), 2)

    def _check(row, q):
        if not (isinstance(row, types.Array) and row.ndim == 1 and row.dtype == types.uint64
                and row.layout == "C" and isinstance(q, types.Integer)):
            raise TypeError(f"load_pair/store_pair take a C-contiguous 1-D uint64 array and an integer, "
                            f"not {row}, {q}")

    def _pointer(context, builder, rowty, row, qty, q):
        ary = context.make_array(rowty)(context, builder, row)
        q = context.cast(builder, q, qty, types.intp)
        first = builder.mul(q, ir.Constant(q.type, 2))        # 8-byte word 2q: the 16-byte word q
        ptr = cgutils.get_item_pointer(context, builder, rowty, ary, [first], wraparound=False)
        return builder.bitcast(ptr, vec_t.as_pointer())

    @intrinsic
    def load_pair(typingctx, row, q):
        _check(row, q)

        def codegen(context, builder, sig, args):
            v = builder.load(_pointer(context, builder, sig.args[0], args[0], sig.args[1], args[1]), align=16)
            return context.make_tuple(builder, pair, [builder.extract_element(v, ir.Constant(ir.IntType(32), k))
                                                      for k in range(2)])

        return pair(row, q), codegen

    @intrinsic
    def store_pair(typingctx, row, q, lo, hi):
        _check(row, q)

        def codegen(context, builder, sig, args):
            ptr = _pointer(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            v = ir.Constant(vec_t, ir.Undefined)
            for k, (val, ty) in enumerate(zip(args[2:], sig.args[2:])):
                val = context.cast(builder, val, ty, types.uint64)
                v = builder.insert_element(v, val, ir.Constant(ir.IntType(32), k))
            builder.store(v, ptr, align=16)
            return context.get_dummy_value()

        return types.void(row, q, lo, hi), codegen

    def _pack2(name, asm, hi_first):
        """The intrinsic ``name(lo, hi)``: two float32 in one uint32, ``lo`` in the low half,
        by the PTX ``asm`` (its $1 and $2: hi and lo where ``hi_first``, else lo and hi)."""
        def pack(typingctx, lo, hi):
            if not (lo == types.float32 and hi == types.float32):
                raise TypeError(f"{name} takes two float32, not {lo}, {hi}")

            def codegen(context, builder, sig, args):
                f32 = ir.FloatType()
                cvt = ir.InlineAsm(ir.FunctionType(ir.IntType(32), [f32, f32]), asm, "=r,f,f")
                return builder.call(cvt, [args[1], args[0]] if hi_first else list(args))

            return types.uint32(lo, hi), codegen

        pack.__name__ = pack.__qualname__ = name
        return intrinsic(pack)

    # d.hi = bf16(a), d.lo = bf16(b): round to nearest even, NaN -> 0x7FFF
    pack_bf16x2 = _pack2("pack_bf16x2", "cvt.rn.bf16x2.f32 $0, $1, $2;", hi_first=True)
    # mov.b32 packs {low, high}; ptxas makes the three one F2FP.F16.F32.PACK_AB (sm_90)
    pack_f16x2 = _pack2("pack_f16x2", "{.reg .b16 l, h; cvt.rn.f16.f32 l, $1; cvt.rn.f16.f32 h, $2; "
                                      "mov.b32 $0, {l, h};}", hi_first=False)

    @intrinsic
    def unpack_f16x2(typingctx, u):
        if u != types.uint32:
            raise TypeError(f"unpack_f16x2 takes a uint32, not {u}")

        def codegen(context, builder, sig, args):
            f32, i32 = ir.FloatType(), ir.IntType(32)
            pair = ir.LiteralStructType([f32, f32])
            cvt = ir.InlineAsm(ir.FunctionType(pair, [i32]),
                               "{.reg .b16 l, h; mov.b32 {l, h}, $2; cvt.f32.f16 $0, l; cvt.f32.f16 $1, h;}",
                               "=f,=f,r")
            out = builder.call(cvt, [args[0]])
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(out, k) for k in range(2)])

        return types.UniTuple(types.float32, 2)(u), codegen

    @intrinsic
    def min_s16x2(typingctx, a, b):
        if not (a == types.uint32 and b == types.uint32):
            raise TypeError(f"min_s16x2 takes two uint32, not {a}, {b}")

        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            vmin = ir.InlineAsm(ir.FunctionType(i32, [i32, i32]), "min.s16x2 $0, $1, $2;", "=r,r,r")
            return builder.call(vmin, list(args))

        return types.uint32(a, b), codegen

    return load_pair, store_pair, pack_bf16x2, pack_f16x2, unpack_f16x2, min_s16x2


if SIMULATED:
    from .._simvec import load_pair, min_s16x2, pack_bf16x2, pack_f16x2, store_pair, unpack_f16x2  # noqa: F401
else:
    load_pair, store_pair, pack_bf16x2, pack_f16x2, unpack_f16x2, min_s16x2 = _intrinsics()
