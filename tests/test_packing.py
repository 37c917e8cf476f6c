"""The skinny weight layout (qgemm.packing), checked against a lane-by-lane model of the fragment
math the skinny and wgmma_rs kernels implement (cuda_src/common/skinny_f16.cuh, wgmma_rs_f16.cuh):
a wrong index in the packing fails here, without a GPU. The model is Python written from the
kernels' comments, not their code: the CUDA itself is checked on the GPU (tests/test_gpu_kernels.py)."""

import numpy as np
import pytest

import qgemm
from qgemm import formats as F
from qgemm import packing
from qgemm import reference as R


def _blocks(fmt, n, k, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k), dtype=np.float32)
    return F.quantize(w, F.get_format(fmt))


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
@pytest.mark.parametrize("n,k", [(1, 32), (16, 128), (33, 160), (47, 4128)])
def test_pack_roundtrip_and_size(fmt, n, k):
    b = _blocks(fmt, n, k, seed=n + k)
    buf = packing.pack(b, fmt)
    assert buf.dtype == np.uint8 and buf.size == packing.packed_nbytes(fmt, n, k)
    back = packing.unpack(buf, fmt, n, k)
    assert back.tobytes() == b.tobytes()


def test_pack_padding_dequantizes_to_zero():
    b = _blocks("q4_0", 3, 32)
    buf = packing.pack(b, "q4_0")
    n16, nb4 = packing.padded(3, 32)
    full = packing.unpack(buf, "q4_0", n16, nb4 * 32)
    deq = F.dequantize(full, F.Q4_0)
    assert np.all(deq[3:] == 0) and np.all(deq[:, 32:] == 0)
    np.testing.assert_array_equal(deq[:3, :32], F.dequantize(b, F.Q4_0))


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError, match="q4_0 or q8_0"):
        packing.pack(np.zeros((2, 32), np.float32), "f32")
    with pytest.raises(ValueError, match="2-D"):
        packing.pack(_blocks("q4_0", 2, 64).reshape(-1), "q4_0")
    with pytest.raises(ValueError, match="packs to"):
        packing.unpack(np.zeros(10, np.uint8), "q4_0", 16, 128)


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
def test_unpack_refuses_a_shape_that_would_drop_data(fmt):
    """The packed size of 20x96 is also that of 17..32 rows and K up to 128: unpack once returned
    (20, 2) or (17, 3) blocks of a 20x96 buffer, dropping real data. What it drops must be pack's
    padding, so the true shape and the full padded one pass and the others are refused."""
    b = _blocks(fmt, 20, 96)
    buf = packing.pack(b, fmt)
    assert packing.unpack(buf, fmt, 20, 96).tobytes() == b.tobytes()
    assert packing.unpack(buf, fmt, 32, 128)[:20, :3].tobytes() == b.tobytes()
    for n, k in ((20, 64), (17, 96), (19, 32)):
        with pytest.raises(ValueError, match=f"data past a {n}x{k} {fmt} matrix.*packed for another shape"):
            packing.unpack(buf, fmt, n, k)


# --- emulation of the kernel: what each lane loads, the fragments it builds, what the MMA sums ---


def _byte_perm(x, y, s):
    src = [(x >> (8 * i)) & 0xFF for i in range(4)] + [(y >> (8 * i)) & 0xFF for i in range(4)]
    return sum(src[(s >> (4 * i)) & 7] << (8 * i) for i in range(4))


def _h2(u):  # 32-bit word -> (lo, hi) halves as float64
    return np.array([u & 0xFFFF, u >> 16], dtype=np.uint16).view(np.float16).astype(np.float64)


def _affine(v, bias, d):  # (h - bias) exact, times d rounded once to fp16 (HADD2, HMUL2)
    h = _h2(v)
    return ((h - bias).astype(np.float16) * np.float16(d)).astype(np.float16).astype(np.float64)


def _affine16(v, d):  # HFMA2(h, 1/16, -72): exact q - 8 from 1024 + 16 q, then HMUL2 by d
    h = _h2(v)
    return ((h / 16 - 72).astype(np.float16) * np.float16(d)).astype(np.float16).astype(np.float64)


def _and_or(x, mask, bits):  # LOP3 0xEA
    return (x & mask) | bits


def _xor_under(x, mask, bits):  # LOP3 0x6A: mask ? x ^ bits : bits
    return ((x ^ bits) & mask) | (bits & ~mask & 0xFFFFFFFF)


def _frags(fmt, q, dq, j):
    """SkQ4_0 / SkQ8_0::frags: -> a[s][reg] = 2 values each (the pair of that A register). The
    pairs are bytes (0, 2) and (1, 3) of a word, put under fp16's exponent of 1024 by one LOP3."""
    a = [[None] * 4 for _ in range(2)]
    for h in range(2):
        dw = dq[2 * h + j // 2]
        d = np.array([(dw >> 16) if j & 1 else (dw & 0xFFFF)], np.uint16).view(np.float16)[0]
        if fmt == "q4_0":
            w = q[h][j]
            a[0][h] = _affine(_and_or(w, 0x000F000F, 0x64006400), 1032.0, d)
            a[0][2 + h] = _affine(_and_or(w >> 8, 0x000F000F, 0x64006400), 1032.0, d)
            a[1][h] = _affine16(_and_or(w, 0x00F000F0, 0x64006400), d)
            a[1][2 + h] = _affine16(_and_or(w >> 8, 0x00F000F0, 0x64006400), d)
        else:
            piece = q[2 * h + j // 2]
            for s in range(2):
                w = piece[2 * (j & 1) + s]
                a[s][h] = _affine(_xor_under(w, 0x00FF00FF, 0x64806480), 1152.0, d)
                a[s][2 + h] = _affine(_xor_under(w >> 8, 0x00FF00FF, 0x64806480), 1152.0, d)
    return a


def emulate_skinny(fmt, x, blocks):
    m, k = x.shape
    n = blocks.shape[0]
    nb = k // 32
    buf = packing.pack(blocks, fmt)
    pieces = 2 if fmt == "q4_0" else 4
    n16, nb4 = packing.padded(n, k)
    ntiles, ngroups = n16 // 16, nb4 // 4
    words = buf[: n16 * nb4 * (16 if fmt == "q4_0" else 32)].view("<u4").reshape(ntiles, ngroups, pieces, 32, 4)
    dwords = buf[n16 * nb4 * (16 if fmt == "q4_0" else 32):].view("<u4").reshape(ntiles, ngroups, 8, 4)
    xh = x.astype(np.float16).astype(np.float64)
    mt = -(-m // 8)
    c = np.zeros((m, n))
    for T in range(ntiles):
        for G in range(ngroups):
            # the 16 x 16 A and 16 x 8 B matrices of each k-step, rebuilt from the lanes' registers
            for j in range(4):
                b = 4 * G + j
                A = np.zeros((2, 16, 16))
                B = np.zeros((mt, 2, 16, 8))
                for lane in range(32):
                    g, t = lane // 4, lane % 4
                    q = [[int(v) for v in words[T, G, p, lane]] for p in range(pieces)]
                    dq = [int(v) for v in dwords[T, G, g]]
                    a = _frags(fmt, q, dq, j)
                    for s in range(2):  # PTX m16n8k16 A layout: reg0 (g, 2t..), reg1 (g+8, 2t..), reg2 (g, 2t+8..), reg3
                        A[s, g, 2 * t:2 * t + 2] = a[s][0]
                        A[s, g + 8, 2 * t:2 * t + 2] = a[s][1]
                        A[s, g, 2 * t + 8:2 * t + 10] = a[s][2]
                        A[s, g + 8, 2 * t + 8:2 * t + 10] = a[s][3]
                    for nt in range(mt):
                        row = min(nt * 8 + g, m - 1)
                        for s in range(2):
                            xs = xh[row, 32 * b + 16 * s + 4 * t: 32 * b + 16 * s + 4 * t + 4] if b < nb else np.zeros(4)
                            B[nt, s, 2 * t:2 * t + 2, g] = xs[0::2]  # b0 = (x, z), b1 = (y, w)
                            B[nt, s, 2 * t + 8:2 * t + 10, g] = xs[1::2]
                for nt in range(mt):
                    prod = A[0] @ B[nt, 0] + A[1] @ B[nt, 1]  # [16 rows, 8 tokens]
                    for r in range(16):
                        for tok in range(8):
                            mm, nn = nt * 8 + tok, T * 16 + r
                            if mm < m and nn < n:
                                c[mm, nn] += prod[r, tok]
    return c


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
@pytest.mark.parametrize("m,n,k", [(1, 16, 128), (3, 33, 160), (9, 17, 96)])
def test_emulated_skinny_matches_reference(fmt, m, n, k):
    rng = np.random.default_rng(m * 100 + n + k)
    x = rng.standard_normal((m, k), dtype=np.float32)
    w = _blocks(fmt, n, k, seed=k)
    got = emulate_skinny(fmt, x, w)
    exact = (R.exact_w4a16s if fmt == "q4_0" else R.exact_w8a16s)(x, w)
    np.testing.assert_allclose(got, exact, rtol=1e-9, atol=1e-9)


def test_skinny_kernels_registered():
    for name, fmt in (("w4a16.skinny", "q4_0"), ("w8a16.skinny", "q8_0")):
        spec = qgemm.registry.spec(name)
        assert spec.weight_layout == "skinny" and spec.op.w.name == fmt and spec.max_m == 64 and spec.min_arch == 80
        for m in (1, 8, 33, 64):
            d = spec.config(m, 4096, 4096, 132)
            assert d["SK_MT"] == -(-m // 8)
            assert d in spec.candidates(m, 4096, 4096)


def emulate_wgmma_rs(fmt, x, blocks):
    """common/wgmma_rs_f16.cuh without a GPU: lane (g, t) of the warp owning 16-row tile T reads
    its own pieces, dequantizes with SkQ*::frags and hands wgmma the fragment as its register A
    operand; the tensor core pairs A's k position p with the activations' shared-memory position p,
    and the activations arrive in the kperm16 layout (qgemm.packing.kperm16, from convert.f16k).
    Returns the product and the weights as the tensor core sees them (storage k order)."""
    m, k = x.shape
    n = blocks.shape[0]
    buf = packing.pack(blocks, fmt)
    pieces = 2 if fmt == "q4_0" else 4
    n16, nb4 = packing.padded(n, k)
    ntiles, ngroups = n16 // 16, nb4 // 4
    qbytes = n16 * nb4 * (16 if fmt == "q4_0" else 32)
    words = buf[:qbytes].view("<u4").reshape(ntiles, ngroups, pieces, 32, 4)
    dwords = buf[qbytes:].view("<u4").reshape(ntiles, ngroups, 8, 4)
    xs = np.zeros((m, nb4 * 32))  # the activation tile in shared memory (zero past K)
    xs[:, :k] = packing.kperm16(x.astype(np.float16)).astype(np.float64)
    w_st = np.zeros((n16, nb4 * 32))
    for T in range(ntiles):
        for G in range(ngroups):
            for lane in range(32):
                g, t = lane // 4, lane % 4
                own = [[int(v) for v in words[T, G, p, lane]] for p in range(pieces)]
                dq = [int(v) for v in dwords[T, G, g]]
                for j in range(4):
                    a = _frags(fmt, own, dq, j)
                    for s in range(2):  # wgmma's register A layout = mma.m16n8k16's
                        k0 = 128 * G + 32 * j + 16 * s
                        w_st[16 * T + g, k0 + 2 * t:k0 + 2 * t + 2] = a[s][0]
                        w_st[16 * T + g + 8, k0 + 2 * t:k0 + 2 * t + 2] = a[s][1]
                        w_st[16 * T + g, k0 + 2 * t + 8:k0 + 2 * t + 10] = a[s][2]
                        w_st[16 * T + g + 8, k0 + 2 * t + 8:k0 + 2 * t + 10] = a[s][3]
    return (xs @ w_st.T)[:, :n], w_st[:n, :k]


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
@pytest.mark.parametrize("m,n,k", [(1, 16, 128), (5, 33, 160), (2, 17, 96)])
def test_emulated_wgmma_rs_matches_reference(fmt, m, n, k):
    rng = np.random.default_rng(m * 1000 + n + k)
    x = rng.standard_normal((m, k), dtype=np.float32)
    w = _blocks(fmt, n, k, seed=k + 1)
    got, w_st = emulate_wgmma_rs(fmt, x, w)
    # each lane's own word lands exactly where kperm16 puts the activations of the same k,
    # dequantized exactly as d (q - 8) rounded once to fp16
    np.testing.assert_array_equal(packing.unkperm16(w_st), R.dequantize_to_f16(w, fmt).astype(np.float64))
    exact = (R.exact_w4a16h if fmt == "q4_0" else R.exact_w8a16h)(x.astype(np.float16), w)
    np.testing.assert_allclose(got, exact, rtol=1e-9, atol=1e-9)


def test_kperm16_layout():
    """kperm16: inside every 16 the even k, then the odd ones; unkperm16 inverts it, and a product
    is unchanged when both operands are permuted alike."""
    a = np.arange(2 * 48).reshape(2, 48)
    p = packing.kperm16(a)
    np.testing.assert_array_equal(p[0, :16], [0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15])
    np.testing.assert_array_equal(p[1, 32:], 80 + np.r_[0:16:2, 1:16:2])
    np.testing.assert_array_equal(packing.unkperm16(p), a)
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((3, 64)), rng.standard_normal((5, 64))
    np.testing.assert_allclose(packing.kperm16(x) @ packing.kperm16(w).T, x @ w.T, rtol=1e-12)
    for bad in (np.zeros(24), np.zeros((2, 8)), np.float32(1.0)):
        with pytest.raises(ValueError, match="multiple of 16"):
            packing.kperm16(bad)
        with pytest.raises(ValueError, match="multiple of 16"):
            packing.unkperm16(bad)


def test_kperm16_prologues_registered():
    """convert.f16k / convert.f16k_f16 write the layout (their CPU references), need K % 16 == 0,
    and the wgmma_rs kernels declare it, so check.validate and Kernel.__call__ permute for them."""
    x = np.random.default_rng(0).standard_normal((3, 32)).astype(np.float32)
    for name, xin in (("convert.f16k", x), ("convert.f16k_f16", x.astype(np.float16))):
        op = qgemm.registry.spec(name).op
        got = op.cpu(xin)
        assert got.dtype == np.float16 and got.shape == x.shape
        np.testing.assert_array_equal(got, packing.kperm16(x.astype(np.float16)))
        np.testing.assert_array_equal(op.out_natural(got), x.astype(np.float16))
        assert op.k_multiple == 16
        g = qgemm.registry.spec(name).geometry(7, 0, 4128)  # 8 values per thread: every value covered
        assert g.grid[0] * g.block[0] * 8 >= 7 * 4128 > (g.grid[0] - 1) * g.block[0] * 8
    for name in ("w4a16.wgmma_rs", "w8a16.wgmma_rs"):
        assert qgemm.registry.spec(name).act_layout == "kperm16"
        assert qgemm.get(name).act_layout == "kperm16"
    assert qgemm.get("w4a16.wgmma").act_layout is None


def _pack_kernel_model(b, fmt):
    """cuda_src/pack/skinny.cu as its comments describe it: a CTA per tile of 16 rows x 16 groups of
    4 blocks, a thread per (row, group) putting its 64 / 128 bytes of quants (lanes t = 0..3 of
    lane group g, piece h or (h, p)) and its 4 scales (halves 4h .. 4h + 3 of scale chunk (group,
    g)) in the CTA's staging, which goes out as one contiguous range of quants and one of scales."""
    raw = np.ascontiguousarray(b).view(np.uint8).reshape(-1)
    n, nb = b.shape
    bb, pieces = (34, 4) if fmt == "q8_0" else (18, 2)
    pad = b"\x00" * (bb - 2) if fmt == "q8_0" else b"\x88" * (bb - 2)
    tiles, groups = -(-n // 16), -(-nb // 4)
    out = bytearray(tiles * groups * (pieces * 32 + 8) * 16)
    nq = tiles * groups * pieces * 32

    def block(r, blk):
        if r < n and blk < nb:
            o = (r * nb + blk) * bb
            return raw[o:o + bb].tobytes()
        return b"\x00\x00" + pad

    for T in range(tiles):
        for G0 in range(0, groups, 16):
            for rl in range(16):
                for G in range(G0, min(G0 + 16, groups)):
                    r, g, h = 16 * T + rl, rl % 8, rl // 8
                    blks = [block(r, 4 * G + j) for j in range(4)]
                    word = lambda j, w: blks[j][2 + 4 * w:6 + 4 * w]  # noqa: E731
                    base = (T * groups + G) * pieces * 32
                    for t in range(4):
                        if fmt == "q8_0":
                            for p in range(2):
                                c = base + (2 * h + p) * 32 + g * 4 + t
                                out[16 * c:16 * c + 16] = word(2 * p, t) + word(2 * p, t + 4) + word(2 * p + 1, t) + word(2 * p + 1, t + 4)
                        else:
                            c = base + h * 32 + g * 4 + t
                            out[16 * c:16 * c + 16] = b"".join(word(j, t) for j in range(4))
                    dc = nq + (T * groups + G) * 8 + g
                    out[16 * dc + 8 * h:16 * dc + 8 * h + 8] = b"".join(blks[j][:2] for j in range(4))
    return np.frombuffer(bytes(out), np.uint8)


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
@pytest.mark.parametrize("n,k", [(1, 32), (17, 96), (33, 2080), (16, 4096)])
def test_pack_kernel_model_matches_pack(fmt, n, k):
    """The GPU repacking's mapping (as its comments state it) writes exactly packing.pack's bytes,
    and scale_offset finds each block's d in them (pack_weights reads d back from there)."""
    b = _blocks(fmt, n, k, seed=3 * n + k)
    want = packing.pack(b, fmt)
    np.testing.assert_array_equal(_pack_kernel_model(b, fmt), want)
    for row in range(n):
        for blk in range(k // 32):
            off = packing.scale_offset(fmt, n, k, row, blk)
            assert want[off:off + 2].view(np.float16)[0] == b["d"][row, blk]
    g = qgemm.registry.spec(f"pack.{fmt}").geometry(n, 0, k)  # a CTA per 16 rows x 16 groups
    cdiv = packing.cdiv
    assert g.grid == (cdiv(cdiv(k // 32, 4), 16), cdiv(n, 16), 1) and g.block == (256, 1, 1)


def test_pack_kernels_registered():
    for fmt in ("q4_0", "q8_0"):
        s = qgemm.registry.spec(f"pack.{fmt}")
        assert s.op.kind == "pack" and s.op.a.name == fmt and s.op.weights.name == fmt and s.op.w is None
        assert "skinny layout" in str(s.op) and s.op.k_multiple == 32 and not s.pdl
        np.testing.assert_array_equal(s.op.cpu(_blocks(fmt, 5, 64)), packing.pack(_blocks(fmt, 5, 64), fmt))
        k = qgemm.get(f"pack.{fmt}")
        w = _blocks(fmt, 3, 64)
        with pytest.raises(ValueError, match="takes one operand"):
            k(w, w)
        with pytest.raises(ValueError, match=f"{fmt} blocks"):
            k(np.zeros((3, 64), np.float32))
        bad = w.copy()
        bad["d"][1, 1] = np.inf
        with pytest.raises(ValueError, match="finite"):  # the host check, before any GPU is needed
            k(bad)
        with pytest.raises(ValueError, match="2\\^31 - 1 blocks"):
            k.check_launch(1, 2**21, 2**15 * 32)  # 2^36 blocks: the kernel's block index is an int
        with pytest.raises(ValueError, match="beyond what CUDA launches"):
            k.check_launch(1, 16 * 65536, 32)  # grid.y: one tile of 16 rows per CTA row
    from qgemm import bench, ops

    k = qgemm.get("pack.q8_0")
    assert bench.flops(k, 7, 4096, 4096) == 0
    assert bench.operand_bytes(k, 7, 4096, 4096) == 4096 * 128 * 34 + packing.packed_nbytes("q8_0", 4096, 4096)
    assert ops.PACK_UNSET == 2**31 - 1


@pytest.mark.parametrize("fmt", ["q4_0", "q8_0"])
def test_repacking_plan_launches_in_order(fmt, monkeypatch):
    """A plan that repacks ggml blocks per call (sm_90, M >= REPACK_MIN_M) queues the repacking
    into the scratch copy first, then the prologue, then the GEMM reading that copy -- launched
    without programmatic dependent launch, since it reads its weights above its pdl_wait and
    here an earlier kernel of the op wrote them. Without the repacking the GEMM keeps PDL and
    reads the weights it is given. Launches stood in for (CPU)."""
    from qgemm import dispatch, registry

    calls = []
    m = max(dispatch.REPACK_MIN_M[fmt], dispatch.WGMMA_MIN_M)
    p = dispatch.plan(m, 4096, 4096, fmt, arch="sm_90")
    assert p.repack == f"pack.{fmt}" and p.packed_weights_bytes == packing.packed_nbytes(fmt, 4096, 4096)
    pk, q, kern = registry.get(p.repack), registry.get(p.quantizer), registry.get(p.kernel)
    monkeypatch.setattr(pk, "launch_pack", lambda dw, dp, n, k, status=None, stream=None, pdl=True:
                        calls.append(("pack", dw, dp, n, k, status)))
    monkeypatch.setattr(q, "launch_quantize", lambda dx, dq, m_, k, st, stream=None, zero=None: calls.append(("prologue", dx, dq)))
    monkeypatch.setattr(kern, "launch", lambda dq, dw, dc, m_, n, k, stream=None, defines=None, zeroed=False, pdl=True:
                        calls.append(("gemm", dq, dw, dc, pdl)))
    p.launch("x", "blocks", "staged", "c", "status", dpack="copy")
    assert calls == [("pack", "blocks", "copy", 4096, 4096, None), ("prologue", "x", "staged"),
                     ("gemm", "staged", "copy", "c", False)]
    calls.clear()
    pp = dispatch.plan(m, 4096, 4096, fmt, arch="sm_90", packed=True)
    assert pp.repack is None and pp.packed_weights_bytes == 0
    pp.launch("x", "packed", "staged", "c", "status")
    assert calls == [("prologue", "x", "staged"), ("gemm", "staged", "packed", "c", True)]


def test_kernel_given_device_blocks_launches_after_its_repacking(monkeypatch):
    """A skinny kernel called alone with ggml blocks on the device repacks them on the GPU, then
    runs without programmatic dependent launch (it reads its weights above its pdl_wait, and the
    repacking just wrote them); with PackedWeights it keeps PDL. Device calls stood in for (CPU)."""
    from qgemm import ops, registry, runtime

    calls = []
    k = qgemm.get("w4a16.skinny")
    monkeypatch.setattr(ops, "_check_device", lambda x, fmt, role, op, stream=None, who=None: x)
    monkeypatch.setattr(runtime, "prepare_call", lambda *a, **kw: None)
    monkeypatch.setattr(runtime, "launch_stream", lambda s=None: "stream")
    monkeypatch.setattr(runtime.DeviceArray, "empty", classmethod(lambda cls, shape, dtype: cls(0x9000, shape, dtype)))
    monkeypatch.setattr(k, "_module", lambda defines=None: None)
    monkeypatch.setattr(registry.get("pack.q4_0"), "launch_pack",
                        lambda dw, dp, n, kk, status=None, stream=None, pdl=True: calls.append(("pack", dw.ptr, dp.ptr)))
    monkeypatch.setattr(k, "launch", lambda da, dw, dc, m, n, kk, stream=None, defines=None, zeroed=False, pdl=True:
                        calls.append(("gemm", dw.ptr, pdl)))
    x = qgemm.DeviceArray(0x1000, (5, 256), np.float32)
    w = qgemm.DeviceArray(0x2000, (70, 8), qgemm.block_q4_0)
    k(x, w)
    assert calls == [("pack", 0x2000, 0x9000), ("gemm", 0x9000, False)]
    calls.clear()
    pw = packing.PackedWeights("q4_0", 70, 256, qgemm.DeviceArray(0x3000, (packing.packed_nbytes("q4_0", 70, 256),), np.uint8), w)
    k(x, pw)
    assert calls == [("gemm", 0x3000, True)]


def test_pack_launch_refuses_misaligned_buffers():
    """The kernel reads 16-bit scales and stores 16 bytes at a time: a misaligned buffer would
    fault and poison the CUDA context, so launch_pack refuses it first (no GPU needed)."""
    k = qgemm.get("pack.q8_0")
    n, kk = 33, 128
    out = qgemm.DeviceArray(0x10000, (packing.packed_nbytes("q8_0", n, kk),), np.uint8)
    with pytest.raises(ValueError, match="2-byte boundary.*0x20001"):
        k.launch_pack(qgemm.DeviceArray(0x20001, (n, kk // 32), qgemm.block_q8_0), out, n, kk)
    for off in (2, 8):
        bad = qgemm.DeviceArray(0x10000 + off, out.shape, np.uint8)
        with pytest.raises(ValueError, match="16-byte boundary"):
            k.launch_pack(qgemm.DeviceArray(0x20002, (n, kk // 32), qgemm.block_q8_0), bad, n, kk)


def test_repacking_only_where_one_launch_can_do_it():
    """Past one pack.* launch's grid (65535 rows of CTAs of 16 weight rows), matmul keeps the
    kernels that read ggml blocks; a path= that needs the packed layout says why, before any launch."""
    from qgemm import dispatch

    big = 16 * 65535 + 16
    assert dispatch.plan(512, 16 * 65535, 4096, "q4_0", arch="sm_90").repack == "pack.q4_0"
    p = dispatch.plan(512, big, 4096, "q4_0", arch="sm_90")
    assert p.repack is None and p.kernel == "w4a16.mma"
    p = dispatch.plan(512, big, 4096, "q4_0", arch="sm_90", path="w4a16.wgmma_rs")
    assert p.repack == "pack.q4_0"
    with pytest.raises(ValueError, match="beyond what CUDA launches"):
        p.check_launch()


def test_weight_quantizers_registered_with_ggml_bytes_as_their_reference(rng):
    """quantize.q4_0 / quantize.q8_0 and their float16 / bfloat16 forms: step 2 quantizers of the
    right formats, a thread per block of 32 (the launch covers every block, any M x K), and as CPU
    reference ggml's quantizer of the values widened to float32 (what the GPU test compares byte
    for byte)."""
    x = rng.standard_normal((5, 96), dtype=np.float32) * 3
    for fmt in ("q4_0", "q8_0"):
        for suffix, a in (("", x), ("_f16", x.astype(np.float16)), ("_bf16", F.f32_to_bf16(x))):
            spec = qgemm.spec(f"quantize.{fmt}{suffix}")
            assert (spec.step, spec.op.kind, spec.op.out.name, spec.source) == (2, "quantize", fmt, f"quantize/{fmt}.cu")
            assert spec.entry == f"quantize_{fmt}{suffix}" and spec.min_arch == 75 and not spec.pdl
            assert spec.op.cpu(a).tobytes() == F.quantize(F.to_float32(a), fmt).tobytes()
            for m, k, ctas in ((5, 96, 1), (1, 8192, 1), (3, 32 * 257, 4), (4096, 14336, 7168)):
                assert spec.geometry(m, 0, k).grid == (ctas, 1, 1) and spec.geometry(m, 0, k).block == (256, 1, 1)
    assert np.array_equal(ops_cpu := qgemm.spec("quantize.q4_0_bf16").op.cpu(F.f32_to_bf16(x)),
                          F.quantize_q4_0(F.bf16_to_f32(F.f32_to_bf16(x)))) and ops_cpu.shape == (5, 3)


def test_float_weights_to_pack_weights_checked_before_any_gpu():
    """pack_weights quantizes float weights on the GPU; what it cannot quantize is said first, on
    any machine: no format, a format that is not a weight format, K not a multiple of 32, not 2-D,
    values that are not finite or do not fit in float32. The numpy quantizers given a device
    array name the GPU kernel that writes the same bytes."""
    ok = np.ones((4, 64), np.float32)
    for w, fmt, msg in ((ok, None, r"float weights \(float32 \(4, 64\)\) need fmt='q4_0' or 'q8_0'"),
                        (ok, "q8_1", "float weights are quantized to q4_0 or q8_0, got fmt='q8_1'"),
                        (np.ones((4, 60), np.float32), "q4_0", r"float weights must be 2-D \[N, K\] .* got float32 \(4, 60\)"),
                        (np.ones(64, np.float32), "q4_0", r"float weights must be 2-D \[N, K\] .* got float32 \(64,\)"),
                        (np.ones((0, 64), np.float32), "q4_0", r"float weights must be 2-D .*N >= 1 .* got float32 \(0, 64\)"),
                        (np.full((4, 64), np.nan, np.float32), "q4_0", "input must be finite; found nan at index"),
                        (np.full((4, 64), 1e39), "Q8_0", "input 1e\\+39 does not fit in float32"),
                        (np.full((4, 64), np.inf, np.float16), "q4_0", "float weights must be finite"),
                        (F.f32_to_bf16(np.full((4, 64), np.nan, np.float32)), "q8_0", "float weights must be finite")):
        with pytest.raises(ValueError, match="^pack_weights: " + msg):
            qgemm.pack_weights(w, fmt)

    class OnDevice:
        __cuda_array_interface__ = {}  # only looked at, never read
        dtype = np.dtype(np.float16)

    with pytest.raises(ValueError, match=r"^quantize_q4_0: this is the CPU \(numpy\) quantizer and got a device array; "
                                         r"on the GPU, qgemm.get\('quantize.q4_0_f16'\)\(x\) writes the same bytes "
                                         r"\(qgemm.pack_weights\(x, fmt\) quantizes float weights for matmul\)$"):
        qgemm.quantize_q4_0(OnDevice())
    OnDevice.dtype = F.BF16_DTYPE
    with pytest.raises(ValueError, match=r"qgemm.get\('quantize.q8_0_bf16'\)"):
        qgemm.quantize(OnDevice(), "q8_0")
    OnDevice.dtype = np.dtype(np.float32)
    with pytest.raises(ValueError, match=r"^quantize_q8_1: .* qgemm.get\('quantize.q8_1'\)\(x\) writes the same bytes$"):
        qgemm.quantize_q8_1(OnDevice())
    if not qgemm.gpu_available():
        with pytest.raises(qgemm.NoGPUError, match="qgemm.pack_weights needs an NVIDIA GPU"):
            qgemm.pack_weights(ok, "q4_0")


def test_misaligned_device_arrays_refused_before_any_launch():
    """A device array not on its elements' boundary (only a hand-made DeviceArray can be: torch
    and CuPy views keep it) would fault in the kernel, and a fault ends the CUDA context: a kernel
    call refuses it first, naming the boundary, for its operands and its out=."""
    from qgemm import runtime

    assert [runtime.element_alignment(t) for t in (np.float32, np.float16, F.BF16_DTYPE, F.block_q4_0, F.block_q8_0,
                                                   F.block_q8_1, np.uint8)] == [4, 2, 2, 2, 2, 4, 1]
    x = runtime.DeviceArray(0x1002, (4, 64), np.float32)
    with pytest.raises(ValueError, match=r"^quantize.q4_0: X must start on a 4-byte boundary \(float32 elements\), "
                                         r"got address 0x1002$"):
        qgemm.get("quantize.q4_0")(x)
    with pytest.raises(ValueError, match=r"^quantize.q8_0_f16: X must start on a 2-byte boundary \(float16 elements\)"):
        qgemm.get("quantize.q8_0_f16")(runtime.DeviceArray(0x1001, (4, 64), np.float16))
    with pytest.raises(ValueError, match=r"^w4a8.naive: A must start on a 4-byte boundary \(a 36-byte structured type"):
        qgemm.get("w4a8.naive")(runtime.DeviceArray(0x1002, (4, 2), F.block_q8_1), runtime.DeviceArray(0x2000, (8, 2), F.block_q4_0))
    runtime.check_alignment(runtime.DeviceArray(0x1004, (4, 64), np.float32), "t", "x")  # aligned: nothing said
    # another input type: the quantizer's form that takes it is named
    for name, dt, hint in (("quantize.q4_0", np.float16, "quantize.q4_0_f16 takes float16"),
                           ("quantize.q8_0_f16", F.BF16_DTYPE, "quantize.q8_0_bf16 takes bfloat16"),
                           ("quantize.q4_0_bf16", np.float32, "quantize.q4_0 takes float32"),
                           ("convert.f16", F.BF16_DTYPE, "convert.f16_bf16 takes bfloat16")):
        with pytest.raises(ValueError, match=f"^{name}: X must be .* on the device, got device array .*; {hint}$"):
            qgemm.get(name)(runtime.DeviceArray(0x1000, (4, 64), dt))
    with pytest.raises(ValueError, match=r"^quantize.q8_1: X must be float32 \[rows, K\] on the device, got device array int32 \(4, 64\)$"):
        qgemm.get("quantize.q8_1")(runtime.DeviceArray(0x1000, (4, 64), np.int32))  # no form takes int32
