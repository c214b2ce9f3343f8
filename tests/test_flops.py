"""The FLOP count the benchmarks report (FlashAttention's convention), by hand."""
import pytest

from cuflash.flops import attention_flops


def test_forward_backward_and_causal_by_hand():
    # B=2, H=3, Nq=5, Nk=7, d=11: two matmuls of 5·7·11 multiply-adds per head.
    fwd = 2 * 3 * (2 * 2 * 5 * 7 * 11)
    assert attention_flops(2, 3, 5, 7, 11, causal=False) == fwd
    assert attention_flops(2, 3, 5, 7, 11, causal=True) == fwd / 2
    assert attention_flops(2, 3, 5, 7, 11, causal=False, pass_="bwd") == 2.5 * fwd
    assert attention_flops(2, 3, 5, 7, 11, causal=True, pass_="fwd+bwd") == 3.5 * fwd / 2


def test_unknown_pass_is_named():
    with pytest.raises(ValueError, match="pass_"):
        attention_flops(1, 1, 1, 1, 1, causal=False, pass_="backward")
