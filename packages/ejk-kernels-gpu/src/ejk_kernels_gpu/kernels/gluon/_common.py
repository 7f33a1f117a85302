"""Helpers the Gluon kernels share (the forward, the dk/dv and the dq kernel): barriers and
ring slots, the MUFU tanh, wgmma layouts, the TMA reduce, and the masks' rule per score
(`token_info`, `visible`), which the forward and the dk/dv kernel apply to tiles of
opposite orientation."""

from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma


@gluon.jit
def barriers(n: gl.constexpr, count: gl.constexpr):
    """``n`` mbarriers, each completing after ``count`` arrivals."""
    bars = gl.allocate_shared_memory(gl.int64, [n, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(n):
        mbarrier.init(bars.index(i), count=count)
    return bars


@gluon.jit
def ring_slot(i, STAGES: gl.constexpr):
    """(slot, phase of its ready barrier) of the i-th tile through a ring of STAGES slots."""
    return i % STAGES, (i // STAGES) & 1


@gluon.jit
def tanh(x):
    """tanh by the MUFU instruction (relative error about 2^-11; FlashAttention-3's soft cap)."""
    return gl.inline_asm_elementwise(
        "tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True, pack=1
    )


@gluon.constexpr_function
def wgmma_layout(cols):
    """The register layout of one warpgroup's wgmma accumulator with ``cols`` columns."""
    return gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, cols, 16]
    )


@gluon.constexpr_function
def operand_layout(acc_layout):
    """The layout of a 16-bit wgmma first operand held in registers, for a matmul whose
    accumulator has ``acc_layout``."""
    return gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)


@gluon.jit
def token_info(idx, length: gl.constexpr, b, tabs, F: gl.constexpr, SID_PAD: gl.constexpr,
               IDS: gl.constexpr = True):  # fmt: skip
    """What the masks read per token ``idx`` (a vector of query rows or of keys of batch row
    ``b``), loaded once: (in range, sequence id, position, segment id). ``tabs``: the
    axis's (sequence ids, positions, segment ids) pointers; ``length``: its T or S; tokens
    past it get sequence id ``SID_PAD`` and segment id -1 (they match nothing). Without a
    table ``idx`` stands in (unused by `visible`); so do segment ids without ``IDS``
    (`visible` then compares none)."""
    sid_ptr, pos_ptr, seg_ptr = tabs
    ok = idx < length
    sid = idx
    pos = idx
    seg = idx
    if F.SEQ_IDS:
        sid = gl.load(sid_ptr + idx, mask=ok, other=SID_PAD)
    if F.VARLEN:
        pos = gl.load(pos_ptr + idx, mask=ok, other=0)
    if F.HAS_SEG and IDS:
        seg = gl.load(seg_ptr + b * length + idx, mask=ok, other=-1)
    return ok, sid, pos, seg


# Which of a tile's bounds `visible` evaluates (``SIDE``): all of them; only those on the
# keys' left (a window's left edge), for a key block before one that every row sees whole;
# only those on their right (causal, a window's right edge, keys past the end), for one
# after it. Sequence and segment ids are always compared.
ALL_SIDES = gl.constexpr(0)
LEFT_SIDE = gl.constexpr(1)
RIGHT_SIDE = gl.constexpr(2)


@gluon.jit
def visible(rows, keys, ROW_AXIS: gl.constexpr, F: gl.constexpr, SIDE: gl.constexpr = ALL_SIDES,
            KEYS_IN_RANGE: gl.constexpr = False, IDS: gl.constexpr = True):  # fmt: skip
    """Which (query, key) pairs of a tile the call's masks let through: ``rows`` and ``keys``
    from `token_info`, rows along axis ``ROW_AXIS`` of the tile (0: the forward's S, 1: the
    dk/dv kernel's Sᵀ); keys past the end, another packed sequence or segment, outside
    causal or the window (on the tokens' positions) are hidden, as
    `kernels.triton._common.visibility` decides for the ordinary kernels. ``F`` names CAUSAL,
    WINDOW_LEFT (-1: none), WINDOW_RIGHT, VARLEN, SEQ_IDS and HAS_SEG. ``SIDE``: the bounds to
    evaluate (``ALL_SIDES``, ``LEFT_SIDE``, ``RIGHT_SIDE``: the others hold for the block);
    ``KEYS_IN_RANGE``: no key is past the end; ``IDS`` off: segment ids are not compared
    (the block table says they hold across the block)."""
    KEY_AXIS: gl.constexpr = 1 - ROW_AXIS
    LEFT: gl.constexpr = SIDE != RIGHT_SIDE
    RIGHT: gl.constexpr = SIDE != LEFT_SIDE
    # Each vector gains the other axis's dimension and broadcasts over it.
    ok = gl.expand_dims(keys[0], ROW_AXIS)
    pos_q = gl.expand_dims(rows[2], KEY_AXIS)
    pos_k = gl.expand_dims(keys[2], ROW_AXIS)
    vis = ok
    if KEYS_IN_RANGE or not RIGHT:
        vis = gl.full(ok.shape, True, gl.int1, ok.type.layout)
    if F.SEQ_IDS:
        vis = vis & (gl.expand_dims(rows[1], KEY_AXIS) == gl.expand_dims(keys[1], ROW_AXIS))
    if F.CAUSAL and RIGHT:
        vis = vis & (pos_k <= pos_q)
    if F.WINDOW_LEFT >= 0 and LEFT:
        vis = vis & (pos_k >= pos_q - F.WINDOW_LEFT)
    # A causal call's right window edge is at or past the diagonal: causal decides.
    if F.WINDOW_LEFT >= 0 and RIGHT and not (F.CAUSAL and F.WINDOW_RIGHT >= 0):
        vis = vis & (pos_k <= pos_q + F.WINDOW_RIGHT)
    if F.HAS_SEG and IDS:
        # Equal ids see each other; a negative id is padding (0 is an ordinary segment).
        seg_q = gl.expand_dims(rows[3], KEY_AXIS)
        vis = vis & (seg_q == gl.expand_dims(keys[3], ROW_AXIS)) & (seg_q >= 0)
    return vis


@builtin
def reduce_add(tensor_desc, coord, src, _semantic=None):
    """Add the shared-memory tile ``src`` into the global tile of ``tensor_desc`` at
    ``coord`` by a TMA reduce (``cp.reduce.async.bulk.tensor .add``), like
    `tma.async_copy_shared_to_global` (`tma.store_wait` waits for it). Triton 3.6 has the
    operation (``ttng.async_tma_reduce``) but Gluon no function for it."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(
        ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle
    )


@gluon.jit
def pair_descriptors(a_ptr, b_ptr, b, kh, S: gl.constexpr, K: gl.constexpr, H: gl.constexpr,
                     block: gl.constexpr, layout: gl.constexpr, PAIR: gl.constexpr):  # fmt: skip
    """TMA descriptors of the ``[S, H]`` slabs of batch ``b``, kv head ``kh`` in two arrays
    ``[B, S, K, H]``, or with ``PAIR`` in the two halves of each head's columns of ``a``'s
    ``[B, S, K, 2H]`` (``b_ptr`` unused): k and v read so (``KV_PAIR``: keys and values
    gathered as one array), dk and dv written so (``JOINT``: reduce-scattered as one)."""
    if PAIR:
        base = b.to(gl.int64) * S * K * 2 * H + kh * 2 * H
        a_desc = tma.make_tensor_descriptor(a_ptr + base, [S, H], [2 * K * H, 1], block, layout)
        b_desc = tma.make_tensor_descriptor(a_ptr + base + H, [S, H], [2 * K * H, 1], block, layout)
    else:
        base = b.to(gl.int64) * S * K * H + kh * H
        a_desc = tma.make_tensor_descriptor(a_ptr + base, [S, H], [K * H, 1], block, layout)
        b_desc = tma.make_tensor_descriptor(b_ptr + base, [S, H], [K * H, 1], block, layout)
    return a_desc, b_desc
