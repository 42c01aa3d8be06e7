"""Sizes and times as parsim prints them: three significant figures, never an exponent."""

from parsim.units import format_size, format_time


def test_sizes_and_times_print_without_exponents():
    assert format_size(2**30) == "1 GiB" and format_size(1.5 * 2**20) == "1.5 MiB"
    assert format_size(1002.5 * 2**20) == "1,002 MiB"  # was 1e+03 MiB
    assert format_time(0.0123) == "12.3 ms" and format_time(0) == "0 s"
    assert format_time(1234.0) == "1,234 s" and format_time(-1234.0) == "-1,234 s"  # was 1.23e+03 s
