"""The SPIR-V target a Vulkan device is compiled for.

IREE's named Vulkan profiles (rdna3, ampere, ...) assume a subgroup size;
on a device whose subgroups differ the code runs and computes wrong values
(measured: a 4096-element sum gave NaN on lavapipe, whose subgroups are 8
wide, under the rdna3 profile). So every device gets IREE's baseline profile
(no subgroup operations) with the capabilities the device itself reports
(`dump_device_info`), and the compute widths those grant, written out as
the device target in full; they go into the flags and so into the cache
key: an executable is only ever served to a device with what its code
assumes. A type the device lacks (float64 or int64 where not reported)
fails to compile, and the op runs on the host path, reported, never
computed wrong.
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


# SPIR-V capability -> the compute and storage bit widths IREE's target
# description grants with it. IREE decides from `compute`, not from the
# capabilities, whether to emulate 64-bit integers with 32-bit pairs, and its
# emulation fails on vectorized fused dispatches (`vector.broadcast (i64) ->
# vector<1xi64>` left illegal: an index bound check fused with a clamp, the
# embedding of a GPT); a device with Int64 computes them natively instead.
_WIDTHS = {
    "cap:Float64": ("fp64", "b64"),
    "cap:Int64": ("int64", "b64"),
    "cap:Int16": ("int16", None),
    "cap:Int8": ("int8", None),
    "cap:StorageBuffer16BitAccess": (None, "b16"),
    "cap:StorageBuffer8BitAccess": (None, "b8"),
}
_ORDER = ("fp64", "fp32", "fp16", "int64", "int32", "int16", "int8", "b64", "b32", "b16", "b8")


def target_description(info: dict) -> str:
    """IREE's description of the device (`#iree_gpu.target`): the baseline
    profile's limits, no subgroup operations, with the bit widths of the
    device's own capabilities."""
    features = features_of(info)
    compute, storage = {"fp32", "int32"}, {"b32"}
    for capability in features.split(","):
        widths = _WIDTHS.get(capability, (None, None))
        compute.update(w for w in widths[:1] if w)
        storage.update(w for w in widths[1:] if w)
    compute_bits = "|".join(w for w in _ORDER if w in compute)
    storage_bits = "|".join(w for w in _ORDER if w in storage)
    return (f'#iree_gpu.target<arch = "{BASELINE}", features = "{features}", wgp = <compute = {compute_bits}, '
            f"storage = {storage_bits}, subgroup = none, subgroup_size_choices = [64], "
            "max_workgroup_sizes = [128, 128, 64], max_thread_count_per_workgroup = 128, "
            "max_workgroup_memory_bytes = 16384, max_workgroup_counts = [65535, 65535, 65535]>>")


def flags(info: dict | None = None) -> tuple:
    """The device target written out in full: IREE's flags name a profile and
    add capabilities, but keep the profile's 32-bit compute widths."""
    info = info or device_info()
    executable = (f'#hal.executable.target<"vulkan-spirv", "vulkan-spirv-fb", '
                  f"{{iree_codegen.target_info = {target_description(info)}}}>")
    return (
        "--iree-input-demote-f64-to-f32=false",
        f'--iree-hal-target-device=#hal.device.target<"vulkan", [{executable}]> : !hal.device',
    )
