"""A CPU platform for verl (tests only): verl 0.9.1 detects CUDA, NPU or ROCm and otherwise falls back to CUDA, so
on a machine without GPUs its workers and engines would ask torch.cuda for their device. Registered as "cpu" and
selected with VERL_PLATFORM=cpu before verl first asks for its platform; torch.distributed runs on gloo."""

import contextlib
import os
from types import SimpleNamespace

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry

CPU_MODULE = SimpleNamespace(
    current_device=lambda: "cpu", device_count=lambda: 1, is_available=lambda: True, synchronize=lambda *a: None,
    empty_cache=lambda: None, max_memory_allocated=lambda *a: 0, max_memory_reserved=lambda *a: 0,
    memory_allocated=lambda *a: 0, memory_reserved=lambda *a: 0, manual_seed=torch.manual_seed,
    manual_seed_all=torch.manual_seed, set_device=lambda *a: None, mem_get_info=lambda *a: (0, 0),
    reset_peak_memory_stats=lambda *a: None, get_device_name=lambda *a: "CPU",
)


class PlatformCPU(PlatformBase):
    device_name = "cpu"
    vendor_name = "cpu"
    device_module = CPU_MODULE

    def is_available(self):
        return True

    def current_device(self):
        return "cpu"

    def device_count(self):
        return 1

    def set_device(self, device_index):
        pass

    def synchronize(self, device_index=None):
        pass

    def manual_seed(self, seed):
        torch.manual_seed(seed)

    def manual_seed_all(self, seed):
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings):
        pass

    def empty_cache(self):
        pass

    def get_device_capability(self, device_index=0):
        return None, None

    def communication_backend_name(self):
        return "gloo"

    def visible_devices_envvar(self):
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg):
        yield

    def profiler_start(self):
        pass

    def profiler_stop(self):
        pass

    def ray_resource_name(self):
        return "CPU"

    def ray_noset_envvars(self):
        return []

    def is_ipc_supported(self):
        return False

    def cudart(self):
        return None


def use_cpu_platform() -> None:
    if "cpu" not in PlatformRegistry.registered_names():
        PlatformRegistry.register(platform="cpu")(PlatformCPU)
    os.environ["VERL_PLATFORM"] = "cpu"
