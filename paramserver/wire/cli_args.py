"""What every command line of this project shares: usage errors as one line, and number types.

argparse prints its whole usage block (a dozen lines) before a usage error; the CLIs promise one
line and exit 2, ``PROG: error: what is wrong; see 'PROG --help'``. Subcommand parsers inherit the
class (argparse makes them with the parent's type), so ``paramctl pull`` says so too.
"""
from __future__ import annotations

import argparse
from typing import Callable, NoReturn

USAGE_EXIT = 2  # the documented "bad arguments" exit code of every CLI


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line naming the problem and ``--help``."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_EXIT, f"{self.prog}: error: {message}; see '{self.prog} --help'\n")


def int_in(low: int, high: int, what: str) -> Callable[[str], int]:
    """An argparse type: a decimal integer in [low, high], else one line naming the range."""
    def parse(text: str) -> int:
        t = text.strip()
        digits = t.removeprefix("-")
        if not (digits.isascii() and digits.isdigit()) or not low <= int(t) <= high:  # int() takes any script's digits
            raise argparse.ArgumentTypeError(f"{what} must be a whole number from {low} to {high}, got {text!r}")
        return int(t)

    return parse


def float_in(low: float, high: float, what: str, *, low_inclusive: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number in (low, high], or [low, high] with ``low_inclusive``."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        above = low <= value if low_inclusive else low < value
        if not (above and value <= high):  # also refuses nan and inf
            bound = f"from {low:g}" if low_inclusive else f"above {low:g}"
            raise argparse.ArgumentTypeError(f"{what} must be a number {bound} and at most {high:g}, got {text!r}")
        return value

    return parse


__all__ = ["OneLineParser", "USAGE_EXIT", "float_in", "int_in"]
