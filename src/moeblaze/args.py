"""Checks of constructor arguments, shared by the router, the layers and the model config: each names the
argument and the value it got, and raises at construction (never later, deep inside a forward).
"""
from __future__ import annotations

import math
import numbers


def check_int(name: str, value, minimum: int = 1) -> int:
    """An int (bool excluded) >= minimum: TypeError for another type, ValueError below the minimum."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def check_choice(name: str, value, choices: tuple) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def check_positive(name: str, value) -> float:
    """A positive finite real number: TypeError for another type (bool too), ValueError otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    return value
