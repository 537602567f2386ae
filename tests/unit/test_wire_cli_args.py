"""paramserver.wire.cli_args: the argparse types every CLI shares."""
from __future__ import annotations

import argparse

import pytest

from paramserver.wire.cli_args import float_in, int_in


@pytest.mark.parametrize("text", ["0", "7", " 12 ", "-3"])
def test_int_in_takes_ascii_whole_numbers_in_range(text: str) -> None:
    assert int_in(-5, 12, "--n")(text) == int(text)


@pytest.mark.parametrize("text", ["13", "-6", "1.5", "", "-", "1e3", "٣", "１２", "0x10", "--3"])
def test_int_in_refuses_the_rest_in_one_line_naming_the_range(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=r"^--n must be a whole number from -5 to 12, got "):
        int_in(-5, 12, "--n")(text)


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "0", "x", "2.5"])
def test_float_in_refuses_non_finite_and_out_of_range(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=r"^--t must be a number above 0 and at most 2, got "):
        float_in(0, 2, "--t")(text)
    assert float_in(0, 2, "--t")("0.5") == 0.5
    assert float_in(0, 2, "--t", low_inclusive=True)("0") == 0.0
