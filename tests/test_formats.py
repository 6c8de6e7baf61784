"""KVFormat: validation, derived sizes, storage shapes."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

import bitdecode as bd
from bitdecode import reference
from bitdecode.formats import model_head_dim


def test_defaults_and_derived_sizes():
    fmt = bd.KVFormat()
    assert (fmt.bits, fmt.k_mode, fmt.group_size) == (4, "channel", 128)
    assert fmt.residual_block == 128 and fmt.qmax == 15 and fmt.codes_per_word == 8
    two = bd.KVFormat(bits=2, k_mode="token", group_size=32)
    assert two.residual_block == 256 and two.qmax == 3 and two.codes_per_word == 16
    assert "2-bit" in two.describe() and "residual block 256" in two.describe()


def test_immutable_hashable_and_residual_block_is_derived():
    fmt = bd.KVFormat(bits=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fmt.bits = 4
    with pytest.raises(TypeError, match="residual_block"):
        bd.KVFormat(residual_block=64)
    for flag in ("yes", 1, None):  # hadamard="false" would quietly turn the rotation on
        with pytest.raises(ValueError, match=f"KVFormat.hadamard must be True or False, got {flag!r}"):
            bd.KVFormat(hadamard=flag)
    assert fmt == bd.KVFormat(bits=2) and len({fmt, bd.KVFormat(bits=2), bd.KVFormat()}) == 2


@pytest.mark.parametrize(
    "field,value,allowed",
    [
        ("bits", 3, r"\(4, 2\)"),
        ("bits", 8, r"\(4, 2\)"),
        ("bits", True, r"\(4, 2\)"),
        ("bits", 4.0, r"\(4, 2\)"),
        ("bits", "4", r"\(4, 2\)"),
        ("k_mode", "chan", r"\('channel', 'token'\)"),
        ("group_size", 16, r"\(32, 64, 128\)"),
        ("group_size", 256, r"\(32, 64, 128\)"),
        ("group_size", 128.0, r"\(32, 64, 128\)"),
    ],
)
def test_invalid_fields(field, value, allowed):
    with pytest.raises(ValueError, match=rf"KVFormat\.{field} must be one of {allowed}, got {value!r}"):
        bd.KVFormat(**{field: value})


def test_none_means_the_default():
    """k_mode and group_size left out (None): K per channel, groups of 128 (an FP4 format
    takes its own, test_fp4.py)."""
    assert bd.KVFormat(k_mode=None, group_size=None) == bd.KVFormat() == bd.KVFormat(4, "channel", 128)


def test_head_dim_checks():
    fmt = bd.KVFormat(group_size=128)
    fmt.check_head_dim(128)
    fmt.check_head_dim(256)
    bd.KVFormat(group_size=64).check_head_dim(64)
    with pytest.raises(ValueError, match=r"head_dim must be one of \(64, 128, 256\), got 96"):
        fmt.check_head_dim(96)
    with pytest.raises(ValueError, match="group_size=128 groups channels of V, so it must not exceed head_dim=64"):
        fmt.check_head_dim(64)
    with pytest.raises(ValueError, match="channels of V and K"):
        bd.KVFormat(k_mode="token").check_head_dim(64)


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("k_mode", ["channel", "token"])
def test_shapes_match_what_the_reference_packs(bits, k_mode):
    fmt = bd.KVFormat(bits=bits, k_mode=k_mode, group_size=64)
    heads, page, d = 3, 2 * fmt.residual_block, 128
    x = torch.zeros(heads, page, d, dtype=torch.float16)
    k_pack, k_params = reference.pack_k(x, fmt)
    v_pack, v_params = reference.pack_v(x, fmt)
    assert fmt.k_pack_shape(5, heads, page, d) == (5, *k_pack.shape)
    assert fmt.k_params_shape(5, heads, page, d) == (5, *k_params.shape)
    assert fmt.v_pack_shape(5, heads, page, d) == (5, *v_pack.shape)
    assert fmt.v_params_shape(5, heads, page, d) == (5, *v_params.shape)
    words = (k_pack.numel() + k_params.numel() + v_pack.numel() + v_params.numel()) / (heads * page)
    assert fmt.bytes_per_token(d) == 4 * words


def test_tiles_round_up_to_whole_residual_blocks():
    assert [bd.KVFormat(bits=4).tiles(n) for n in (0, 1, 128, 129)] == [0, 1, 1, 2]
    assert [bd.KVFormat(bits=2).tiles(n) for n in (255, 256, 257)] == [1, 1, 2]


def test_model_head_dim_from_a_config():
    assert model_head_dim(SimpleNamespace(head_dim=128)) == 128
    assert model_head_dim(SimpleNamespace(hidden_size=512, num_attention_heads=8)) == 64
    assert model_head_dim(SimpleNamespace(head_dim=0, hidden_size=512, num_attention_heads=8)) == 64
    assert model_head_dim(SimpleNamespace(head_dim=None, hidden_size=100, num_attention_heads=3)) is None
    assert model_head_dim(SimpleNamespace()) is None
