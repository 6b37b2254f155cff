"""Targets with memory of their own: Vulkan on lavapipe (Mesa's software
Vulkan driver, installed by `make test`), each program in a child process
with TORCHNEURON_DRIVER=vulkan. A test passes only if the work ran compiled
on the target (execution_stats), with values compared against PyTorch CPU."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import subprocess
import sys
import textwrap

from torchneuron.cache import target_check
from torchneuron.compiler import target_vulkan


def _run_on(driver: str, body: str, **env) -> dict:
    code = (
        "import json, torch, torchneuron\n"
        "result = {}\n" + textwrap.dedent(body) + "\nprint('RESULT' + json.dumps(result))\n"
    )
    environment = dict(os.environ, TORCHNEURON_DRIVER=driver, TORCHNEURON_COMPILE_WAIT="1",
                       TORCHNEURON_EAGER_MODE="op", **env)
    environment.pop("TORCHNEURON_MEMORY", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT")][-1]
    return json.loads(line[len("RESULT"):])


_TRAIN = """
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    ref = __import__("copy").deepcopy(model)
    model.to("neuron")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    data, target = torch.randn(8, 16), torch.randn(8, 4)
    losses = []
    for _ in range(3):
        for m, o, d, t in ((model, opt, data.to("neuron"), target.to("neuron")), (ref, ref_opt, data, target)):
            o.zero_grad()
            loss = torch.nn.functional.mse_loss(m(d), t)
            loss.backward()
            o.step()
            losses.append(loss.item())
    result["losses"] = losses
    result["stats"] = torchneuron.execution_stats()
    result["fallback"] = torchneuron.fallback_ops()
    result["compile"] = {k: v for k, v in torchneuron.compile_stats().items() if k.startswith("disk_")}
"""


def test_info_lists_the_vulkan_device_and_its_memory_model():
    out = subprocess.run([sys.executable, "-m", "torchneuron.cli", "info", "--json"], capture_output=True, text=True,
                         env=dict(os.environ, TORCHNEURON_DRIVER="vulkan"), timeout=120)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["available"] is True and info["driver"] == "vulkan"
    assert info["memory_model"] == "discrete"
    assert info["drivers"]["vulkan"]["memory"] == "discrete" and info["drivers"]["vulkan"]["devices"]


def test_neuron_devices_beyond_the_physical_ones_share_them(tmp_path):
    # lavapipe is one physical device: neuron:1 is it again, one HAL device
    # for both (several logical Vulkan devices on one lost the device under
    # load), and a program using both indices still runs and copies between them.
    result = _run_on("vulkan", """
        from torchneuron.hal import devices
        x = torch.randn(64, 64)
        a = x.to("neuron:0")
        b = a.to("neuron:1")
        result["same"] = torch.allclose((b @ b).cpu(), x @ x, atol=1e-4) and torch.equal(a.cpu(), x)
        result["device"] = str(b.device)
        created = devices.created_devices()
        result["indices"] = sorted(created)
        result["one_hal_device"] = created[0] is created[1]
        result["names"] = [torch.neuron.get_device_name(i) for i in range(2)]
        """, TORCHNEURON_CACHE_DIR=str(tmp_path), TORCHNEURON_DEVICE_COUNT="2")
    assert result["same"] and result["device"] == "neuron:1", result
    assert result["indices"] == [0, 1] and result["one_hal_device"], result
    assert result["names"][0] == result["names"][1] and "llvmpipe" in result["names"][0], result


def test_training_runs_compiled_on_vulkan_and_matches_cpu(tmp_path):
    result = _run_on("vulkan", _TRAIN, TORCHNEURON_CACHE_DIR=str(tmp_path))
    losses = result["losses"]
    assert all(abs(a - b) < 1e-4 for a, b in zip(losses[0::2], losses[1::2])), losses
    # The work ran as Vulkan executables, none of it on the host path.
    assert result["stats"]["ops_compiled"] >= 30 and result["fallback"] == {}, result
    assert result["stats"]["ops_on_host_while_compiling"] == 0


def test_an_executable_called_again_with_new_tensors_uses_them(tmp_path):
    # Concatenations are copies in IREE's command buffers; replaying a
    # recorded one on Vulkan kept its first call's buffers (the second stack
    # wrote nothing), so gradient clipping went wrong from a GPT's second step.
    result = _run_on("vulkan", """
        torch.manual_seed(0)
        same = []
        for step in range(3):
            host = [torch.randn(40 + i) for i in range(5)]
            norms = [t.to("neuron").norm() for t in host]
            stacked = torch.stack(norms).cpu()
            joined = torch.cat([n.view(1) for n in norms]).cpu()
            expected = torch.stack([t.norm() for t in host])
            same.append(bool(torch.allclose(stacked, expected) and torch.allclose(joined, expected)))
        result["same"] = same
        result["fallback"] = torchneuron.fallback_ops()
        """, TORCHNEURON_CACHE_DIR=str(tmp_path))
    assert result["same"] == [True, True, True] and result["fallback"] == {}, result


def test_a_small_gpt_trains_on_vulkan_like_cpu(tmp_path):
    result = _run_on("vulkan", """
        from torchneuron.models import GPTConfig, train_gpt
        cfg = GPTConfig(n_embd=32, n_layer=1, block_size=16)
        result["neuron"] = train_gpt("neuron", 4, cfg=cfg, batch=4)
        result["cpu"] = train_gpt("cpu", 4, cfg=cfg, batch=4)
        result["stats"] = torchneuron.execution_stats()
        """, TORCHNEURON_CACHE_DIR=str(tmp_path))
    assert max(abs(a - b) for a, b in zip(result["neuron"], result["cpu"])) < 1e-4, result
    assert result["stats"]["ops_on_host_fallback"] < result["stats"]["ops_compiled"] / 10, result["stats"]


def test_a_small_gpt_trains_under_torch_compile_on_vulkan_like_cpu(tmp_path):
    # One graph forward and one backward, each a Vulkan executable: their
    # embeddings' int64 index checks compile (see the int64 test below).
    result = _run_on("vulkan", """
        from torchneuron.models import GPTConfig, train_gpt
        cfg = GPTConfig(n_embd=32, n_layer=1, block_size=16, dropout=0.0)
        result["neuron"] = train_gpt("neuron", 3, cfg=cfg, batch=4, compile_backend="neuron")
        result["cpu"] = train_gpt("cpu", 3, cfg=cfg, batch=4)
        result["dynamo"] = torchneuron.compile_stats()["dynamo"]
        result["fallback"] = torchneuron.fallback_ops()
        """, TORCHNEURON_CACHE_DIR=str(tmp_path))
    assert max(abs(a - b) for a, b in zip(result["neuron"], result["cpu"])) < 1e-4, result
    assert result["dynamo"]["graphs_compiled"] >= 2 and "graphs_fallback" not in result["dynamo"], result
    assert result["fallback"] == {}, result


def test_float32_moments_run_compiled_on_vulkan_like_cpu(tmp_path):
    # torch-mlir computes a float32 variance in float64; IREE's SPIR-V code for
    # that reduction crashed lavapipe (64x2048: a segfault in the shader). On
    # GPU targets the moments are float32, as PyTorch's CUDA kernels keep them.
    result = _run_on("vulkan", """
        torch.manual_seed(0)
        x = torch.randn(64, 2048)
        xn = x.to("neuron")
        result["var"] = (xn.var(1).cpu() - x.var(1)).abs().max().item()
        v, m = torch.var_mean(xn, 1, correction=0, keepdim=True)
        rv, rm = torch.var_mean(x, 1, correction=0, keepdim=True)
        result["var_mean"] = max((v.cpu() - rv).abs().max().item(), (m.cpu() - rm).abs().max().item())
        g = torch.randn(2, 256, 16, 16, requires_grad=True)
        w, b = torch.randn(256, requires_grad=True), torch.randn(256, requires_grad=True)
        gn, wn, bn = [t.detach().to("neuron").requires_grad_() for t in (g, w, b)]
        y, yn = torch.nn.functional.group_norm(g, 32, w, b), torch.nn.functional.group_norm(gn, 32, wn, bn)
        result["group_norm"] = (yn.cpu() - y).abs().max().item()
        y.square().mean().backward()
        yn.square().mean().backward()
        result["grads"] = [((t.grad - tn.grad.cpu()).abs().max() / t.grad.abs().max()).item()
                           for t, tn in ((g, gn), (w, wn), (b, bn))]
        result["kept"] = torch.equal(xn.cpu(), x) and torch.equal(gn.detach().cpu(), g.detach())
        result["fallback"] = torchneuron.fallback_ops()
        """, TORCHNEURON_CACHE_DIR=str(tmp_path), TORCHNEURON_DEVICE_COUNT="1")
    assert result["var"] < 1e-5 and result["var_mean"] < 1e-5 and result["group_norm"] < 1e-4, result
    assert max(result["grads"]) < 1e-4 and result["kept"] and result["fallback"] == {}, result


def test_depthwise_convolutions_on_vulkan_match_cpu(tmp_path):
    # IREE's SPIR-V code for linalg's depthwise convolutions was wrong on
    # lavapipe (7.0 off for a [2, 16, 12] * [16, 1, 3] one); GPU targets run
    # them as a multiply-add per kernel tap (lowering/rules/depthwise_taps.py).
    result = _run_on("vulkan", """
        F = torch.nn.functional
        torch.manual_seed(0)
        errors = {}
        for name, xs, ws, kw in [("1d", (2, 16, 12), (16, 1, 3), {"padding": 1}),
                                 ("1d_dilated", (2, 16, 12), (16, 1, 3), {"dilation": 3, "padding": 3}),
                                 ("2d_strided", (2, 16, 10, 10), (16, 1, 3, 3), {"padding": 1, "stride": 2})]:
            conv = F.conv1d if len(xs) == 3 else F.conv2d
            x, w, b = torch.randn(*xs, requires_grad=True), torch.randn(*ws, requires_grad=True), torch.randn(16)
            xn, wn = [t.detach().to("neuron").requires_grad_() for t in (x, w)]
            y, yn = conv(x, w, b, groups=16, **kw), conv(xn, wn, b.to("neuron"), groups=16, **kw)
            y.square().sum().backward()
            yn.square().sum().backward()
            errors[name] = max((yn.cpu() - y).abs().max().item(), (xn.grad.cpu() - x.grad).abs().max().item(),
                               ((wn.grad.cpu() - w.grad).abs().max() / w.grad.abs().max()).item())
        result["errors"] = errors
        result["fallback"] = torchneuron.fallback_ops()
        """, TORCHNEURON_CACHE_DIR=str(tmp_path), TORCHNEURON_DEVICE_COUNT="1")
    assert max(result["errors"].values()) < 1e-4 and result["fallback"] == {}, result


def test_long_scans_on_vulkan_match_cpu(tmp_path):
    # IREE's SPIR-V scans went wrong past about 16k elements (a cumsum of 65536
    # had only its first element right, in every dtype); GPU targets scan in
    # blocks (lowering/rules/long_scans.py), in blocks of blocks past 4096^2.
    result = _run_on("vulkan", """
        torch.manual_seed(0)
        checks = {}
        for name, x, dim, scan in [
                ("float32", torch.randn(65536), 0, torch.cumsum),
                ("int32_rows", (torch.randn(2, 40000) * 10).int(), 1, torch.cumsum),
                ("float16_columns", torch.randn(20000, 3).half(), 0, torch.cumsum),
                ("cumprod", 1 + torch.randn(5000) / 1000, 0, torch.cumprod),
                ("blocks_of_blocks", torch.randn(4096 * 4096 + 5), 0, torch.cumsum)]:
            want, got = scan(x, dim), scan(x.to("neuron"), dim).cpu()
            checks[name] = got.dtype == want.dtype and torch.allclose(got.double(), want.double(), rtol=1e-3, atol=1e-2)
        result["checks"] = checks
        result["fallback"] = torchneuron.fallback_ops()
        """, TORCHNEURON_CACHE_DIR=str(tmp_path), TORCHNEURON_DEVICE_COUNT="1")
    assert all(result["checks"].values()) and result["fallback"] == {}, result


def test_an_entry_compiled_for_another_target_is_never_loaded(tmp_path):
    # Fill a cache on Vulkan, then plant CPU executables under its keys, each
    # a consistent entry (size and checksum match), as a copied directory
    # or a shared store could hold. The Vulkan run that follows must rebuild
    # them, not hand a CPU executable to the Vulkan device.
    vulkan_dir, cpu_dir = tmp_path / "vulkan", tmp_path / "cpu"
    _run_on("vulkan", _TRAIN, TORCHNEURON_CACHE_DIR=str(vulkan_dir))
    _run_on("local-task", _TRAIN, TORCHNEURON_CACHE_DIR=str(cpu_dir))
    cpu_vmfb = max((open(p, "rb").read() for p in glob.glob(str(cpu_dir / "exe" / "*" / "*.vmfb"))), key=len)
    assert target_check.mismatch(cpu_vmfb, "vulkan-spirv", target_vulkan.flags()) is not None
    planted = 0
    for path in glob.glob(str(vulkan_dir / "exe" / "*" / "*.vmfb")):
        meta_path = path[: -len(".vmfb")] + ".json"
        meta = json.loads(open(meta_path).read())
        meta.update(size=len(cpu_vmfb), sha256=hashlib.sha256(cpu_vmfb).hexdigest())
        open(path, "wb").write(cpu_vmfb)
        open(meta_path, "w").write(json.dumps(meta))
        planted += 1
    assert planted >= 10
    result = _run_on("vulkan", _TRAIN, TORCHNEURON_CACHE_DIR=str(vulkan_dir))
    losses = result["losses"]
    assert all(abs(a - b) < 1e-4 for a, b in zip(losses[0::2], losses[1::2])), losses
    assert result["compile"]["disk_wrong_target"] >= 10, result["compile"]
    assert result["fallback"] == {}


def test_vulkan_code_assumes_only_what_the_device_reports():
    lavapipe = target_vulkan.parse_device_info(
        "name: llvmpipe (LLVM 15.0.6, 256 bits)\ndriver: llvmpipe\n"
        "features: shaderInt8=yes shaderFloat16=yes storageBuffer8BitAccess=yes storageBuffer16BitAccess=no\n"
    )
    other = dict(lavapipe, driver="some-gpu")
    lava = target_vulkan.features_of(lavapipe).split(",")
    assert {"cap:Float64", "cap:Int64", "cap:Int8", "cap:Float16", "cap:StorageBuffer8BitAccess"} <= set(lava)
    assert "cap:StorageBuffer16BitAccess" not in lava
    # A device that does not report 64-bit types gets code without them: such
    # ops fail to compile and run on the host path, never emulated wrongly.
    assert "cap:Float64" not in target_vulkan.features_of(other).split(",")
    # No named profile: those assume a subgroup size (wrong sums on others);
    # the compute widths follow the device's own capabilities.
    lava_target = target_vulkan.target_description(lavapipe)
    assert f'arch = "{target_vulkan.BASELINE}"' in lava_target and "subgroup = none" in lava_target
    assert "compute = fp64|fp32|int64|int32|int16|int8," in lava_target, lava_target
    assert "compute = fp32|int32|int8," in target_vulkan.target_description(other)
    assert any(lava_target in flag for flag in target_vulkan.flags(lavapipe))


def test_int64_arithmetic_runs_compiled_on_vulkan_beyond_32_bits(tmp_path):
    # IREE emulates 64-bit integers with 32-bit pairs unless the target's
    # compute widths include int64, and that emulation failed on fused
    # dispatches (a GPT's embedding with its index check); lavapipe has Int64.
    result = _run_on("vulkan", """
        torch.manual_seed(0)
        x = torch.randint(-2**40, 2**40, (500,))
        y = torch.randint(1, 2**20, (500,))
        xn, yn = x.to("neuron"), y.to("neuron")
        ops = {"mul": lambda a, b: a * b, "floordiv": lambda a, b: a // b, "rem": lambda a, b: a % b,
               "sum": lambda a, b: a.sum(), "cumsum": lambda a, b: a.cumsum(0), "shift": lambda a, b: a >> 3,
               "clamp_gather": lambda a, b: b.clamp(0, 499)[a.abs() % 500]}
        result["same"] = {name: torch.equal(f(xn, yn).cpu(), f(x, y)) for name, f in ops.items()}
        result["xn_kept"] = torch.equal(xn.cpu(), x) and torch.equal(yn.cpu(), y)
        result["stats"] = torchneuron.execution_stats()
        result["fallback"] = torchneuron.fallback_ops()
        """, TORCHNEURON_CACHE_DIR=str(tmp_path))
    assert all(result["same"].values()) and result["xn_kept"], result
    assert result["fallback"] == {} and result["stats"]["ops_compiled"] >= 10, result


def test_guarded_memory_names_a_write_past_a_tensor_on_vulkan(tmp_path):
    # The guards are Vulkan device memory, read and restored with transfers.
    result = _run_on("vulkan", """
        from torchneuron.compiler import compile_mlir
        from torchneuron.dispatch.op_info import op_info
        from torchneuron.lowering import lower_call, signature_of
        from torchneuron.runtime import LoadedExecutable, device_queue
        from torchneuron.runtime.memory_guards import NeuronMemoryError
        op = torch.ops.aten.zero_.default
        info = op_info(op)
        mlir = lower_call(op, info, signature_of(op, info, (torch.ones(32, device="neuron"),), {})).mlir
        exe = LoadedExecutable(compile_mlir(mlir, "zero_")[0], "test", "zero_(float32[32])")
        small = torch.ones(13, device="neuron")
        queue = device_queue(0)
        try:
            queue.launch(exe, [queue.task.import_memory(small, 0, (32,), torch.float32)], [small], "zero_(float32[32])")
        except NeuronMemoryError as e:
            result["error"] = str(e)
        result["small"] = small.cpu().sum().item()
        x, w = torch.randn(6, 6), torch.randn(6, 3, requires_grad=True)
        wn = w.detach().to("neuron").requires_grad_()
        (x @ w).tanh().sum().backward()
        (x.to("neuron") @ wn).tanh().sum().backward()
        result["grads"] = torch.allclose(wn.grad.cpu(), w.grad, atol=1e-5)
        result["guard_bytes"] = torchneuron.transfer_stats()["memory_guard_bytes"]
        """, TORCHNEURON_CACHE_DIR=str(tmp_path), TORCHNEURON_CHECK_MEMORY="1")
    assert "a 52-byte allocation" in result["error"] and "past its end (first changed byte at offset 52)" in result["error"]
    assert result["small"] == 0.0 and result["grads"] and result["guard_bytes"] > 0, result


def test_device_memory_exhausted_is_an_out_of_memory_error_and_loses_nothing():
    # lavapipe's one memory heap takes at most 2 GiB in one allocation.
    result = _run_on("vulkan", """
        kept = torch.arange(5.0, device="neuron")
        big = torch.empty(700 * 2**20, device="neuron")  # an address: the memory is made at first use
        try:
            big.fill_(1.0)
            torch.neuron.synchronize()
        except torch.OutOfMemoryError as e:
            result["error"] = str(e)
        del big
        result["after"] = (kept * 2).tolist()
        """)
    assert "neuron out of memory" in result["error"] and "device memory of neuron:0" in result["error"]
    assert "vulkan" in result["error"], result
    assert result["after"] == [0.0, 2.0, 4.0, 6.0, 8.0]


def test_eval_runs_on_the_driver_it_is_given(tmp_path):
    results = tmp_path / "unit.jsonl"
    command = [sys.executable, "-m", "torchneuron.cli", "eval", "--stage", "unit", "--driver", "vulkan",
               "--registry", os.path.join(os.path.dirname(target_vulkan.__file__), "..", "eval", "data",
                                          "demo_registry.sqlite"),
               "--ops", "aten.mul.Tensor", "aten.gelu.default",
               "--results", str(results)]
    environment = dict(os.environ, TORCHNEURON_CACHE_DIR=str(tmp_path / "cache"))
    environment.pop("TORCHNEURON_DRIVER", None)
    out = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(x) for x in results.read_text().splitlines()]
    assert len(lines) == 3 and all(r["status"] == "pass" for r in lines), lines
    # Each result was computed by Vulkan executables: the cache holds SPIR-V modules only.
    vmfbs = glob.glob(str(tmp_path / "cache" / "exe" / "*" / "*.vmfb"))
    assert vmfbs and all(target_check.mismatch(open(p, "rb").read(), "vulkan-spirv", ()) is None for p in vmfbs)
    assert any(b"vulkan-spirv" in open(p, "rb").read() for p in vmfbs)


def test_eval_refuses_a_driver_without_a_device_at_once():
    out = subprocess.run([sys.executable, "-m", "torchneuron.cli", "eval", "--stage", "unit", "--driver", "cuda"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "cuda" in out.stderr and "cannot be used" in out.stderr, out.stderr
