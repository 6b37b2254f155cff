"""The SPIR-V target a Vulkan device is compiled for.

IREE's named Vulkan profiles (rdna3, ampere, ...) assume a subgroup size;
on a device whose subgroups differ the code runs and computes wrong values
(measured: a 4096-element sum gave NaN on lavapipe, whose subgroups are 8
wide, under the rdna3 profile). So every device gets IREE's baseline profile
(no subgroup operations) with the capabilities the device itself reports
(`dump_device_info`), which go into the flags and so into the cache key: an
executable is only ever served to a device with what its code assumes. A
type the device lacks (float64 or int64 where not reported) fails to
compile, and the op runs on the host path, reported, never computed wrong.
"""

from __future__ import annotations

import functools

BASELINE = "vp_android_baseline_2022"

# Device feature (as dump_device_info names it) -> SPIR-V capabilities and
# extensions it grants.
_FEATURES = {
    "shaderFloat16": ("cap:Float16",),
    "shaderInt8": ("cap:Int8",),
    "storageBuffer8BitAccess": ("cap:StorageBuffer8BitAccess", "ext:SPV_KHR_8bit_storage"),
    "storageBuffer16BitAccess": ("cap:StorageBuffer16BitAccess", "ext:SPV_KHR_16bit_storage"),
}
# What Vulkan's info dump does not list, for drivers known to have it:
# lavapipe (Mesa's llvmpipe) runs shaders with LLVM on the CPU, with 64- and
# 16-bit types.
_KNOWN_DRIVERS = {"llvmpipe": ("cap:Float64", "cap:Int64", "cap:Int16")}


def parse_device_info(text: str) -> dict:
    """The fields of IREE's Vulkan device dump that code depends on."""
    info = {"features": {}}
    for line in text.splitlines():
        key, _, value = line.strip().partition(":")
        value = value.strip()
        if key in ("name", "driver", "driver_info", "api", "type"):
            info[key] = value
        elif key == "features":
            for pair in value.split():
                name, _, flag = pair.partition("=")
                info["features"][name] = flag == "yes"
        elif key == "subgroup":
            info["subgroup"] = value
    return info


@functools.lru_cache(maxsize=None)
def device_info(device_id=None) -> dict:
    """The first Vulkan device's info (or the one with `device_id`)."""
    import iree.runtime as ireert

    driver = ireert.get_driver("vulkan")
    devices = driver.query_available_devices()
    if not devices:
        raise RuntimeError("neuron: the vulkan driver found no device")
    chosen = devices[0] if device_id is None else next(d for d in devices if d["device_id"] == device_id)
    return parse_device_info(driver.dump_device_info(chosen["device_id"]))


def features_of(info: dict) -> str:
    """IREE's --iree-vulkan-target-features for a device."""
    found = ["spirv:v1.3", "cap:Shader"]
    for feature, grants in _FEATURES.items():
        if info["features"].get(feature):
            found.extend(grants)
    found.extend(_KNOWN_DRIVERS.get(info.get("driver", ""), ()))
    return ",".join(found)


def flags(info: dict | None = None) -> tuple:
    info = info or device_info()
    return (
        "--iree-input-demote-f64-to-f32=false",
        f"--iree-vulkan-target={BASELINE}",
        f"--iree-vulkan-target-features={features_of(info)}",
    )
