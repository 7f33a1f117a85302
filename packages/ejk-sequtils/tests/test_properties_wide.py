"""Wide property tests: drawn shapes as well as values (each shape compiles anew: slow)."""

import pathlib
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ejk_sequtils as es

pytestmark = pytest.mark.slow
WIDE = settings(max_examples=100, deadline=None)


@WIDE
@given(st.lists(st.integers(0, 40), min_size=1, max_size=20), st.integers(0, 30))
def test_per_token_views_any_shape(lens, extra):
    # At least one sequence: cu_seqlens has >= 2 entries, as validate_attention requires.
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    total = int(cu[-1]) + extra
    ref_seq = [s for s, n in enumerate(lens) for _ in range(n)] + [-1] * extra
    ref_pos = [p for n in lens for p in range(n)] + [0] * extra
    assert es.prepare_sequence_ids(cu, total_length=total).tolist() == ref_seq
    assert es.prepare_position_ids(cu, total_length=total).tolist() == ref_pos
    segment_ids = es.cu_seqlens_to_segment_ids(cu, total_length=total)
    assert segment_ids.tolist() == ref_seq  # the sequence index, -1 for padding
    nonempty = [0, *np.cumsum([n for n in lens if n]).tolist()]
    assert es.segment_ids_to_cu_seqlens(segment_ids).tolist() == nonempty
    assert es.segment_ids_to_position_ids(segment_ids).tolist() == ref_pos


@WIDE
@given(
    st.integers(1, 300).flatmap(
        lambda q: st.tuples(
            st.lists(st.integers(-2, 6), min_size=q, max_size=q),
            st.lists(st.integers(-2, 6), min_size=1, max_size=300),
        )
    )
)
def test_mask_round_trip_any_shape(ids):
    q, kv = (np.array(v, np.int32)[None] for v in ids)
    mask = es.segment_ids_to_mask((q, kv))
    q_ids, kv_ids = es.mask_to_segment_ids(mask)
    np.testing.assert_array_equal(es.segment_ids_to_mask((q_ids, kv_ids)), mask)
    assert bool(es.is_segment_representable(mask)[0])


def test_benchmark_script_runs():
    script = pathlib.Path(__file__).parents[1] / "benchmarks" / "bench_sequtils.py"
    out = subprocess.run(
        [sys.executable, str(script), "--sizes", "64", "--pack-sizes", "512", "--repeats", "1"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert "| mask_to_segment_ids | 64 |" in out
