"""Host kernels that run on autograd's device thread must not start a second
OpenMP team: with more OpenMP threads than CPUs, libgomp throttles its
spin-wait and the program's own CPU work slows down for the rest of the
process (dispatch/host_threads.py).

Each case runs in a fresh process, because an OpenMP team lives as long as
the thread that started it. OMP_NUM_THREADS=2 makes the CPU kernels parallel
even on a one-core machine, so the second team would appear there too.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")

_CHILD = textwrap.dedent(
    """
    import json, os, threading
    import torch, torchneuron

    def thread_names():
        names = []
        for t in os.listdir("/proc/self/task"):
            try:
                names.append(open(f"/proc/self/task/{t}/comm").read().strip())
            except FileNotFoundError:  # a thread that ended meanwhile
                pass
        return names

    torch.manual_seed(0)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    torch.mm(a, b)  # the program's own OpenMP team
    threads_before = torch.get_num_threads()

    x = a.to("neuron").requires_grad_()
    w = b.to("neuron").requires_grad_()
    (torch.mm(x, w).tanh() * 2).sum().backward()  # mm's backward: MKL sgemm on the autograd thread

    def cpu_grads(dtype):
        ac, bc = a.to(dtype, copy=True).requires_grad_(), b.to(dtype, copy=True).requires_grad_()
        (torch.mm(ac, bc).tanh() * 2).sum().backward()
        return ac.grad, bc.grad

    cpu = cpu_grads(torch.float32)

    seen = {}
    def user_thread():
        seen["threads"] = torch.get_num_threads()
    t = threading.Thread(target=user_thread)
    t.start(); t.join()
    threads_after = torch.get_num_threads()

    # Errors against float64. A matmul's float32 rounding depends on the BLAS
    # code path, which can depend on the thread count: the neuron answer (its
    # backward on one thread) must be as accurate as CPU's with the program's
    # threads or with one.
    exact = cpu_grads(torch.float64)
    torch.set_num_threads(1)
    cpu_one_thread = cpu_grads(torch.float32)
    def error(grads):
        return [(g.cpu().double() - e).abs().max().item() for g, e in zip(grads, exact)]

    print(json.dumps({
        "autograd_threads": sum(n.startswith("pt_autograd") for n in thread_names()),
        "device_count": torch.neuron.device_count(),
        "threads_before": threads_before,
        "threads_after": threads_after,
        "user_thread": seen["threads"],
        "neuron_error": error((x.grad, w.grad)),
        "cpu_error": error(cpu),
        "cpu_one_thread_error": error(cpu_one_thread),
        "largest_gradient": [e.abs().max().item() for e in exact],
        "inputs_unchanged": torch.equal(x.detach().cpu(), a) and torch.equal(w.detach().cpu(), b),
    }))
    """
)


@functools.cache  # one fresh process per mode serves every test of it
def _child(mode: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="2", TORCHNEURON_EXECUTION="host", TORCHNEURON_EAGER_MODE=mode)
    proc = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=600)
    # nanobind lists the IREE objects alive at exit after any failure: the
    # cause is before them.
    cause = [line for line in proc.stderr.splitlines() if "nanobind" not in line and "leaked" not in line]
    assert proc.returncode == 0, f"exit status {proc.returncode}:\n" + "\n".join(cause[-40:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mode", ["op", "adaptive"])
def test_backward_on_the_host_starts_no_second_openmp_team(mode):
    out = _child(mode)
    # libgomp's worker threads inherit their master's name: a team started on
    # autograd's device thread shows as one more "pt_autograd_0".
    assert out["autograd_threads"] == out["device_count"], json.dumps(out)
    assert out["inputs_unchanged"], json.dumps(out)
    for neuron, cpu, cpu_one, largest in zip(out["neuron_error"], out["cpu_error"], out["cpu_one_thread_error"],
                                             out["largest_gradient"]):
        # 1e-5 of the largest gradient: float32 rounding of a 256-term product,
        # a tenth of what TF32 arithmetic would give.
        assert neuron <= max(cpu, cpu_one, 1e-5 * largest), json.dumps(out)


def test_program_threads_keep_their_thread_count():
    out = _child("op")
    assert out["threads_before"] == 2
    assert out["threads_after"] == 2, "the program's thread was confined"
    assert out["user_thread"] == 2, "threads the program starts later were confined"
