"""The libraries users train with pick neuron by themselves: Transformers'
Trainer and Accelerate find the device through their own checks (the module
`torch_neuronx` and `torch.neuron.is_available()`), with nothing set by hand,
and train on it as on CPU. A test here fails when a library upgrade changes
a check or what it switches on."""

from __future__ import annotations

import importlib.util

import pytest
import torch

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate", reason="make test installs Accelerate")


def _fresh_accelerate_state():
    # Accelerate keeps one process state (its device included) per process.
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    PartialState._reset_state()


@pytest.fixture
def fresh_state():
    _fresh_accelerate_state()
    yield
    _fresh_accelerate_state()


def test_transformers_and_accelerate_choose_neuron_by_their_own_checks(fresh_state, tmp_path):
    from accelerate import Accelerator
    from accelerate.utils import imports as accelerate_imports
    from transformers import TrainingArguments
    from transformers.utils import import_utils

    assert importlib.util.find_spec("torch_neuronx") is not None
    import torch_neuronx

    assert torch_neuronx.Stream is torch.neuron.Stream and torch_neuronx.device_count() == torch.neuron.device_count()
    assert import_utils.is_torch_neuron_available() and import_utils.is_torch_neuron_available(check_device=True)
    assert import_utils.is_torch_bf16_gpu_available()  # torch.neuron.is_bf16_supported()
    assert accelerate_imports.is_neuron_available(check_device=True)
    assert accelerate_imports.get_torch_accelerator_backend() == ("neuron", torch.neuron)
    assert Accelerator().device.type == "neuron"
    _fresh_accelerate_state()
    args = TrainingArguments(output_dir=str(tmp_path), bf16=True, torch_compile=True, report_to=[])
    assert args.device == torch.device("neuron", 0) and args.n_gpu == 1
    assert args.torch_compile_backend == "neuron"  # torch.compile(backend="neuron") for the model
    _fresh_accelerate_state()
    assert TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[]).device.type == "cpu"
    properties = torch.neuron.get_device_properties(0)
    assert properties.total_memory == torch.neuron.mem_get_info(0)[1] and properties.name.startswith("neuron")


def test_accelerate_mixed_precision_autocasts_and_scales_on_neuron(fresh_state):
    from accelerate import Accelerator

    accelerator = Accelerator(mixed_precision="fp16")
    assert accelerator.device.type == "neuron" and accelerator.scaler is not None
    assert accelerator.scaler._device == "neuron"
    model = accelerator.prepare(torch.nn.Linear(8, 4))
    assert next(model.parameters()).device.type == "neuron"
    with accelerator.autocast():  # (the prepared model's own outputs are converted back to float32)
        out = torch.nn.functional.linear(torch.randn(2, 8, device=accelerator.device), model.weight)
    assert out.dtype == torch.float16 and out.device.type == "neuron"


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def _train(output_dir, use_cpu: bool, max_steps: int, resume: bool = False) -> tuple:
    """A tiny Llama trained by Transformers' Trainer (gradient accumulation
    over 2 batches of 4, AdamW), a checkpoint every 5 steps; its losses."""
    from transformers import Trainer, TrainingArguments

    _fresh_accelerate_state()
    generator = torch.Generator().manual_seed(1)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 128, (80, 16), generator=generator)]
    args = TrainingArguments(output_dir=str(output_dir), max_steps=max_steps, per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, learning_rate=1e-3, logging_steps=1, use_cpu=use_cpu,
                             save_strategy="steps", save_steps=5, report_to=[], disable_tqdm=True)
    trainer = Trainer(model=_tiny_llama(), args=args, train_dataset=data)
    trainer.train(resume_from_checkpoint=resume or None)
    device = next(trainer.model.parameters()).device
    return device, [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_trainer_trains_a_tiny_llama_on_neuron_as_on_cpu_and_resumes_from_its_checkpoint(fresh_state, tmp_path,
                                                                                       compiled_only):
    """10 steps on neuron with nothing set by hand equal CPU's (use_cpu=True)
    within 1e-4, every op compiled; a Trainer stopped after the checkpoint at
    step 5 resumes from it and its last 5 losses equal the uninterrupted run's."""
    cpu_device, cpu_losses = _train(tmp_path / "cpu", use_cpu=True, max_steps=10)
    assert cpu_device.type == "cpu" and len(cpu_losses) == 10
    device, losses = _train(tmp_path / "neuron", use_cpu=False, max_steps=10)
    assert device.type == "neuron"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(cpu_losses), rtol=1e-4, atol=0)
    assert (tmp_path / "neuron" / "checkpoint-5" / "optimizer.pt").exists()
    _, resumed = _train(tmp_path / "neuron", use_cpu=False, max_steps=10, resume=True)
    # The resumed run logs steps 6 to 10 (its history holds the first 5 from the checkpoint's state).
    torch.testing.assert_close(torch.tensor(resumed[-5:]), torch.tensor(losses[5:]), rtol=1e-5, atol=0)


def test_peft_lora_fine_tunes_and_merges_as_on_cpu(compiled_only):
    """LoRA on a tiny Llama's attention (PEFT): 5 AdamW steps give CPU's
    losses, and the merged weights equal CPU's."""
    pytest.importorskip("peft", reason="make test installs PEFT")
    from peft import LoraConfig, get_peft_model

    def fine_tune(device):
        torch.manual_seed(1)
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights="gaussian")
        model = get_peft_model(_tiny_llama(), config).to(device)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        generator = torch.Generator().manual_seed(2)
        losses = []
        for _ in range(5):
            ids = torch.randint(0, 128, (4, 16), generator=generator).to(device)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses, {name: w.cpu() for name, w in model.merge_and_unload().state_dict().items()}

    cpu_losses, cpu_weights = fine_tune("cpu")
    losses, weights = fine_tune("neuron")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(cpu_losses), rtol=1e-5, atol=0)
    assert weights.keys() == cpu_weights.keys() and not any("lora" in name for name in weights)
    for name, w in weights.items():
        torch.testing.assert_close(w, cpu_weights[name], rtol=1e-5, atol=1e-6, msg=name)


def _lightning_fit(namespace: str, accelerator: str, precision: str = "32-true") -> tuple:
    """A LightningModule (a 2-layer MLP, SGD with momentum) fit for 6 steps; its losses and what it saw."""
    L = pytest.importorskip(namespace, reason="make test installs Lightning")

    class Regression(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
            self.losses, self.seen = [], set()

        def training_step(self, batch, _):
            x, y = batch
            out = self.net(x)
            self.seen.add((x.device.type, out.dtype))
            loss = torch.nn.functional.mse_loss(out.float(), y)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    generator = torch.Generator().manual_seed(2)
    x = torch.randn(48, 8, generator=generator)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())
    module = Regression()
    trainer = L.Trainer(accelerator=accelerator, devices=1, precision=precision, max_steps=6, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8))
    return module.losses, module.seen, trainer


@pytest.mark.parametrize("namespace", ["lightning.pytorch", "pytorch_lightning"])
def test_lightning_trainer_fits_on_neuron_by_name_as_on_cpu(namespace):
    """`Trainer(accelerator="neuron")` (registered when Lightning is imported)
    trains on the device, not on the CPU Lightning's single-device default
    would give a device that is not CUDA, with CPU's losses; under
    `precision="bf16-mixed"` autocast runs on neuron, not on CUDA."""
    cpu_losses, cpu_seen, _ = _lightning_fit(namespace, "cpu")
    losses, seen, trainer = _lightning_fit(namespace, "neuron")
    assert trainer.strategy.root_device == torch.device("neuron", 0) and seen == {("neuron", torch.float32)}
    assert type(trainer.accelerator).__name__ == "NeuronAccelerator" and len(losses) == 6
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(cpu_losses), rtol=1e-5, atol=0)
    _, seen, trainer = _lightning_fit(namespace, "neuron", precision="bf16-mixed")
    assert trainer.precision_plugin.device == "neuron" and seen == {("neuron", torch.bfloat16)}


def test_lightning_asking_for_more_neuron_devices_than_there_are_names_the_setting():
    L = pytest.importorskip("lightning.pytorch", reason="make test installs Lightning")
    from torchneuron.libraries.lightning import accelerator_class

    count = torch.neuron.device_count()
    with pytest.raises(ValueError, match=f"there are {count} .*TORCHNEURON_DEVICE_COUNT"):
        L.Trainer(accelerator="neuron", devices=count + 1, logger=False)
    with pytest.raises(ValueError, match="was given the device cpu"):
        accelerator_class("lightning.pytorch")().setup_device(torch.device("cpu"))
