"""The health of this rank's GPU as NVML reports it (``pynvml``, package nvidia-ml-py), read at an incident
and written into that rank's incident records (``device_health``): XID errors since the run started, ECC
counts, retired pages and remapped rows, clocks and throttle reasons, temperature and power. Evidence for
or against a device fault, read on the device itself when the fault is fresh.

Nothing here runs on a healthy step: the device is found and its XID events are subscribed to once, when
the optimizer is built; the counters are read only when an incident record is written (once per step, at
most ``MAX_READ_STEPS`` steps a run). NVML is optional: where it cannot be imported, cannot start, or runs
no device for this process, no field is written and the log says why once per node, at the first
incident. Each value NVML refuses (not
supported, no permission, a driver error) is named in ``unread`` with NVML's reason: a read never raises
into training.
"""

from __future__ import annotations

import importlib
import logging
import os
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..log import logger

MAX_READ_STEPS = 8  # steps whose records carry a reading: the first incident, and the few after it
MAX_XID_EVENTS = 32  # XID errors kept from the run's start (an XID storm repeats one code)

# NVML's clock throttle (event) reason bits, by the name the record uses
THROTTLE_REASONS = (
    (0x1, "gpu_idle"), (0x2, "applications_clocks_setting"), (0x4, "sw_power_cap"), (0x8, "hw_slowdown"),
    (0x10, "sync_boost"), (0x20, "sw_thermal_slowdown"), (0x40, "hw_thermal_slowdown"),
    (0x80, "hw_power_brake_slowdown"), (0x100, "display_clock_setting"))
XID_EVENT = 0x8  # nvmlEventTypeXidCriticalError
NVML_TIMEOUT = 10  # NVML_ERROR_TIMEOUT: no event pending


def nvml_reason(error: Exception) -> str:
    """NVML's refusal as one line: ``NVMLError_NotSupported: Not Supported``."""
    return f"{type(error).__name__}: {error}"


def throttle_names(mask: int) -> List[str]:
    """The throttle reasons set in NVML's bit mask; bits NVML may add later by their value."""
    names = [name for bit, name in THROTTLE_REASONS if mask & bit]
    unknown = mask & ~sum(bit for bit, _ in THROTTLE_REASONS)
    return names + ([f"0x{unknown:x}"] if unknown else [])


def _readings(nvml: Any, handle: Any) -> List[Tuple[str, Callable[[], Any]]]:
    """Each value a record carries, and how NVML reads it (one call each, so one refusal costs one)."""
    ecc = [(f"ecc_{counter}_{kind}",
            lambda c=counter_type, k=kind_type: nvml.nvmlDeviceGetTotalEccErrors(handle, k, c))
           for counter, counter_type in (("volatile", 0), ("aggregate", 1))
           for kind, kind_type in (("corrected", 0), ("uncorrected", 1))]
    return [
        ("temperature_c", lambda: nvml.nvmlDeviceGetTemperature(handle, 0)),
        ("power_w", lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0),
        ("sm_clock_mhz", lambda: nvml.nvmlDeviceGetClockInfo(handle, 1)),
        ("mem_clock_mhz", lambda: nvml.nvmlDeviceGetClockInfo(handle, 2)),
        ("throttle_reasons", lambda: throttle_names(nvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle))),
        *ecc,
        ("retired_pages_single_bit", lambda: len(nvml.nvmlDeviceGetRetiredPages(handle, 0))),
        ("retired_pages_double_bit", lambda: len(nvml.nvmlDeviceGetRetiredPages(handle, 1))),
        ("retired_pages_pending", lambda: bool(nvml.nvmlDeviceGetRetiredPagesPendingStatus(handle))),
        ("remapped_rows", lambda: _remapped_rows(nvml.nvmlDeviceGetRemappedRows(handle))),
    ]


def _remapped_rows(rows: Tuple[int, int, int, int]) -> Dict[str, Any]:
    correctable, uncorrectable, pending, failed = rows
    return {"correctable": int(correctable), "uncorrectable": int(uncorrectable), "pending": bool(pending),
            "failed": bool(failed)}


def read_health(nvml: Any, handle: Any) -> Tuple[Dict[str, Any], Dict[str, str]]:
    """Every value NVML gives for the device (``values``), and the reason for each it refused
    (``unread``)."""
    values: Dict[str, Any] = {}
    unread: Dict[str, str] = {}
    for name, read in _readings(nvml, handle):
        try:
            value = read()
        except (nvml.NVMLError, AttributeError) as error:  # AttributeError: an older pynvml lacks it
            unread[name] = nvml_reason(error)
            continue
        if name == "remapped_rows":
            values.update((f"remapped_rows_{key}", item) for key, item in value.items())
        else:
            values[name] = value
    return values, unread


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class DeviceHealth:
    """This process's GPU in NVML, found once (``start``), read at incidents (``at``)."""

    def __init__(self) -> None:
        self._started = False
        self._nvml: Any = None
        self._handle: Any = None
        self._device: Dict[str, Any] = {}
        self._events: Any = None
        self._xids: List[int] = []
        self._events_unread: Optional[str] = None
        self._read: Dict[int, Optional[Dict[str, Any]]] = {}
        self._unavailable: Optional[str] = None
        self._local_rank = 0

    def start(self, device: str, local_rank: int) -> None:
        """Find this process's device in NVML and subscribe to its XID errors; once. ``device``: the rank's
        device as its records name it (``cuda:N``; ``cpu``)."""
        if self._started:
            return
        self._started = True
        self._local_rank = local_rank
        self._unavailable = self._open(device)
        if self._unavailable is not None:
            self._nvml = None

    def _open(self, device: str) -> Optional[str]:
        """Why NVML cannot report on this process's device, or None once it can."""
        try:
            nvml = importlib.import_module("pynvml")
        except ImportError:
            return "pynvml is not importable: pip install nvidia-ml-py"
        try:
            nvml.nvmlInit()
            found = self._find(nvml, device)
        except nvml.NVMLError as error:
            return f"NVML: {nvml_reason(error)}"
        if found is None:
            return f"no GPU in NVML runs this process (its device: {device})"
        self._nvml, (self._handle, index) = nvml, found
        self._device = {"index": index, **self._named(nvml)}
        self._subscribe(nvml)
        return None

    def _find(self, nvml: Any, device: str) -> Optional[Tuple[Any, int]]:
        """The device whose compute processes include this one (NVML's own view, also under
        CUDA_VISIBLE_DEVICES); else, where the PID is not visible (another PID namespace), the device
        torch runs this rank on, by its UUID."""
        handles = [nvml.nvmlDeviceGetHandleByIndex(index) for index in range(nvml.nvmlDeviceGetCount())]
        pid = os.getpid()
        for index, handle in enumerate(handles):
            try:
                if any(process.pid == pid for process in nvml.nvmlDeviceGetComputeRunningProcesses(handle)):
                    return handle, index
            except nvml.NVMLError:
                continue
        uuid = _torch_uuid(device)
        for index, handle in enumerate(handles):
            if uuid is not None and _text(nvml.nvmlDeviceGetUUID(handle)).removeprefix("GPU-") == uuid:
                return handle, index
        return None

    def _named(self, nvml: Any) -> Dict[str, str]:
        named = {}
        for key, read in (("name", nvml.nvmlDeviceGetName), ("uuid", nvml.nvmlDeviceGetUUID)):
            try:
                named[key] = _text(read(self._handle))
            except nvml.NVMLError:
                continue
        return named

    def _subscribe(self, nvml: Any) -> None:
        try:
            self._events = nvml.nvmlEventSetCreate()
            nvml.nvmlDeviceRegisterEvents(self._handle, XID_EVENT, self._events)
        except nvml.NVMLError as error:
            self._events, self._events_unread = None, nvml_reason(error)

    def _drain_xids(self) -> None:
        """The XID errors NVML queued since the last drain (waits for none)."""
        nvml = self._nvml
        while self._events is not None:
            try:
                event = nvml.nvmlEventSetWait(self._events, 0)
            except nvml.NVMLError as error:
                if getattr(error, "value", None) != NVML_TIMEOUT:
                    self._events, self._events_unread = None, nvml_reason(error)
                return
            if event.eventType & XID_EVENT and len(self._xids) < MAX_XID_EVENTS:
                self._xids.append(int(event.eventData))

    def at(self, step: int) -> Optional[Dict[str, Any]]:
        """The record's ``device_health`` at ``step`` (read once per step, for the first
        ``MAX_READ_STEPS`` steps asked); None without NVML."""
        if self._nvml is None:
            self._say_unavailable()
            return None
        if step not in self._read:
            self._read[step] = self._reading() if len(self._read) < MAX_READ_STEPS else None
        return self._read[step]

    def _say_unavailable(self) -> None:
        """Why no reading, at the first incident: at INFO once per node (NVML is the node's: its driver, its
        Python environment), at DEBUG on the node's other ranks."""
        if self._unavailable is not None:
            logger.log(logging.INFO if self._local_rank == 0 else logging.DEBUG,
                       "device health not read at this incident (%s): the records carry no 'device_health'",
                       self._unavailable)
            self._unavailable = None

    def _reading(self) -> Dict[str, Any]:
        values, unread = read_health(self._nvml, self._handle)
        self._drain_xids()
        if self._events_unread is None:
            values["xid_errors"] = list(self._xids)
        else:
            unread["xid_errors"] = self._events_unread
        return {"source": "nvml", "device": dict(self._device), "values": values, "unread": unread}


def _torch_uuid(device: str) -> Optional[str]:
    """The UUID of ``cuda:N`` as torch knows it, without the ``GPU-`` prefix; None on the CPU."""
    if not device.startswith("cuda:"):
        return None
    import torch

    try:
        return str(torch.cuda.get_device_properties(int(device.split(":", 1)[1])).uuid)
    except (RuntimeError, ValueError, AttributeError, AssertionError):
        return None
