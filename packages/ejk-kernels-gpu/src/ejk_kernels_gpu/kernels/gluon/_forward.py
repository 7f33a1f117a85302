"""The Hopper forward written in Gluon (Triton's explicit layer): FlashAttention-3's schedule.

Triton 3.6's automatic warp specialisation cannot overlap a warpgroup's softmax with its
matmuls (docs/performance-history.md#step-9-2026-11-23); here the schedule is written out.
One program owns ``BM`` = 128 query rows of one (batch, query head):

- a producer warp copies k and v of every key block it visits into two rings of
  ``STAGES`` slots by TMA, each slot with a ``ready`` barrier (the copy landed) and an
  ``empty`` one (every consumer is done with it), k and v apart, so k of block j is
  freed before v is;
- ``NC`` = BM / 64 consumer warpgroups own 64 rows each: two, or three for soft caps
  (`flash._select.THREE_CONSUMERS`, 192-row tiles: a third softmax on the MUFU while the other
  two wait on their matmuls).
  Per key block j they issue ``q·kⱼᵀ`` and ``pⱼ₋₁·vⱼ₋₁`` together, wait for the first,
  run block j's online softmax while the second runs, then wait for it
  (FlashAttention-3's intra-warpgroup pipeline). Nothing
  is in flight across a loop's back edge: ptxas spills and serialises wgmma
  accumulators that are (C7513).

The key blocks a program visits come from the same per-query-block table as the ordinary
kernel's (`flash._tables.block_table`: ``(lo, full_lo, full_hi, hi)``): blocks outside
``[lo, hi)`` are never loaded (causal, window, packed sequences, documents given as segment
ids), blocks inside ``[full_lo, full_hi)`` run without a mask, the others evaluate the
call's masks per score (`kernels.gluon._common.visible`: causal and window on positions,
packed-sequence ids, segment ids, keys past the end; the keys' ids and positions are
loaded while the block's q·kᵀ runs, `_key_info`). In a causal call the blocks after the
unmasked range compare positions alone: there the table keeps an unmasked range only
where those keys hold the block's own segment id (`flash._tables._intersect`). A soft cap is one
``tanh.approx`` per score (one MUFU op, as FlashAttention-3 does), in log2 units like the
rest of the softmax; with caps up to 55 and bf16 inputs each row's shift is fixed after a
tile's first key block (``FIXED_SHIFT``, `_softmax`): no max per score, no rescaling of o.

A tile is one query block of one (batch, head); programs take tiles in the grid's order (a
head's query blocks consecutive, so the programs at work share k and v in L2; causal
ones heaviest first), with ``ORDERED`` in the launch's (`flash._schedule.launch_order`: a few
heads' query blocks at a time, the heaviest first), or with ``ROWS_MAJOR`` (persistent
causal programs, `flash._constexprs.rows_major`) the last ``ROWS_MAJOR`` (batch, head) groups'
one query block of each at a time, the last first (`_rows_major`): all of them in short
calls with documents, the last few in short causal ones, so the last tiles are light.
Where S fills whole key tiles and T whole 64-row steps
(`flash._constexprs.gluon_persistent`; a last tile's consumers past T only release its buffers,
`_release_tile`), one program per SM loops over the tiles it takes from an
atomic counter (`_producer`; programs with lighter tiles take more): the producer copies
the next tile's first k/v blocks and then its q while the consumers finish the previous
tile's epilogue, and the ring's slots and phases run on across tiles (``count``); the
consumers read the next tile and its key range while a tile's last p·v runs. Where
shared memory has room (``OBUF``, `flash._constexprs.gluon_obuf`: head_dim 64, or 128 with two
slots) the output leaves through a buffer of its own: a consumer releases q after its
tile's last q·kᵀ, so the next q loads during the last p·v and the epilogue, and waits for
its output's store only before the next one. Otherwise o leaves through q's buffer, whose
store is waited for before the next q may load. Other calls run one program a tile
through the same per-tile bodies (`_produce_tile`, `_consume_tile`).

Calls it takes (`flash._select.can_run_gluon`): 16-bit inputs, head_dim 64, 128 or 256
(256 with 64-key tiles), a positive scale, no bias or dropout; any masks, soft cap,
sinks, grouped heads, key and query lengths (TMA zero-fills rows past the ends on load
and clips them on store).
Rows that see no key (and no sink) give 0 with lse -inf, as the ordinary kernel's.

Gluon kernels do not run in Triton's interpreter: on CPU the ordinary kernels run
instead, and the tests build this one for sm_90 ahead of time (`aot.flash`).
"""

from typing import NamedTuple

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from ._common import (
    ALL_SIDES,
    RIGHT_SIDE,
    barriers,
    operand_layout,
    pair_descriptors,
    ring_slot,
    tanh,
    token_info,
    visible,
    wgmma_layout,
)

_LOG2E = gl.constexpr(1.4426950408889634)
# With ``FIXED_SHIFT`` a row's shift is at least CAP_OUT - _SHIFT_ROOM (`_softmax`).
_SHIFT_ROOM = gl.constexpr(76.0)


class GluonOptions(NamedTuple):
    """The compile-time options of one launch (built in the kernel, passed as a constexpr)."""

    T: int  # query rows
    S: int  # key rows
    BN: int  # key tile
    STAGES: int  # slots of each of the k and v rings
    QK: float  # scale · log2(e): logits in log2 units, no soft cap
    SOFT_CAP: float  # 0.0: none
    CAP_IN: float  # scale / soft cap: tanh's argument per q·kᵀ
    CAP_OUT: float  # soft cap · log2(e): capped logits in log2 units
    CAUSAL: bool
    WINDOW_LEFT: int  # -1: no window
    WINDOW_RIGHT: int
    VARLEN: bool  # positions per token (packed sequences, context-parallel blocks)
    SEQ_IDS: bool  # with VARLEN: sequence ids per token too (packed sequences)
    HAS_SEG: bool  # segment ids per (batch, token)
    MASKED: bool  # some key block needs a mask (any of the above, or S off the key tile)
    TABLE: bool  # key ranges from the block table (window, packing, segment ids); else from
    # the program's rows (unmasked or causal alone: no load before the first copy)
    EARLY_P16: bool  # p to 16 bits in the softmax (registers: masks beyond causal, tile loop)
    B: int  # batch rows
    N: int  # query heads
    H: int  # head_dim
    G: int  # query heads per kv head
    BM: int  # query rows per tile
    NC: int  # consumer warpgroups, BM // 64: each takes 64 of a tile's rows
    PERSISTENT: bool  # one program per SM loops over the tiles (S on whole key tiles, T on
    # whole consumers' rows)
    PARTIAL: bool  # persistent, T off the tile: in a (batch, head)'s last tile the consumers
    # whose rows lie past T compute nothing (`_release_tile`)
    ORDERED: bool  # tiles in the launch's order (`flash._schedule.launch_order`), else the grid's
    ROWS_MAJOR: int  # the grid's order takes the last ROWS_MAJOR (batch, head) groups' tiles
    # one query block of each at a time (`_rows_major`); 0: none
    OBUF: bool  # o leaves through a buffer of its own (else q's): q is released after the
    # tile's last q·kᵀ, and a tile's output store is waited for only before the next one's
    FIXED_SHIFT: bool  # soft cap: each row's shift is set by the tile's first key block and
    # kept (`_softmax`): no max per score and no rescaling of o after it
    RESUME: bool  # rows start from a previous call's (o, lse) over other keys (`_resume`);
    # a tile with no key block here stores nothing (its output buffer holds that call's)
    KV_PAIR: bool  # k and v: the halves of each head's columns of one [B, S, K, 2H] array


@gluon.jit
def _tile(tile, n_m, F: gl.constexpr):
    """(b, n, b·N + n, query block) of a tile: tile ``(b·N + n)·n_m + query block`` taken
    from the launch's order (``ORDERED``), else ``(b·N + n)·n_m + m`` of the grid's, where
    the query blocks of one (batch, head) are consecutive tiles (programs at work together
    share k and v in L2), causal ones heaviest first (block ``n_m - 1 - m``).
    With one query block the block is 0, read from the grid's (absent) third axis so the
    compiler cannot fold it: a constant 0 folds whole-tile row masks to constants, which
    Triton 3.6's LLVM lowering fails on (an `idx < size()` assertion; 64 queries over whole
    key tiles, tests/test_aot.py's ``one_block``)."""
    bn = tile // n_m
    if n_m == 1:
        pid_m = gl.program_id(2)
    elif F.ORDERED:
        pid_m = tile - bn * n_m
    else:
        m = tile % n_m
        pid_m = n_m - 1 - m if F.CAUSAL else m
    return bn // F.N, bn % F.N, bn, pid_m


@gluon.jit
def _rows_major(place, n_m, F: gl.constexpr):
    """The tile (as `_tile` reads the grid's) at ``place`` of the order with ``ROWS_MAJOR``:
    the grid's up to the last ``ROWS_MAJOR`` (batch, head) groups, then one query block of
    each of those at a time (causal ones the last block first)."""
    first: gl.constexpr = F.B * F.N - F.ROWS_MAJOR  # the first group taken rows-major
    if first == 0:  # every group (no branch: the producer's few registers)
        m = place // F.ROWS_MAJOR
        tile = (place - m * F.ROWS_MAJOR) * n_m + m
    else:
        tile = place
        if place >= first * n_m:
            r = place - first * n_m
            m = r // F.ROWS_MAJOR
            tile = (first + r - m * F.ROWS_MAJOR) * n_m + m
    return tile


@gluon.jit
def _key_blocks(ranges_ptr, b, pid_m, n_m, F: gl.constexpr):
    """The tile's key range in key blocks ``(lo, full_lo, full_hi, hi)``: the block table's
    (`flash._tables.block_table`), or for unmasked and causal-only calls the same from its rows."""
    row0 = pid_m * F.BM
    if F.TABLE:
        table = ranges_ptr + ((b * n_m + pid_m) * 4 if F.HAS_SEG else pid_m * 4)
        j_lo = gl.load(table) // F.BN
        jf_lo = gl.load(table + 1) // F.BN
        jf_hi = gl.load(table + 2) // F.BN
        j_hi = gl.cdiv(gl.load(table + 3), F.BN)
    else:
        j_lo = 0
        jf_lo = 0
        j_hi = gl.cdiv(gl.minimum(row0 + F.BM, F.S), F.BN) if F.CAUSAL else gl.cdiv(F.S, F.BN)
        # Causal: blocks wholly at or before the first row's key; else whole blocks.
        jf_hi = gl.minimum((row0 + 1) // F.BN, F.S // F.BN) if F.CAUSAL else F.S // F.BN
    return j_lo, jf_lo, jf_hi, j_hi


@gluon.jit
def _origin(b, n, F: gl.constexpr):
    """Where a tile's (batch, head) starts in the descriptors' coordinates:
    (q row, q column, k row, k column): persistent programs address the whole tensors,
    the others descriptors of their own (batch, head)."""
    if F.PERSISTENT:
        return b * F.T, n * F.H, b * F.S, (n // F.G) * F.H * (2 if F.KV_PAIR else 1)
    return 0, 0, 0, 0


@gluon.jit
def _copy_kv(descs, smem, kv_bars, j, count, k_origin, F: gl.constexpr):
    """Copy k and v of key block ``j``, the ``count``-th block of the program, into the rings."""
    k_desc = descs[1]
    v_desc = descs[2]
    k_smem = smem[1]
    v_smem = smem[2]
    k_ready, k_empty, v_ready, v_empty = kv_bars
    krow, kcol = k_origin
    s, phase = ring_slot(count, F.STAGES)
    phase = phase ^ 1  # a slot's first use waits for nothing
    mbarrier.wait(k_empty.index(s), phase)
    mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(
        k_desc, [krow + j * F.BN, kcol], k_ready.index(s), k_smem.index(s)
    )
    mbarrier.wait(v_empty.index(s), phase)
    mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(
        v_desc, [krow + j * F.BN, kcol], v_ready.index(s), v_smem.index(s)
    )


@gluon.jit
def _produce_tile(tile, count, qph, blocks, descs, smem, bars, n_m, F: gl.constexpr):
    """Copy one tile's q and the k and v of its key blocks; ``count``: key blocks this
    program copied before; ``qph``: the phase of q's barriers for this tile; ``blocks``:
    its key range (`_key_blocks`). Returns the new count.

    Key blocks go before q as far as their ring slots are free before q's buffer is: with
    o through q's buffer (freed once the previous tile's output has left), the first
    ``STAGES``, which need only slots the previous tile frees by its last p·v, so they land
    during its epilogue (a second q buffer measured no faster); with ``OBUF`` (q freed after
    the previous tile's last q·kᵀ) the first ``STAGES - 1``, whose slots that tile freed
    before its last key block: the next, in its last block's slots, would hold q back until
    that block's p·v is done (q then landed after the epilogue, a tile's wait; see
    docs/performance-history.md#kernelsgluon_forwardpy).
    """
    q_desc = descs[0]
    q_smem = smem[0]
    q_ready, q_empty, kv_bars = bars
    where = _tile(tile, n_m, F)  # (b, n, bn, query block)
    b = where[0]
    n = where[1]
    pid_m = where[3]
    j_lo = blocks[0]
    j_hi = blocks[3]
    qrow, qcol, krow, kcol = _origin(b, n, F)
    LEAD: gl.constexpr = F.STAGES - 1 if F.OBUF else F.STAGES
    head = gl.minimum(j_hi, j_lo + LEAD)
    for j in range(j_lo, head):
        _copy_kv(descs, smem, kv_bars, j, count + j - j_lo, (krow, kcol), F)
    mbarrier.wait(q_empty, qph ^ 1)  # the previous tile's q is done with (OBUF), or its
    # output has left (o through q's buffer)
    for h in gl.static_range(F.NC):
        mbarrier.expect(q_ready.index(h), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(
            q_desc, [qrow + pid_m * F.BM + h * (F.BM // F.NC), qcol],
            q_ready.index(h), q_smem.index(h),
        )  # fmt: skip
    for j in range(head, j_hi):
        _copy_kv(descs, smem, kv_bars, j, count + j - j_lo, (krow, kcol), F)
    return count + gl.maximum(j_hi - j_lo, 0)


@gluon.jit
def _publish_tile(tile, it, sched):
    """Tell the consumers the program's ``it``-th tile (slot ``it % 2`` of the schedule ring,
    once every consumer read what it held before)."""
    tiles, tile_ready, tile_empty = sched
    slot, phase = ring_slot(it, 2)
    mbarrier.wait(tile_empty.index(slot), phase ^ 1)  # a slot's first use waits for nothing
    one: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])  # the producer's one warp
    tiles.index(slot).store(gl.full([1], tile, gl.int32, one))
    gl.thread_barrier()  # the warp's store before its arrival
    mbarrier.arrive(tile_ready.index(slot), count=1)


@gluon.jit
def _producer(descs, smem, bars, ranges_ptr, first, sched, sched_ptrs, total, n_m,
              F: gl.constexpr):  # fmt: skip
    """Copy each tile's q and k and v, in the consumers' order (`_produce_tile`).

    Persistent programs take places in the tile order (`_tile`) from a counter: each its
    program id first, then ``num_programs + atomic_add(counter, 1)`` until past the last,
    so that programs whose tiles hold less work take more of them (causal tiles,
    documents). Each tile id is passed to the consumers through the schedule ring
    (`_publish_tile`); ``total`` ends them. ``first``: the tile of this program's id and
    its key range (one program a tile); ``sched_ptrs``: (the launch's tile order, read
    with ``ORDERED``, the counter)."""
    if F.PERSISTENT:
        order_ptr, counter_ptr = sched_ptrs
        count = 0  # key blocks copied by this program
        it = 0  # tiles taken by this program
        place = gl.program_id(0)
        while place < total:
            if F.ORDERED:
                tile = gl.load(order_ptr + place)
            elif F.ROWS_MAJOR > 0:
                tile = _rows_major(place, n_m, F)
            else:
                tile = place
            _publish_tile(tile, it, sched)
            where = _tile(tile, n_m, F)
            blocks = _key_blocks(ranges_ptr, where[0], where[3], n_m, F)
            count = _produce_tile(tile, count, it & 1, blocks, descs, smem, bars, n_m, F)
            place = gl.num_programs(0) + gl.atomic_add(counter_ptr, 1)
            it += 1
        _publish_tile(total, it, sched)
    else:
        _produce_tile(first[0], 0, 0, first[1], descs, smem, bars, n_m, F)


@gluon.jit
def _key_info(j, masks, F: gl.constexpr, IDS: gl.constexpr = True):
    """The `token_info` of key block j, in the S tile's column layout (its segment ids
    with ``IDS``). Loaded before the block's q·kᵀ is waited for, so that the loads'
    latency hides behind the matmul."""
    _, b, key_tabs = masks
    cols: gl.constexpr = gl.SliceLayout(0, wgmma_layout(F.BN))
    keys = j * F.BN + gl.arange(0, F.BN, layout=cols)
    return token_info(keys, F.S, b, key_tabs, F, -2, IDS)


@gluon.jit
def _softmax(s, m_i, l_i, alpha_in, row_info, key_info, F: gl.constexpr, MASK: gl.constexpr,
             DTYPE: gl.constexpr, SIDE: gl.constexpr = ALL_SIDES, IDS: gl.constexpr = True,
             FIRST: gl.constexpr = False):  # fmt: skip
    """Online-softmax update for an S tile: (p, alpha, m, l), in log2 units.

    MASK: the block needs the call's masks (`kernels.gluon._common.visible` of the rows' and its
    keys' `token_info`, the bounds on ``SIDE``, segment ids with ``IDS``); a row may then
    have seen no key yet (m = -inf), and 0 is subtracted instead so that its p and alpha
    are 0, not NaN.

    ``FIXED_SHIFT`` (a soft cap: logits in log2 units within ``[-CAP_OUT, CAP_OUT]``, and
    CAP_OUT <= `flash._constexprs.FIXED_SHIFT_CAP_OUT`; bf16): the tile's ``FIRST`` block sets each
    row's shift m = max(its running max, CAP_OUT - _SHIFT_ROOM) and later blocks keep it,
    with neither a max per score nor a rescaling of o (alpha 1: `_issue_pv` skips it).
    Its l is then each thread's own sums of its columns (`_own_sums`, no shuffle a block;
    reduced after the tile's last block) and alpha's slot carries the row's mass before the
    first block (the sink's, scaled to the shift).
    Every p is then at most 2^_SHIFT_ROOM = 2^76 (bf16 has float32's range), so l and o
    overflow float32 only past 2^52 summed over the row's keys (of 1, or of |v|). A p
    flushes to 0 only 2^126 below p = 1: where m is the row's own max (or its sink) such a
    key weighs nothing beside it, and where m is the floor no logit is that low (>= -CAP_OUT
    >= CAP_OUT - 160). The row's largest p is at least 2^(76 - 2·CAP_OUT) >= 2^-84, so its
    products with any |v| >= 2^-42 stay normal floats.
    """
    # Scores in log2 units are x·LOG2 with x = s (no cap) or tanh(s·scale/cap) (LOG2 then
    # carries cap·log2 e): the max is taken on x and the scale goes into p's one FMA.
    x = s
    LOG2: gl.constexpr = F.CAP_OUT if F.SOFT_CAP > 0.0 else F.QK
    if F.SOFT_CAP > 0.0:
        x = tanh(s * F.CAP_IN)
    if MASK:
        seen = visible(row_info, key_info, 0, F, SIDE, F.S % F.BN == 0, IDS)
        x = gl.where(seen, x, float("-inf"))
    if F.FIXED_SHIFT and not FIRST:  # the shift stays, p's sums are each thread's own
        p = gl.exp2(x * LOG2 - gl.expand_dims(m_i, 1))
        alpha = alpha_in  # (the mass before the tile's first block; no rescaling: `_issue_pv`)
        m_new = m_i
        l_new = l_i + _own_sums(p, F)
    else:
        m_new = gl.maximum(m_i, gl.max(x, axis=1) * LOG2)
        if F.FIXED_SHIFT:
            m_new = gl.maximum(m_new, F.CAP_OUT - _SHIFT_ROOM)
        m_use = m_new
        if MASK:
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(x * LOG2 - gl.expand_dims(m_use, 1))
        alpha = gl.exp2(m_i - m_use)
        if F.FIXED_SHIFT:  # alpha's slot carries the mass before this block, l each thread's sums
            l_new = _own_sums(p, F)
            alpha = l_i * alpha
        else:
            l_new = l_i * alpha + gl.sum(p, axis=1)
    # With masks beyond causal or the persistent tile loop (EARLY_P16) p leaves in the inputs'
    # 16-bit type: it waits for its p·v matmul across the next block's q·kᵀ, and 16-bit
    # halves the registers it holds.
    if F.EARLY_P16:
        p = p.to(DTYPE)
    return p, alpha, m_new, l_new


@gluon.jit
def _own_sums(p, F: gl.constexpr):
    """p's sums over each thread's own columns, [rows, 4]: a wgmma accumulator's thread
    holds columns 8·i + 2·t + (0, 1) of its rows (t its lane mod 4)."""
    x = gl.reshape(p, [p.shape[0], F.BN // 8, 4, 2])
    return gl.sum(gl.sum(x, axis=3), axis=1)


@gluon.jit
def _as_carried(p):
    """p (16-bit: a block table implies ``EARLY_P16``) unchanged, through an opaque move of
    each pair of its values (not pure, so that it stays where it is): ptxas then lays p's
    registers out for the loop that follows rather than for the one before."""
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [p], dtype=p.dtype,
                                     is_pure=False, pack=2)  # fmt: skip


@gluon.jit
def _issue_qk(q, k_smem, zero_s):
    """Issue S = q·kᵀ (asynchronous)."""
    return hopper.warpgroup_mma(q, k_smem.permute((1, 0)), zero_s, use_acc=False, is_async=True)


@gluon.jit
def _issue_pv(p, alpha, acc, v_smem, layouts: gl.constexpr, F: gl.constexpr):
    """Issue acc·alpha + p·v (asynchronous; p 16-bit; with ``FIXED_SHIFT`` acc·1: o is
    zero before the first block's p·v and alpha 1 after); ``acc`` must be complete."""
    orow_layout, p_layout = layouts
    if not F.FIXED_SHIFT:
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, orow_layout), 1)
    p16 = gl.convert_layout(p.to(v_smem.dtype), p_layout)
    return hopper.warpgroup_mma(p16, v_smem, acc, is_async=True)


@gluon.jit
def _block_relative(j, row_info, key_info, F: gl.constexpr):
    """The rows' and key block j's `token_info` with positions relative to the block's
    first key (for builds whose positions are the tokens' indices): the keys' are then the
    column index and the rows' lose ``j·BN``, which leaves every causal and window bound
    the same. In the builds with a table (windows, segment ids) LLVM otherwise packs a
    thread's 64 position compares into a 64-bit mask and unpacks it (`aot.flash`'s
    ``mask_unpacks``; docs/performance-history.md#kernelsgluon_forwardpy). The causal build
    (no table) packs nothing and spills at head_dim 256 with it, and the soft cap's build is
    no faster: both keep absolute positions."""
    cols: gl.constexpr = gl.SliceLayout(0, wgmma_layout(F.BN))
    keys = (key_info[0], key_info[1], gl.arange(0, F.BN, layout=cols), key_info[3])
    rows = (row_info[0], row_info[1], row_info[2] - j * F.BN, row_info[3])
    return rows, keys


@gluon.jit
def _step(j, base, state, q, zero_s, bufs, masks, F: gl.constexpr, layouts: gl.constexpr,
          MASK: gl.constexpr, SIDE: gl.constexpr = ALL_SIDES, IDS: gl.constexpr = True):  # fmt: skip
    """Key block j (the program's ``j - base``-th): issue q·kⱼᵀ and p·v of block j-1,
    softmax of block j meanwhile (``MASK``, ``SIDE``, ``IDS``: `_softmax`)."""
    p, alpha, m_i, l_i, acc = state
    k_smem, v_smem, k_ready, k_empty, v_ready, v_empty = bufs
    ks, kph = ring_slot(j - base, F.STAGES)
    vs, vph = ring_slot(j - 1 - base, F.STAGES)
    mbarrier.wait(k_ready.index(ks), kph)
    mbarrier.wait(v_ready.index(vs), vph)
    s_tok = _issue_qk(q, k_smem.index(ks), zero_s)
    o_tok = _issue_pv(p, alpha, acc, v_smem.index(vs), layouts, F)
    key_info = 0
    row_info = masks[0]
    if MASK:
        key_info = _key_info(j, masks, F, IDS)
        if F.TABLE and not F.VARLEN and F.SOFT_CAP == 0.0:
            row_info, key_info = _block_relative(j, row_info, key_info, F)
    s = hopper.warpgroup_mma_wait(1, deps=[s_tok])
    mbarrier.arrive(k_empty.index(ks), count=1)
    p, alpha, m_i, l_i = _softmax(s, m_i, l_i, alpha, row_info, key_info, F, MASK, k_smem.dtype,
                                  SIDE, IDS)  # fmt: skip
    acc = hopper.warpgroup_mma_wait(0, deps=[o_tok])
    mbarrier.arrive(v_empty.index(vs), count=1)
    return p, alpha, m_i, l_i, acc


@gluon.jit
def _resume(prev, rows, bn, row_c, F: gl.constexpr, o_layout: gl.constexpr):
    """``(m, l, acc)`` of rows that continue a previous call over other keys (``RESUME``),
    from its output o and lse (``prev``: their pointers): m = lse in log2 units, l = 1 and
    acc = o, so that the rows' later keys add to the same sums (rows it gave no mass keep
    m = -inf, l = 0 and o = 0)."""
    prev_o, prev_lse = prev
    lse = gl.load(prev_lse + bn.to(gl.int64) * F.T + rows, mask=rows < F.T, other=float("-inf"))
    m_i = lse * _LOG2E
    l_i = gl.where(lse > float("-inf"), 1.0, 0.0)
    o_rows = row_c + gl.arange(0, F.BM // F.NC, layout=gl.SliceLayout(1, o_layout))
    cols = gl.arange(0, F.H, layout=gl.SliceLayout(0, o_layout))
    b = bn // F.N
    n = bn % F.N
    at = ((b.to(gl.int64) * F.T + o_rows) * F.N + n) * F.H
    o = gl.load(prev_o + gl.expand_dims(at, 1) + gl.expand_dims(cols, 0),
                mask=gl.expand_dims(o_rows < F.T, 1), other=0.0)  # fmt: skip
    return m_i, l_i, o.to(gl.float32)


@gluon.jit
def _consume_tile(tile, count, qph, blocks, smem, bars, dest, sinks_ptr, prev, n_m, tabs, nxt,
                  F: gl.constexpr, HAS_SINKS: gl.constexpr, C: gl.constexpr):  # fmt: skip
    """Rows ``C·BM/NC ..`` of one tile's query block (consumer C of NC); ``count``: key
    blocks this program consumed before; ``qph``: the phase of q's barriers for this tile
    (`_tile_phase`); ``blocks``: its key range (`_key_blocks`); ``prev``: the previous
    call's (o, lse) pointers (``RESUME``). ``nxt``: for persistent programs, what
    `_next_tile` reads, read while the tile's last p·v runs (before its epilogue).
    Returns the new count and the next tile with its key range (persistent programs)."""
    q_smem, k_smem, v_smem, o_smem = smem
    q_ready, q_empty, kv_bars = bars
    k_ready, k_empty, v_ready, v_empty = kv_bars
    o_desc, lse_ptr = dest
    ROWS_C: gl.constexpr = F.BM // F.NC  # a consumer's rows
    s_layout: gl.constexpr = wgmma_layout(F.BN)
    o_layout: gl.constexpr = wgmma_layout(F.H)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    orow_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
    layouts: gl.constexpr = (orow_layout, operand_layout(o_layout))
    row_tabs, key_tabs = tabs
    ring = (k_smem, v_smem, k_ready, k_empty, v_ready, v_empty)
    b, n, bn, pid_m = _tile(tile, n_m, F)
    j_lo, jf_lo, jf_hi, j_hi = blocks
    q = q_smem.index(C)
    row_c = pid_m * F.BM + C * ROWS_C
    rows = row_c + gl.arange(0, ROWS_C, layout=row_layout)
    masks = (token_info(rows, F.T, b, row_tabs, F, -1), b, key_tabs)
    if HAS_SINKS:  # the sink is a key of logit `sink` and no value (mass 1 at m = sink)
        sink = gl.load(sinks_ptr + n).to(gl.float32) * _LOG2E
        m_i = gl.full([ROWS_C], 0.0, gl.float32, row_layout) + sink
        l_i = gl.full([ROWS_C], 1.0, gl.float32, row_layout)
    else:
        m_i = gl.full([ROWS_C], float("-inf"), gl.float32, row_layout)
        l_i = gl.full([ROWS_C], 0.0, gl.float32, row_layout)
    acc = gl.zeros([ROWS_C, F.H], gl.float32, o_layout)
    if F.RESUME:
        if j_hi > j_lo:
            m_i, l_i, acc = _resume(prev, rows, bn, row_c, F, o_layout)
    zero_s = gl.zeros([ROWS_C, F.BN], gl.float32, s_layout)
    base = j_lo - count  # key block j is the program's (j - base)-th
    mbarrier.wait(q_ready.index(C), qph)
    if j_hi > j_lo:
        first, fph = ring_slot(j_lo - base, F.STAGES)
        mbarrier.wait(k_ready.index(first), fph)
        s_tok = _issue_qk(q, k_smem.index(first), zero_s)
        key_info = 0
        if F.MASKED:
            key_info = _key_info(j_lo, masks, F)
        s = hopper.warpgroup_mma_wait(0, deps=[s_tok])
        mbarrier.arrive(k_empty.index(first), count=1)
        # Blocks after the fully visible range need only the bounds on the keys' right
        # (`visible`: RIGHT_SIDE); the first block, where it is the first of that range,
        # none. (Blocks before it take every bound: evaluating only those on the left there
        # needs a second loop for tiles with no fully visible block, and spilled.)
        whole = jf_lo < jf_hi
        if F.MASKED:
            if whole and j_lo == jf_lo:
                p, alpha, m_i, l_run = _softmax(s, m_i, l_i, l_i, masks[0], key_info, F, False,
                                                q.dtype, FIRST=True)  # fmt: skip
            else:
                p, alpha, m_i, l_run = _softmax(s, m_i, l_i, l_i, masks[0], key_info, F, True,
                                                q.dtype, FIRST=True)  # fmt: skip
        else:
            p, alpha, m_i, l_run = _softmax(s, m_i, l_i, l_i, masks[0], key_info, F, False,
                                            q.dtype, FIRST=True)  # fmt: skip
        state = (p, alpha, m_i, l_run, acc)
        # p's registers as the loops keep them (no swap of its halves a block): from the
        # first block in causal builds without a table and in packed ones; between the masked
        # and the unmasked loop in the other builds with a table (below). Not with a soft
        # cap on two consumers, where it is slower (see
        # docs/performance-history.md#kernelsgluon_forwardpy).
        capped_two = F.SOFT_CAP > 0.0 and F.NC == 2
        if ((F.CAUSAL and F.EARLY_P16 and not F.TABLE) or F.VARLEN) and not capped_two:
            state = (_as_carried(state[0]), state[1], state[2], state[3], state[4])
        if F.MASKED and F.TABLE:  # (else no block precedes the fully visible ones)
            for j in range(j_lo + 1, jf_lo):
                state = _step(j, base, state, q, zero_s, ring, masks, F, layouts, True)
            if not F.VARLEN:  # p's registers as the unmasked loop keeps them (no swap a block)
                state = (_as_carried(state[0]), state[1], state[2], state[3], state[4])
        for j in range(gl.maximum(jf_lo, j_lo + 1), jf_hi):
            state = _step(j, base, state, q, zero_s, ring, masks, F, layouts, False)
        # (A table moves an empty fully visible range to the end, `flash._tables._with_full`, so
        # these blocks follow a non-empty one; builds without a table bound no key's left.
        # Causal: their keys hold the rows' one segment id, `flash._tables._intersect`.)
        if F.MASKED:
            for j in range(gl.maximum(jf_hi, j_lo + 1), j_hi):
                state = _step(j, base, state, q, zero_s, ring, masks, F, layouts, True,
                              RIGHT_SIDE, not F.CAUSAL)  # fmt: skip
        p, alpha, m_i, l_i, acc = state
        if F.FIXED_SHIFT:  # the mass before the first block and each thread's sums after
            l_i = alpha + gl.convert_layout(gl.sum(l_i, axis=1), row_layout)
        if F.OBUF:  # every q·kᵀ of the tile is done: the next tile's q may come in
            mbarrier.arrive(q_empty, count=1)
        last, lph = ring_slot(j_hi - 1 - base, F.STAGES)
        mbarrier.wait(v_ready.index(last), lph)
        o_tok = _issue_pv(p, alpha, acc, v_smem.index(last), layouts, F)
        following = _next_tile(nxt, n_m, F)
        acc = hopper.warpgroup_mma_wait(0, deps=[o_tok])
        mbarrier.arrive(v_empty.index(last), count=1)
    else:
        following = _next_tile(nxt, n_m, F)
        if F.OBUF:
            mbarrier.arrive(q_empty, count=1)
    if F.RESUME and j_hi <= j_lo:  # no key here: the output keeps the previous call's rows
        if not F.OBUF:
            mbarrier.arrive(q_empty, count=1)  # the producer may load the next tile's q
    else:
        # Rows with no mass (no visible key, no sink) give 0 with lse -inf.
        has_mass = l_i > 0.0
        l_safe = gl.where(has_mass, l_i, 1.0)
        # One reciprocal a row and a multiply a score: a division per score is a MUFU
        # reciprocal each (div.full.f32), as many as a key block's exponentials.
        inv_l = 1.0 / l_safe
        out = acc * gl.expand_dims(gl.convert_layout(inv_l, orow_layout), 1)
        o_buf = q
        if F.OBUF:
            o_buf = o_smem.index(C)
            tma.store_wait(0)  # this consumer's previous output has left its buffer
        o_buf.store(out.to(q.dtype))  # (else q's buffer is free now: o leaves through it)
        hopper.fence_async_shared()
        # Where the tile's rows go, recomputed from the tile (fewer registers live across
        # the key loop: ptxas spills otherwise).
        b, n, bn, pid_m = _tile(tile, n_m, F)
        origin = _origin(b, n, F)
        row_c = pid_m * F.BM + C * ROWS_C
        tma.async_copy_shared_to_global(o_desc, [origin[0] + row_c, origin[1]], o_buf)
        rows = row_c + gl.arange(0, ROWS_C, layout=row_layout)
        lse = gl.where(has_mass, (m_i + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        gl.store(lse_ptr + bn.to(gl.int64) * F.T + rows, lse, mask=rows < F.T)
        if not F.OBUF:
            tma.store_wait(0)
            mbarrier.arrive(q_empty, count=1)  # the producer may load the next tile's q
    return count + gl.maximum(j_hi - j_lo, 0), following


@gluon.jit
def _release_tile(count, qph, blocks, bars, n_m, nxt, F: gl.constexpr, C: gl.constexpr):
    """What consumer C does with a tile whose rows it would take all lie past T (``PARTIAL``:
    the last query block of a (batch, head), T off the tile): nothing is computed or stored
    (in the descriptors' rows they are the next batch row's); it only releases q and each
    key block's k and v once they landed, as `_consume_tile` would, so that the barriers'
    arrivals and phases stay the same. Returns what `_consume_tile` returns."""
    q_ready, q_empty, kv_bars = bars
    k_ready, k_empty, v_ready, v_empty = kv_bars
    j_lo = blocks[0]
    j_hi = blocks[3]
    base = j_lo - count
    mbarrier.wait(q_ready.index(C), qph)
    for j in range(j_lo, j_hi):
        s, phase = ring_slot(j - base, F.STAGES)
        mbarrier.wait(k_ready.index(s), phase)
        mbarrier.arrive(k_empty.index(s), count=1)
        mbarrier.wait(v_ready.index(s), phase)
        mbarrier.arrive(v_empty.index(s), count=1)
    following = _next_tile(nxt, n_m, F)
    mbarrier.arrive(q_empty, count=1)
    return count + gl.maximum(j_hi - j_lo, 0), following


@gluon.jit
def _next_tile(nxt, n_m, F: gl.constexpr):
    """For persistent programs (``nxt``: the program's tiles taken so far, the schedule
    ring, the block table and the tile count) the next tile and its key range (past the
    last tile, ``total`` and the last tile's range, unused); else ``(0, 0)``."""
    if F.PERSISTENT:
        it, sched, ranges_ptr, total = nxt
        tile = _read_tile(it, sched)
        where = _tile(gl.minimum(tile, total - 1), n_m, F)
        return tile, _key_blocks(ranges_ptr, where[0], where[3], n_m, F)
    else:
        return 0, 0


@gluon.jit
def _read_tile(it, sched):
    """The program's ``it``-th tile, as the producer published it (`_publish_tile`); frees
    its slot once this consumer's four warps have read it."""
    tiles, tile_ready, tile_empty = sched
    slot, phase = ring_slot(it, 2)
    mbarrier.wait(tile_ready.index(slot), phase)
    four: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])  # a consumer's warpgroup
    tile = gl.max(tiles.index(slot).load(four), axis=0)
    gl.thread_barrier()
    mbarrier.arrive(tile_empty.index(slot), count=1)
    return tile


@gluon.jit
def _consumer(shared, total, n_m, tabs, F: gl.constexpr, HAS_SINKS: gl.constexpr,
              C: gl.constexpr):  # fmt: skip
    """Each tile's rows ``C·BM/NC ..`` (consumer C of NC, `_consume_tile`); persistent
    programs take the tiles the producer publishes (`_producer`) until ``total``.
    ``shared``: what every consumer takes (`gluon_fwd_kernel`)."""
    smem, bars, dest, sinks_ptr, prev, ranges_ptr, first, sched = shared
    if F.PERSISTENT:
        count = 0  # key blocks consumed by this program
        it = 0  # tiles taken by this program
        tile, blocks = _next_tile((it, sched, ranges_ptr, total), n_m, F)
        while tile < total:
            nxt = (it + 1, sched, ranges_ptr, total)
            if F.PARTIAL and _tile(tile, n_m, F)[3] * F.BM + C * (F.BM // F.NC) >= F.T:
                count, following = _release_tile(count, it & 1, blocks, bars, n_m, nxt, F, C)
            else:
                count, following = _consume_tile(tile, count, it & 1, blocks, smem, bars, dest,
                                                 sinks_ptr, prev, n_m, tabs, nxt, F,
                                                 HAS_SINKS, C)  # fmt: skip
            tile, blocks = following
            it += 1
    else:  # the one tile's key range, read before the partitions split the registers
        _consume_tile(first[0], 0, 0, first[1], smem, bars, dest, sinks_ptr, prev, n_m, tabs,
                      0, F, HAS_SINKS, C)  # fmt: skip
    if F.OBUF:
        tma.store_wait(0)


@gluon.jit
def gluon_fwd_kernel(
    q_ptr, k_ptr, v_ptr, sinks_ptr, prev_o_ptr, prev_lse_ptr,
    qsid_ptr, ksid_ptr, qpos_ptr, kpos_ptr, qseg_ptr, kseg_ptr, ranges_ptr, order_ptr,
    counter_in_ptr, o_ptr, lse_ptr, counter_ptr, scratch_ptr,
    B: gl.constexpr, T: gl.constexpr, S: gl.constexpr, N: gl.constexpr, G: gl.constexpr,
    H: gl.constexpr,
    QK: gl.constexpr, SOFT_CAP: gl.constexpr, CAP_IN: gl.constexpr, CAP_OUT: gl.constexpr,
    CAUSAL: gl.constexpr, WINDOW_LEFT: gl.constexpr, WINDOW_RIGHT: gl.constexpr,
    VARLEN: gl.constexpr, SEQ_IDS: gl.constexpr, HAS_SEG: gl.constexpr, MASKED: gl.constexpr,
    HAS_SINKS: gl.constexpr,
    BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, PERSISTENT: gl.constexpr,
    OBUF: gl.constexpr, ORDERED: gl.constexpr, ROWS_MAJOR: gl.constexpr,
    FIXED_SHIFT: gl.constexpr, RESUME: gl.constexpr, KV_PAIR: gl.constexpr,
    INTERPRET: gl.constexpr,
):  # fmt: skip
    """out [B, T, N, H], lse [B, N, T] (natural log). ``QK`` = softmax scale · log2(e);
    ``ranges_ptr``: the forward block table (``[blocks, 4]``, ``[B, blocks, 4]`` with
    segment ids); ``prev_o_ptr``, ``prev_lse_ptr``: with ``RESUME``, a previous call's
    output and lse of the same rows (``o_ptr`` and ``lse_ptr`` alias them: a tile that
    sees no key here leaves them as they are); ``order_ptr``: with ``ORDERED``, the tiles in the order programs take
    them (`flash._schedule.launch_order`); ``counter_ptr``: one int32, zero on entry, the
    persistent programs' counter of places in the order (`_producer`; ``counter_in_ptr``,
    unused, is the buffer it starts as: the table kernel's zero, or a stand-in);
    ``scratch_ptr`` holds the TMA descriptors (see _jax_triton_fix);
    INTERPRET is unused. A one-dimensional grid: one program per tile, or with
    ``PERSISTENT`` (T and S on whole tiles) fewer programs, each looping over the tiles it
    takes from the counter, so that a tile's first copies overlap the previous one's
    epilogue."""
    NC: gl.constexpr = BM // 64
    F: gl.constexpr = GluonOptions(
        T=T, S=S, BN=BN, STAGES=STAGES, QK=QK, SOFT_CAP=SOFT_CAP, CAP_IN=CAP_IN, CAP_OUT=CAP_OUT,
        CAUSAL=CAUSAL, WINDOW_LEFT=WINDOW_LEFT, WINDOW_RIGHT=WINDOW_RIGHT, VARLEN=VARLEN,
        SEQ_IDS=SEQ_IDS, HAS_SEG=HAS_SEG, MASKED=MASKED, TABLE=WINDOW_LEFT >= 0 or VARLEN or HAS_SEG,
        EARLY_P16=PERSISTENT or WINDOW_LEFT >= 0 or VARLEN or HAS_SEG or S % BN != 0,
        B=B, N=N, H=H, G=G, BM=BM, NC=NC, PERSISTENT=PERSISTENT,
        PARTIAL=PERSISTENT and T % BM != 0, OBUF=OBUF, ORDERED=ORDERED,
        ROWS_MAJOR=ROWS_MAJOR, FIXED_SHIFT=FIXED_SHIFT, RESUME=RESUME, KV_PAIR=KV_PAIR,
    )  # fmt: skip
    ROWS_C: gl.constexpr = BM // NC  # a consumer's rows
    K: gl.constexpr = N // G
    n_m: gl.constexpr = (T + BM - 1) // BM
    total: gl.constexpr = B * N * n_m
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    smem_layout: gl.constexpr = gl.NVMMASharedLayout(
        swizzle_byte_width=128, element_bitwidth=16, rank=2
    )
    if PERSISTENT:  # the whole tensors, rows of every (batch, token), columns of every head
        q_desc = tma.make_tensor_descriptor(
            q_ptr, [B * T, N * H], [N * H, 1], [ROWS_C, H], smem_layout
        )
        o_desc = tma.make_tensor_descriptor(
            o_ptr, [B * T, N * H], [N * H, 1], [ROWS_C, H], smem_layout
        )
        # (``KV_PAIR``: k's and v's columns alternate by H, so v's start H on and a tile of
        # either sits at the same coordinates)
        KV_COLS: gl.constexpr = 2 * K * H if KV_PAIR else K * H
        V_OFF: gl.constexpr = H if KV_PAIR else 0
        k_desc = tma.make_tensor_descriptor(
            k_ptr, [B * S, KV_COLS], [KV_COLS, 1], [BN, H], smem_layout
        )
        v_desc = tma.make_tensor_descriptor(
            v_ptr + V_OFF, [B * S, KV_COLS - V_OFF], [KV_COLS, 1], [BN, H], smem_layout
        )
    else:  # this program's (batch, head): TMA zero-fills and clips rows past T and S
        tile0 = gl.load(order_ptr + gl.program_id(0)) if ORDERED else gl.program_id(0)
        where = _tile(tile0, n_m, F)
        b = where[0].to(gl.int64)
        n = where[1]
        q_base = b * T * N * H + n * H
        q_desc = tma.make_tensor_descriptor(
            q_ptr + q_base, [T, H], [N * H, 1], [ROWS_C, H], smem_layout
        )
        o_desc = tma.make_tensor_descriptor(
            o_ptr + q_base, [T, H], [N * H, 1], [ROWS_C, H], smem_layout
        )
        k_desc, v_desc = pair_descriptors(
            k_ptr, v_ptr, b, n // G, S, K, H, [BN, H], smem_layout, KV_PAIR
        )
    q_smem = gl.allocate_shared_memory(dtype, [NC, ROWS_C, H], smem_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BN, H], smem_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BN, H], smem_layout)
    if OBUF:
        o_smem = gl.allocate_shared_memory(dtype, [NC, ROWS_C, H], smem_layout)
    else:  # o leaves through q's buffer
        o_smem = q_smem
    # q: ready per consumer's rows (one arrival + bytes), empty once every consumer stored
    # its output through it; k and v: ready per slot, empty once every consumer released it.
    q_ready = barriers(NC, 1)
    q_empty = barriers(1, NC).index(0)
    kv_bars = (barriers(STAGES, 1), barriers(STAGES, NC), barriers(STAGES, 1),
               barriers(STAGES, NC))  # fmt: skip
    # The schedule ring: tile ids from the producer to the consumers (persistent programs).
    tiles = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    sched = (tiles, barriers(2, 1), barriers(2, NC))
    hopper.fence_async_shared()  # the barriers' initialisation before TMA signals them
    smem = (q_smem, k_smem, v_smem, o_smem)
    bars = (q_ready, q_empty, kv_bars)
    descs = (q_desc, k_desc, v_desc)
    dest = (o_desc, lse_ptr)  # where o and lse go
    prev = (prev_o_ptr, prev_lse_ptr)  # where resumed rows start (``RESUME``)
    if PERSISTENT:  # programs take their tiles in `_producer`
        first = (0, (0, 0, 0, 0))
    else:  # the one tile and its key range
        first = (tile0, _key_blocks(ranges_ptr, where[0], where[3], n_m, F))
    tabs = ((qsid_ptr, qpos_ptr, qseg_ptr), (ksid_ptr, kpos_ptr, kseg_ptr))  # rows', keys' tables
    consumer = (smem, bars, dest, sinks_ptr, prev, ranges_ptr, first, sched)
    sched_ptrs = (order_ptr, counter_ptr)
    if NC == 3:
        # Three consumers (192-row tiles) get 160 registers a thread (the default partition
        # what is left, 168), the producer's warpgroup 24: 128 · (168 + 160 + 160 + 24)
        # <= 64 Ki.
        gl.warp_specialize(
            [(_consumer, (consumer, total, n_m, tabs, F, HAS_SINKS, 0)),
             (_consumer, (consumer, total, n_m, tabs, F, HAS_SINKS, 1)),
             (_consumer, (consumer, total, n_m, tabs, F, HAS_SINKS, 2)),
             (_producer, (descs, smem, bars, ranges_ptr, first, sched, sched_ptrs, total, n_m,
                          F))],
            [4, 4, 1],
            [160, 160, 24],
        )  # fmt: skip
    else:
        # Two consumers get 240 registers a thread (the default partition gets what is
        # left: 240), the producer 24: 128 · (240 + 240 + 24) <= 64 Ki. ptxas spills at 232.
        gl.warp_specialize(
            [(_consumer, (consumer, total, n_m, tabs, F, HAS_SINKS, 0)),
             (_consumer, (consumer, total, n_m, tabs, F, HAS_SINKS, 1)),
             (_producer, (descs, smem, bars, ranges_ptr, first, sched, sched_ptrs, total, n_m,
                          F))],
            [4, 1],
            [240, 24],
        )  # fmt: skip
