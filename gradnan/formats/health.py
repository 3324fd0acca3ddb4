"""NVML's reading of a device at an incident (a record's ``device_health``) in words: what in it points at
the device itself (hardware throttling is a sign; software caps, power, thermal and idling are not), the
verdict's evidence line, and the line printed beside a device to drain.
"""

from __future__ import annotations

from typing import Any, Mapping, Tuple

from .text import listing, untrusted

# NVML's reading of a device at an incident (a record's ``device_health``): what in it points at the
# device itself. Hardware throttling is a sign; software caps (power, thermal) and idling are not.
_HARDWARE_THROTTLE = ("hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown")


_COUNTED_SIGNS = (
    ("ecc_volatile_uncorrected", "{n} uncorrected ECC error(s) since the driver loaded"),
    ("ecc_aggregate_uncorrected", "{n} uncorrected ECC error(s) in the device's lifetime"),
    ("retired_pages_double_bit", "{n} page(s) retired for double-bit ECC errors"),
    ("remapped_rows_uncorrectable", "{n} memory row(s) remapped for uncorrectable errors"),
)


_FLAGGED_SIGNS = (
    ("retired_pages_pending", "a page retirement pending (it takes effect at the device's next reset)"),
    ("remapped_rows_pending", "a row remapping pending (it takes effect at the device's next reset)"),
    ("remapped_rows_failed", "a row remapping failed"),
)


def _listed(values: Mapping[str, Any], key: str) -> list:
    """A list value of a reading (a file may hold anything a reader let through: a list of integers or
    text, or something else, read as none)."""
    items = values.get(key)
    return items if isinstance(items, list) else []


def health_signs(values: Mapping[str, Any]) -> Tuple[str, ...]:
    """What in NVML's reading of a device points at the device: XID errors, uncorrected ECC errors,
    retired or remapped memory, pending or failed repairs, clocks throttled by the hardware."""
    xids = _listed(values, "xid_errors")
    signs = [f"XID error(s) {listing(xids)}"] if xids else []
    signs += [words.format(n=values[key]) for key, words in _COUNTED_SIGNS
              if type(values.get(key)) is int and values[key] > 0]
    signs += [words for key, words in _FLAGGED_SIGNS if values.get(key) is True]
    throttled = [reason for reason in _listed(values, "throttle_reasons") if reason in _HARDWARE_THROTTLE]
    if throttled:
        signs.append(f"clocks throttled by the hardware ({listing(throttled)})")
    return tuple(signs)


def health_evidence(where: str, signs: Tuple[str, ...], unread: int) -> str:
    """A verdict's evidence line from NVML's reading of an origin device (``where``: host, device, rank)."""
    if signs:
        return f"NVML at the incident on {where}: {'; '.join(signs)}: signs of a device fault"
    partly = f" (in what it could read; {unread} value(s) not read)" if unread else ""
    return (f"NVML at the incident on {where}: no XID error, uncorrected ECC error, retired or remapped"
            f" memory or hardware throttling{partly}")


_HEALTH_UNITS = (("temperature_c", "{} C"), ("power_w", "{} W"), ("sm_clock_mhz", "SM {} MHz"),
                 ("mem_clock_mhz", "memory {} MHz"))


def health_line(values: Mapping[str, Any], unread: Mapping[str, str]) -> str:
    """NVML's reading as the report prints it beside the device to drain, every value NVML gave."""
    parts = [unit.format(untrusted(values[key])) for key, unit in _HEALTH_UNITS if key in values]
    if "throttle_reasons" in values:
        parts.append(f"throttle: {listing(_listed(values, 'throttle_reasons')) or 'none'}")
    ecc = [f"{key.removeprefix('ecc_').replace('_', ' ')} {values[key]}" for key in values
           if key.startswith("ecc_")]
    if ecc:
        parts.append("ECC " + listing(ecc))
    parts.append(listing(f"{key.replace('_', ' ')} {values[key]}" for key in values
                         if key.startswith(("retired_pages_", "remapped_rows_"))))
    if "xid_errors" in values:
        parts.append(f"XID: {listing(_listed(values, 'xid_errors')) or 'none'}")
    if unread:
        parts.append("not read: " + listing(f"{key} ({reason})" for key, reason in unread.items()))
    return "; ".join(part for part in parts if part)
