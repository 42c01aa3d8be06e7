"""Parsing and printing of sizes and times.

Inside parsim everything is SI: seconds, bytes, FLOP. Sizes are accepted the way
people write them (``1GiB``, ``512MB``, ``4096``); bandwidth is printed in GB/s
(1e9 bytes per second), as nccl-tests does.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Iterable

from .errors import ParsimError

_SIZE_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
    "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40,
}
MAX_SIZE = 2**60  # 1 EiB: more than any machine's memory, so a larger size is a typo
MAX_SWEEP_SIZES = 1000
# The exponent is kept to four digits: exact arithmetic on 1e-99999999 would build a 100-million-digit integer.
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]{1,4})?)\s*([A-Za-z]*)\s*$")
_SIZE_EXAMPLES = "a number of bytes with an optional unit, e.g. 4096, 512MB, 1GiB"


def parse_size(text: str | int | float) -> int:
    """Bytes from ``"1GiB"``, ``"512MB"``, ``"4096"`` or a number.

    A size is a whole number of bytes (``"1.5KiB"`` is 1536; ``"1.5"`` is refused, not rounded), counted
    exactly, so ``"1.1KB"`` is 1100 and not float's 1100.0000000000002; a lowercase ``b`` (``8Gb``) is
    networking's bits and is refused rather than read as bytes.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if not math.isfinite(text) or abs(text) > MAX_SIZE:
            raise ParsimError(f"size {text!r} is not a size in bytes (at most 1 EiB)")
        number = Fraction(text)
    else:
        number = _size_from_text(str(text))
    if number.denominator != 1:
        raise ParsimError(f"size {text!r} is not a whole number of bytes (without a unit a size counts bytes; "
                          f"e.g. 4096, 1.5KiB, 1GiB)")
    if number < 0:
        raise ParsimError(f"size {text!r} is negative")
    return int(number)


def _size_from_text(text: str) -> Fraction:
    """The bytes ``text`` writes, exactly (a fraction until :func:`parse_size` checks it is whole)."""
    if not text.strip():  # (an empty flag, --size '', is a mistake, not a request for the default)
        raise ParsimError(f"size is empty (expected {_SIZE_EXAMPLES})")
    match = _SIZE_RE.match(text)
    unit = match.group(2) if match else ""
    if match is None or unit.upper() not in _SIZE_UNITS:
        raise ParsimError(f"size {text!r} is not understood (expected {_SIZE_EXAMPLES})")
    if unit.endswith("b"):  # 8Gb: networking's gigabits, an eighth of 8GB
        prefix = unit[:-1].upper().removesuffix("I")
        spelled = f"{match.group(1)}{prefix}B or {match.group(1)}{prefix}iB" if prefix else f"{match.group(1)}B"
        raise ParsimError(f"size {text!r}: a lowercase b means bits; write {spelled} (bytes)")
    try:
        number = Fraction(match.group(1)) * _SIZE_UNITS[unit.upper()]
    except ValueError:  # more digits than Python converts (4,300)
        raise ParsimError(f"size {text!r} is not understood (expected {_SIZE_EXAMPLES})") from None
    if number > MAX_SIZE:
        raise ParsimError(f"size {text!r} is more than any machine holds (at most 1 EiB)")
    return number


def parse_size_range(text: str) -> list[int]:
    """Sizes from ``"1KiB:8GiB"`` doubling each step, as nccl-tests' ``-b/-e/-f 2``.

    ``"1MiB:64MiB:4"`` multiplies by 4 instead of 2.
    """
    parts = str(text).split(":")
    if len(parts) not in (2, 3):
        raise ParsimError(f"sweep {text!r} is not understood (expected MIN:MAX or MIN:MAX:FACTOR, e.g. 1KiB:8GiB)")
    low, high = parse_size(parts[0]), parse_size(parts[1])
    factor = 2.0
    if len(parts) == 3:
        try:
            factor = float(parts[2])
        except ValueError:
            factor = 0.0
        if not 1 < factor < math.inf:
            raise ParsimError(f"sweep {text!r}: the factor must be a number above 1")
    if low <= 0 or high < low:
        raise ParsimError(f"sweep {text!r}: need 0 < MIN <= MAX")
    steps = math.floor(math.log(high / low * (1 + 1e-9), factor)) + 1
    if steps > MAX_SWEEP_SIZES:
        raise ParsimError(f"sweep {text!r} has {steps:,} sizes; at most {MAX_SWEEP_SIZES} (use a larger factor)")
    sizes, size = [], float(low)
    while size <= high * (1 + 1e-9):
        sizes.append(int(round(size)))
        size *= factor
    return sizes


def format_size(nbytes: float) -> str:
    """``1073741824`` -> ``"1 GiB"``; powers of two print in binary units."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:,.0f} {unit}" if value == int(value) or value >= 100 else f"{value:.3g} {unit}"
    return f"{nbytes:.0f} B"


def format_time(seconds: float) -> str:
    """Seconds printed with a readable unit: ``"12.3 us"``, ``"4.56 ms"``."""
    if seconds == 0:
        return "0 s"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9)):
        if abs(seconds) >= scale:
            value = seconds / scale
            return f"{value:,.0f} {unit}" if abs(value) >= 1000 else f"{value:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def decimal_unit(largest: float, unit: str) -> tuple[str, float]:
    """``unit`` with the decimal prefix that keeps ``largest`` at 1 or more, from G down to k: ``("GB", 1e9)``,
    ``("MFLOP", 1e6)`` (a tiny model's figures would read 0.00 in G)."""
    prefix, scale = next(((p, f) for p, f in (("G", 1e9), ("M", 1e6)) if largest >= f), ("k", 1e3))
    return prefix + unit, scale


def time_unit(seconds: Iterable[float]) -> tuple[str, float]:
    """One unit for a table column of times, ``("ms", 1e-3)``: the largest of s, ms, us, ns that keeps
    the column's smallest non-zero time at 1 or more, so every row reads in the same unit."""
    smallest = min((abs(t) for t in seconds if t), default=1.0)
    return next(((unit, scale) for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)) if smallest >= scale),
                ("ns", 1e-9))


def size_unit(sizes: Iterable[float]) -> tuple[str, float]:
    """One binary unit for a table column of sizes, ``("MiB", 2**20)``, chosen as :func:`time_unit` does."""
    smallest = min((s for s in sizes if s), default=1)
    return next(((unit, scale) for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
                 if smallest >= scale), ("B", 1))
