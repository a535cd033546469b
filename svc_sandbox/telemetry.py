"""NVML device telemetry (nvidia-ml-py): the device list, one sample of a device's clocks,
utilisation, temperature, power and throttle reasons, and a background sampler that runs
while a candidate is timed.

Where NVML is absent (no driver: NVMLError_LibraryNotFound) or fails to start, the service
lists no devices, says why, and keeps serving the cpu toolchain.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

from google.protobuf import timestamp_pb2

from leap.sandbox.v1 import sandbox_pb2

try:
    import pynvml
except ImportError:  # the dependency is declared; a stripped install still serves cpu
    pynvml = None

# NVML throttle-reason bits and the names the contract reports (see checking.UNRELIABLE_THROTTLE).
THROTTLE_REASONS = {
    0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
    0x10: "sync_boost", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown", 0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}


def throttle_names(mask: int) -> list[str]:
    return [name for bit, name in THROTTLE_REASONS.items() if mask & bit]


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Telemetry:
    """NVML, started once. `devices` is empty and `unavailable_reason` says why when NVML is
    not usable."""

    def __init__(self) -> None:
        self.unavailable_reason = ""
        self.devices: list[sandbox_pb2.Device] = []
        self._handles: dict[int, object] = {}
        self._lock = threading.Lock()
        if pynvml is None:
            self.unavailable_reason = "the nvidia-ml-py package is not installed"
            return
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError_LibraryNotFound:
            self.unavailable_reason = "NVML library not found (libnvidia-ml.so.1): no NVIDIA driver on this machine"
            return
        except pynvml.NVMLError as err:
            self.unavailable_reason = f"NVML failed to initialize: {err}"
            return
        try:
            driver = _text(pynvml.nvmlSystemGetDriverVersion())
            for index in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
                self._handles[index] = handle
                self.devices.append(sandbox_pb2.Device(
                    index=index, name=_text(pynvml.nvmlDeviceGetName(handle)), uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
                    memory_total_bytes=int(pynvml.nvmlDeviceGetMemoryInfo(handle).total), driver_version=driver,
                    compute_capability=f"{major}.{minor}"))
        except pynvml.NVMLError as err:
            self.unavailable_reason = f"NVML could not list devices: {err}"
        if not self.devices and not self.unavailable_reason:
            self.unavailable_reason = "NVML reports no devices"

    def device(self, index: int) -> sandbox_pb2.Device | None:
        return next((d for d in self.devices if d.index == index), None)

    def sample(self, index: int) -> sandbox_pb2.TelemetrySample:
        """One reading of device `index` (fields NVML cannot read on this device stay 0)."""
        handle = self._handles[index]
        now = timestamp_pb2.Timestamp()
        now.GetCurrentTime()
        sample = sandbox_pb2.TelemetrySample(device_index=index, time=now)
        readers = {
            "sm_clock_mhz": lambda: pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
            "memory_clock_mhz": lambda: pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_MEM),
            "temperature_c": lambda: pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU),
            "power_watts": lambda: pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
            "memory_used_bytes": lambda: pynvml.nvmlDeviceGetMemoryInfo(handle).used,
        }
        with self._lock:
            for field, read in readers.items():
                with contextlib.suppress(pynvml.NVMLError):
                    setattr(sample, field, read())
            with contextlib.suppress(pynvml.NVMLError):
                rates = pynvml.nvmlDeviceGetUtilizationRates(handle)
                sample.gpu_utilization_percent, sample.memory_utilization_percent = int(rates.gpu), int(rates.memory)
            with contextlib.suppress(pynvml.NVMLError):
                sample.throttle_reasons.extend(throttle_names(pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle)))
        return sample

    @contextlib.contextmanager
    def sampling(self, index: int, interval_seconds: float) -> Iterator[list[sandbox_pb2.TelemetrySample]]:
        """Sample device `index` every `interval_seconds` on a thread while the block runs (and
        once at each end); yields the list the samples go to."""
        samples: list[sandbox_pb2.TelemetrySample] = []
        if index not in self._handles:
            yield samples
            return
        stop = threading.Event()

        def loop() -> None:
            while True:
                samples.append(self.sample(index))
                if stop.wait(interval_seconds):
                    return

        thread = threading.Thread(target=loop, name=f"nvml-{index}", daemon=True)
        thread.start()
        try:
            yield samples
        finally:
            stop.set()
            thread.join()
            samples.append(self.sample(index))

    def stream(self, indices: list[int], interval_seconds: float, max_samples: int,
               cancelled: threading.Event) -> Iterator[sandbox_pb2.TelemetrySample]:
        count = 0
        while not cancelled.is_set() and (max_samples == 0 or count < max_samples):
            started = time.monotonic()
            for index in indices:
                yield self.sample(index)
            count += 1
            cancelled.wait(max(0.0, interval_seconds - (time.monotonic() - started)))
