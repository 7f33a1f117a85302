import msgspec
import pytest

from ejk_config import BwdParams, FwdParams, from_json, to_dict, to_json


def test_defaults_are_unset_and_frozen():
    cfg = FwdParams()
    assert all(v is None for v in to_dict(cfg).values())
    with pytest.raises(AttributeError):
        cfg.num_warps = 4  # type: ignore[misc]


def test_fields_match_the_seed():
    assert FwdParams.__struct_fields__ == (
        "blocksize_m", "blocksize_k", "blocksize_n", "q_blocksize", "kv_blocksize",
        "blocksize_heads", "blocksize_keys", "num_key_splits", "num_warps", "num_stages",
    )  # fmt: skip
    assert BwdParams.__struct_fields__ == (
        "blocksize_m", "blocksize_k", "blocksize_n", "q_blocksize", "kv_blocksize",
        "num_warps", "num_stages",
    )  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"q_blocksize": 0},
            ValueError,
            r"FwdParams.q_blocksize must be positive, got q_blocksize=0",
        ),
        ({"kv_blocksize": -64}, ValueError, r"kv_blocksize must be positive, got kv_blocksize=-64"),
        ({"num_warps": 3}, ValueError, r"num_warps must be a power of two, got num_warps=3"),
        ({"num_stages": 2.0}, TypeError, r"num_stages must be an int or None, got 2.0"),
        ({"blocksize_m": True}, TypeError, r"blocksize_m must be an int or None, got True"),
    ],
)
def test_validation_names_field_and_value(kwargs, error, match):
    with pytest.raises(error, match=match):
        FwdParams(**kwargs)


def test_unknown_field_is_rejected():
    with pytest.raises(TypeError, match="num_key_splits"):
        BwdParams(num_key_splits=2)  # type: ignore[call-arg]


def test_merge_override_wins_where_set():
    base = FwdParams(q_blocksize=128, kv_blocksize=64, num_warps=4)
    merged = FwdParams.merge(base, FwdParams(kv_blocksize=32, num_stages=3))
    assert merged == FwdParams(q_blocksize=128, kv_blocksize=32, num_warps=4, num_stages=3)
    assert FwdParams.merge(None, base) == base == FwdParams.merge(base, None)
    with pytest.raises(TypeError, match="override must be a FwdParams"):
        FwdParams.merge(base, BwdParams())  # type: ignore[arg-type]


def test_bwd_from_fwd_scales_blocks_keeps_warps():
    fwd = FwdParams(q_blocksize=128, kv_blocksize=96, blocksize_heads=2, num_warps=8, num_stages=3)
    bwd = BwdParams.from_fwd_params(fwd)
    assert bwd == BwdParams(q_blocksize=64, kv_blocksize=48, num_warps=8, num_stages=3)
    assert BwdParams.from_fwd_params(FwdParams(q_blocksize=1), scale=0.25).q_blocksize == 1
    with pytest.raises(ValueError, match="scale must be a positive number, got scale=0"):
        BwdParams.from_fwd_params(fwd, scale=0)


def test_json_round_trip_and_validation_on_decode():
    cfg = BwdParams(q_blocksize=64, num_warps=4)
    text = to_json(cfg)
    assert from_json(text, BwdParams) == cfg
    assert to_json(from_json(text, BwdParams)) == text
    with pytest.raises(ValueError, match="power of two"):
        from_json('{"num_warps": 6}', BwdParams)
    with pytest.raises(ValueError, match=r"Expected `int \| null`, got `str`"):
        from_json('{"num_warps": "4"}', BwdParams)
    with pytest.raises(ValueError, match="not valid JSON"):
        from_json("{", BwdParams)
    assert isinstance(FwdParams(), msgspec.Struct)


def test_to_dict_rejects_other_types():
    with pytest.raises(TypeError, match="to_dict expects"):
        to_dict(3)
