"""Package set-up, autoload and device naming (issue items 1-2)."""

import subprocess
import sys

import torch


def test_autoload_without_importing_torchneuron():
    code = (
        "import sys, torch\n"
        "x = torch.randn(4, 4, device='neuron')\n"
        "r = (x @ x).sum().item()\n"
        "ref = (x.cpu() @ x.cpu()).sum().item()\n"
        "assert abs(r - ref) < 1e-4, (r, ref)\n"
        "print('ok', type(r).__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok float"


def test_device_names():
    assert torch.device("neuron").type == "neuron"
    assert torch.device("neuron:1").index == 1
    x = torch.ones(2)
    assert x.neuron().device == torch.device("neuron:0")
    assert x.neuron(1).device == torch.device("neuron:1")
    assert x.neuron().is_neuron and not x.is_neuron
    assert torch._C._get_privateuse1_backend_name() == "neuron"


def test_module_to_neuron_moves_parameters_and_buffers():
    m = torch.nn.BatchNorm1d(3)
    m.to("neuron")
    assert all(p.device.type == "neuron" for p in m.parameters())
    assert all(b.device.type == "neuron" for b in m.buffers())
    m2 = torch.nn.Linear(3, 2).neuron(1)
    assert m2.weight.device == torch.device("neuron:1")


def test_module_to_keeps_parameter_identity_and_tied_weights():
    emb = torch.nn.Embedding(5, 3)
    head = torch.nn.Linear(3, 5, bias=False)
    head.weight = emb.weight
    model = torch.nn.Sequential(emb, head)
    param = emb.weight
    model.to("neuron")
    assert emb.weight is param and head.weight is emb.weight
    assert param.device.type == "neuron"
    model.to("cpu")
    assert emb.weight is param and param.device.type == "cpu"


def test_storage_methods_generated():
    s = torch.ones(3).untyped_storage()
    assert s.neuron().device.type == "neuron"
    assert torch.ones(3, device="neuron").untyped_storage().is_neuron


def test_cli_info_reports_devices():
    import json

    out = subprocess.run(
        [sys.executable, "-m", "torchneuron.cli", "info", "--json"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["available"] is True
    assert info["driver"] == "local-task" and "local-task" in info["available_drivers"]
    assert info["memory_model"] == "unified"
    assert info["drivers"]["local-task"]["memory"] == "unified" and info["drivers"]["local-task"]["devices"]
    assert set(info["drivers"]) == set(info["available_drivers"])
    assert "bfloat16" in info["dtypes"]
