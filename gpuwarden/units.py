"""Durations, byte quantities and growth rates as written in a GPUMonitorPolicy.

Each parser accepts exactly what the CRD's pattern accepts, so a policy file read in local mode
means the same as the object the API server stored. They raise ``ValueError`` with a message that
quotes the offending text; :func:`gpuwarden.policy.parse.parse_spec` prefixes the field path.
"""

from __future__ import annotations

import re
from fractions import Fraction

__all__ = [
    "DURATION_PATTERN",
    "RATE_PATTERN",
    "format_duration",
    "parse_duration",
    "parse_quantity",
    "parse_rate",
]

# Gateway API GEP-2257; the CRD's CEL rule on every duration field matches this exact string.
DURATION_PATTERN = r"^([0-9]{1,5}(h|m|s|ms)){1,4}$"
# The CRD's CEL rule on memoryGrowth.rate matches this exact string ([.] rather than an escaped dot,
# which would need double escaping in CEL). The CRD checks `bytes` with CEL's isQuantity(), the
# Kubernetes parser itself, whose grammar _QUANTITY_RE below implements.
RATE_PATTERN = r"^[0-9]+([.][0-9]+)?(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?/(s|m|h)$"

_DURATION_RE = re.compile(DURATION_PATTERN)
# "ms" must be tried before "m": both the CRD pattern and this tokenizer read "5ms" as milliseconds.
_DURATION_PART_RE = re.compile(r"([0-9]{1,5})(ms|h|m|s)")
_DURATION_UNIT_MS = {"h": 3_600_000, "m": 60_000, "s": 1_000, "ms": 1}

# The quantity grammar the Kubernetes parser implements (resource.ParseQuantity): the exponent is an
# integer, although the OpenAPI pattern Kubernetes publishes for Quantity is looser.
_QUANTITY_RE = re.compile(
    r"(?P<sign>[+-])?(?P<number>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
    r"(?:(?P<binary>[KMGTPE]i)|(?P<decimal>[numkMGTPE])|[eE](?P<exponent>[+-]?[0-9]+))?"
)
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 10**3),
    "k": Fraction(10**3),
    "M": Fraction(10**6),
    "G": Fraction(10**9),
    "T": Fraction(10**12),
    "P": Fraction(10**15),
    "E": Fraction(10**18),
}
# Far beyond int64 either way; checked before computing 10**exponent so "1e999999999" stays cheap.
_MAX_EXPONENT = 40
_MAX_BYTES = 2**63 - 1  # the API server stores quantities as int64

_RATE_RE = re.compile(r"(?P<amount>[0-9]+(?:\.[0-9]+)?)(?P<suffix>Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?/(?P<unit>[smh])")
_RATE_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600}


def parse_duration(text: str) -> float:
    """Parse a GEP-2257 duration such as ``10s``, ``5m``, ``1h30m`` or ``250ms`` into seconds.

    Components may repeat or come in any order (``1m1h`` is 3660 s), as the pattern allows.
    """
    if not isinstance(text, str) or not _DURATION_RE.fullmatch(text):
        raise ValueError(f"{_quote(text)} is not a duration such as 10s, 5m or 1h30m (units h, m, s, ms)")
    total_ms = sum(int(n) * _DURATION_UNIT_MS[unit] for n, unit in _DURATION_PART_RE.findall(text))
    return total_ms / 1000


def format_duration(seconds: float) -> str:
    """Format seconds as the canonical GEP-2257 string (``5400`` -> ``1h30m``), rounded to milliseconds.

    The inverse of :func:`parse_duration` for any duration it can express.
    """
    total_ms = round(seconds * 1000)
    if total_ms < 0:
        raise ValueError(f"a duration cannot be negative: {seconds}")
    hours, rest = divmod(total_ms, 3_600_000)
    if hours > 99_999:
        raise ValueError(f"{seconds} s is too long for a GEP-2257 duration (at most 99999h)")
    minutes, rest = divmod(rest, 60_000)
    secs, millis = divmod(rest, 1_000)
    parts = [f"{v}{u}" for v, u in ((hours, "h"), (minutes, "m"), (secs, "s"), (millis, "ms")) if v]
    return "".join(parts) or "0s"


def parse_quantity(value: str | int) -> int:
    """Parse a Kubernetes quantity that counts bytes (``80Gi``, ``120G``, ``1.5Ki``, ``8e9``) into an int.

    Implements the full quantity grammar (binary and decimal suffixes, decimal exponents). Rejects
    negative sizes, fractional bytes (``1.5``, ``100m``) and sizes beyond int64.
    """
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a quantity such as 120Gi")
    amount = Fraction(value) if isinstance(value, int) else _quantity_amount(value)
    if amount < 0:
        raise ValueError(f"{_quote(value)} is negative; a byte size must not be")
    if amount.denominator != 1:
        raise ValueError(f"{_quote(value)} is not a whole number of bytes")
    if amount > _MAX_BYTES:
        raise ValueError(f"{_quote(value)} is too large (at most 2^63-1 bytes)")
    return int(amount)


def parse_rate(text: str) -> float:
    """Parse a growth rate such as ``100Mi/m`` (a byte quantity per s, m or h) into bytes per second.

    The rate must be greater than zero.
    """
    match = _RATE_RE.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        raise ValueError(f"{_quote(text)} is not a quantity per time unit such as 100Mi/m")
    amount = Fraction(match["amount"])
    suffix = match["suffix"]
    if suffix:
        amount *= _BINARY[suffix] if suffix in _BINARY else _DECIMAL[suffix]
    if amount == 0:
        raise ValueError(f"{_quote(text)} must be greater than zero")
    return float(amount / _RATE_UNIT_SECONDS[match["unit"]])


def _quantity_amount(text: str) -> Fraction:
    """The exact value of a quantity string, or ValueError."""
    match = _QUANTITY_RE.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        raise ValueError(f"{_quote(text)} is not a quantity such as 120Gi, 80G or 85899345920")
    amount = Fraction(match["number"])
    if match["binary"]:
        amount *= _BINARY[match["binary"]]
    elif match["decimal"]:
        amount *= _DECIMAL[match["decimal"]]
    elif match["exponent"]:
        exponent = int(match["exponent"])
        if abs(exponent) > _MAX_EXPONENT:
            raise ValueError(f"{_quote(text)} has an exponent out of range")
        amount *= Fraction(10) ** exponent
    return -amount if match["sign"] == "-" else amount


def _quote(value: object) -> str:
    """Render a user-supplied value for an error message: strings in double quotes, others as repr."""
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)
