"""What each rank runs in tests/test_distributed.py (spawned processes import
this module). Each worker writes what it found to `out/<rank>.pt`."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def _start(rank, world, port, backend="cpu:gloo,neuron:neuron", timeout=60):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    import torchneuron  # noqa: F401 - autoloaded by torch as well

    torch.neuron.set_device(rank % torch.neuron.device_count())
    kwargs = {"backend": backend} if backend else {}
    dist.init_process_group(rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout), **kwargs)


def _inputs(rank, world, dtype=torch.float32):
    g = torch.Generator().manual_seed(100 + rank)
    if dtype.is_floating_point:
        return torch.randn(4 * world, 3, generator=g).to(dtype)
    return torch.randint(0, 64, (4 * world, 3), generator=g, dtype=dtype)


def _on(device, value):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    return [_on(device, v) for v in value]


def _cpu(value):
    if isinstance(value, torch.Tensor):
        return value.cpu()
    return [_cpu(v) for v in value]


def _collectives(device, rank, world):
    """Each collective on `device`'s tensors: {name: (results, inputs after the call)}."""
    out = {}
    ops = {"sum": dist.ReduceOp.SUM, "product": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
           "max": dist.ReduceOp.MAX, "avg": dist.ReduceOp.AVG}
    for name, op in ops.items():
        t = _inputs(rank, world).to(device)
        dist.all_reduce(t, op=op)
        out[f"all_reduce {name}"] = ([t], [])
    for name, op in {"band": dist.ReduceOp.BAND, "bor": dist.ReduceOp.BOR, "bxor": dist.ReduceOp.BXOR}.items():
        t = _inputs(rank, world, torch.int32).to(device)
        dist.all_reduce(t, op=op)
        out[f"all_reduce {name}"] = ([t], [])
    t = _inputs(rank, world).to(device)
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    out["all_reduce async"] = ([t * 1], [])  # device work after wait() reads the result
    t = _inputs(rank, world).to(device)
    dist.broadcast(t, src=1)
    out["broadcast"] = ([t], [])
    t = _inputs(rank, world).to(device)
    dist.reduce(t, dst=0, op=dist.ReduceOp.MAX)
    out["reduce"] = ([t] if rank == 0 else [], [])
    x = _inputs(rank, world).to(device)
    gathered = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(gathered, x)
    out["all_gather"] = (gathered, [x])
    x = _inputs(rank, world).to(device)
    flat = torch.empty(world * x.shape[0], 3, device=device)
    dist.all_gather_into_tensor(flat, x)
    out["all_gather_into_tensor"] = ([flat], [x])
    xs = [_inputs(rank + 10 * k, world).to(device) for k in range(world)]
    y = torch.empty_like(xs[0])
    dist.reduce_scatter(y, xs)
    out["reduce_scatter"] = ([y], xs)
    x = _inputs(rank, world).to(device)
    y = torch.empty(4, 3, device=device)
    dist.reduce_scatter_tensor(y, x, op=dist.ReduceOp.AVG)
    out["reduce_scatter_tensor avg"] = ([y], [x])
    xs = [_inputs(rank + 10 * k, world)[:2].to(device) for k in range(world)]
    ys = [torch.empty(2, 3, device=device) for _ in range(world)]
    dist.all_to_all(ys, xs)
    out["all_to_all"] = (ys, xs)
    x = _inputs(rank, world).to(device)
    y = torch.empty_like(x)
    dist.all_to_all_single(y, x)
    out["all_to_all_single"] = ([y], [x])
    x = _inputs(rank, world).to(device)
    gathered = [torch.empty_like(x) for _ in range(world)] if rank == 0 else None
    dist.gather(x, gathered, dst=0)
    out["gather"] = (gathered or [], [x])
    y = torch.empty(4 * world, 3, device=device)
    pieces = [_inputs(10 + k, world).to(device) for k in range(world)] if rank == 0 else None
    dist.scatter(y, pieces, src=0)
    out["scatter"] = ([y], pieces or [])
    dist.barrier()
    x = _inputs(rank, world).to(device)
    if rank == 0:
        dist.send(x, dst=1)
        out["send/recv"] = ([], [x])
    elif rank == 1:
        y = torch.empty_like(x)
        dist.recv(y, src=0)
        out["send/recv"] = ([y], [])
    x = _inputs(rank, world).to(device)
    y = torch.empty_like(x)
    peer = (rank + 1) % world
    source = (rank - 1) % world
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, y, source)]):
        work.wait()
    out["batch_isend_irecv"] = ([y], [x])
    # Every rank posts its receive before it sends: a receive that waited
    # inside its kernel would deadlock here.
    x = _inputs(20 + rank, world).to(device)
    y = torch.empty_like(x)
    received = dist.irecv(y, src=source)
    dist.send(x, dst=peer)
    received.wait()
    out["irecv before send"] = ([y], [x])
    return {name: (_cpu(results), _cpu(inputs)) for name, (results, inputs) in out.items()}


def collectives(rank, world, port, out_dir, mode):
    os.environ["TORCHNEURON_EAGER_MODE"] = mode
    _start(rank, world, port)
    import torchneuron

    torchneuron.set_eager_mode(mode)
    cpu = _collectives("cpu", rank, world)
    neuron = _collectives("neuron", rank, world)
    torch.save({"cpu": cpu, "neuron": neuron, "memory_model": torchneuron.transfer_stats()["memory_model"]},
               os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


def default_group(rank, world, port, out_dir, backend):
    """init_process_group() with no backend (or "gloo") on a neuron host: neuron and CPU tensors."""
    _start(rank, world, port, backend=backend)
    t = torch.full((3,), float(rank + 1), device="neuron")
    dist.all_reduce(t)
    c = torch.full((3,), float(rank + 1))
    dist.all_reduce(c)
    torch.save({"neuron": t.cpu(), "cpu": c, "backends": dist.get_backend_config()},
               os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


def _cfg():
    from torchneuron.models import GPTConfig

    return GPTConfig(dropout=0.0)


def _fully_shard(**options):
    """FSDP2 on each block, then the whole model."""
    from torch.distributed.fsdp import fully_shard

    def shard(model):
        for block in model.blocks:
            fully_shard(block, **options)
        return fully_shard(model, **options)

    return shard


def _train_and_save(rank, world, out_dir, steps, **options):
    from torchneuron.models import train_gpt

    losses = train_gpt("neuron", steps, cfg=_cfg(), shard=(rank, world), **options)
    torch.save({"losses": losses}, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


def _ddp(model):
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, bucket_cap_mb=1)  # several buckets


def ddp(rank, world, port, out_dir, steps):
    _start(rank, world, port)
    _train_and_save(rank, world, out_dir, steps, wrap=_ddp)


def fsdp2(rank, world, port, out_dir, steps, reshard):
    _start(rank, world, port)
    _train_and_save(rank, world, out_dir, steps, wrap=_fully_shard(reshard_after_forward=reshard))


def single(out_dir, steps):
    """The whole batch in one process: what data parallelism must match."""
    import torchneuron  # noqa: F401

    from torchneuron.models import train_gpt

    torch.save({"losses": train_gpt("neuron", steps, cfg=_cfg()),
                "unclipped": train_gpt("neuron", steps, cfg=_cfg(), clip=False, foreach=False)}, os.path.join(out_dir, "single.pt"))


def dead_rank(rank, world, port, out_dir):
    """Rank 1 dies before the collective; rank 0 must raise, not hang."""
    import time

    _start(rank, world, port, timeout=15)
    t = torch.ones(8, device="neuron")
    dist.all_reduce(t)  # both ranks are up
    if rank == 1:
        os._exit(0)
    started = time.monotonic()
    try:
        dist.all_reduce(t)
        torch.neuron.synchronize()
        error = None
    except Exception as e:  # noqa: BLE001 - what the survivor saw
        error = f"{type(e).__name__}: {e}"
    torch.save({"error": error, "seconds": time.monotonic() - started}, os.path.join(out_dir, f"{rank}.pt"))
    os._exit(0)  # the group cannot be torn down cleanly without its peer


def hung_rank(rank, world, port, out_dir):
    """Rank 1 stops answering (it sleeps) before the collective; rank 0 must
    raise once the group's timeout passes."""
    import time

    _start(rank, world, port, timeout=10)
    t = torch.ones(8, device="neuron")
    dist.all_reduce(t)
    if rank == 1:
        time.sleep(20)
        os._exit(0)
    started = time.monotonic()
    try:
        dist.all_reduce(t)
        error = None
    except Exception as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {e}"
    torch.save({"error": error, "seconds": time.monotonic() - started}, os.path.join(out_dir, f"{rank}.pt"))
    os._exit(0)


def dtensors(rank, world, port, out_dir):
    """DeviceMesh("neuron") and DTensor ops and redistribution, against the full tensors on CPU."""
    _start(rank, world, port)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("neuron", (world,))
    g = torch.Generator().manual_seed(7)
    a, b = torch.randn(8, 6, generator=g), torch.randn(6, 4, generator=g)
    da = distribute_tensor(a.to("neuron"), mesh, [Shard(0)])
    db = distribute_tensor(b.to("neuron"), mesh, [Replicate()])
    out = {
        "local shard": da.to_local().cpu(),
        "matmul": (da @ db).full_tensor().cpu(),
        "sum": da.sum().full_tensor().cpu(),
        "shard1 -> replicate": distribute_tensor(a.to("neuron"), mesh, [Shard(1)]).redistribute(
            mesh, [Replicate()]).to_local().cpu(),
        "replicate -> shard0": distribute_tensor(a.to("neuron"), mesh, [Replicate()]).redistribute(
            mesh, [Shard(0)]).to_local().cpu(),
        "shard0 -> shard1": da.redistribute(mesh, [Shard(1)]).to_local().cpu(),
        "partial -> replicate": torch.distributed.tensor.DTensor.from_local(
            torch.full((3,), float(rank + 1), device="neuron"), mesh, [Partial()]).redistribute(
            mesh, [Replicate()]).to_local().cpu(),
        "device": str(da.device),
    }
    torch.save({"out": out, "a": a, "b": b}, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


def tensor_parallel(rank, world, port, out_dir, steps):
    """The GPT's MLPs split column-wise then row-wise over a 1-D mesh (the
    attention stays replicated); every rank trains on the whole batch."""
    _start(rank, world, port)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from torchneuron.models import train_gpt

    mesh = init_device_mesh("neuron", (world,))

    def split(model):
        for block in model.blocks:
            parallelize_module(block.mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        return model

    losses = train_gpt("neuron", steps, cfg=_cfg(), wrap=split, clip=False, foreach=False)
    torch.save({"losses": losses}, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


def compiled_ddp(rank, world, port, out_dir, steps):
    _start(rank, world, port)
    _train_and_save(rank, world, out_dir, steps, wrap=_ddp, compile_backend="neuron")


def _gpt_and_adamw(wrap=None):
    """The model and optimizer train_gpt makes (same seeds)."""
    from torchneuron.models import GPT

    torch.manual_seed(0)
    model = GPT(_cfg()).to("neuron")
    if wrap is not None:
        model = wrap(model)
    torch.manual_seed(1)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)


def _train(model, opt, first, last, shard=None):
    """train_gpt's steps first..last-1 (its data stream, skipped up to `first`)."""
    from torchneuron.models import SAMPLE_TEXT, char_dataset

    cfg, batch, losses = _cfg(), 8, []
    for step, (x, y) in enumerate(char_dataset(SAMPLE_TEXT * 4, cfg.block_size, batch, last, 0)):
        if step < first:
            continue
        if shard is not None:
            part = batch // shard[1]
            x, y = x[shard[0] * part:(shard[0] + 1) * part], y[shard[0] * part:(shard[0] + 1) * part]
        _, loss = model(x.to("neuron"), y.to("neuron"))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses


def checkpoint_save(rank, world, port, out_dir, steps, more):
    """FSDP2 on `world` ranks: train, save a sharded checkpoint (model and
    optimizer) with torch.distributed.checkpoint, then train on."""
    _start(rank, world, port)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    model, opt = _gpt_and_adamw(lambda m: fully_shard(m))
    before = _train(model, opt, 0, steps, shard=(rank, world))
    model_state, optim_state = get_state_dict(model, opt)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=os.path.join(out_dir, "checkpoint"))
    after = _train(model, opt, steps, steps + more, shard=(rank, world))
    torch.save({"before": before, "after": after}, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


def checkpoint_load(out_dir, steps, more):
    """One process, no process group: load the sharded checkpoint and train on
    the whole batch."""
    import torchneuron  # noqa: F401
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = _gpt_and_adamw()
    _train(model, opt, 0, 1)  # the optimizer's state exists, to be overwritten by the checkpoint's
    model_state, optim_state = get_state_dict(model, opt)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=os.path.join(out_dir, "checkpoint"))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    torch.save({"after": _train(model, opt, steps, steps + more)}, os.path.join(out_dir, "resumed.pt"))


def fsdp_tp(rank, world, port, out_dir, steps):
    """FSDP2 over the mesh's "dp" dimension and tensor parallelism (the
    MLPs) over "tp", on a 2x2 mesh."""
    _start(rank, world, port)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from torchneuron.models import train_gpt

    mesh = init_device_mesh("neuron", (2, world // 2), mesh_dim_names=("dp", "tp"))

    def split(model):
        for block in model.blocks:
            parallelize_module(block.mlp, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
            fully_shard(block, mesh=mesh["dp"])
        return fully_shard(model, mesh=mesh["dp"])

    dp_rank = mesh["dp"].get_local_rank()
    losses = train_gpt("neuron", steps, cfg=_cfg(), wrap=split, clip=False, foreach=False, shard=(dp_rank, 2))
    torch.save({"losses": losses, "dp": dp_rank}, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


def zero(rank, world, port, out_dir, steps):
    """ZeroRedundancyOptimizer (each rank keeps half the AdamW state) with DDP."""
    _start(rank, world, port)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    def optimizer(params):
        return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=3e-3, weight_decay=0.1)

    _train_and_save(rank, world, out_dir, steps, wrap=_ddp, optimizer=optimizer)


def _untied_gpt():
    """The GPT with its head's weight a copy of the embedding's (a pipeline
    puts the two on different stages)."""
    from torchneuron.models import GPT

    torch.manual_seed(0)
    model = GPT(_cfg())
    model.head.weight = torch.nn.Parameter(model.tok.weight.detach().clone())
    return model.to("neuron")


class _FirstStage(torch.nn.Module):
    def __init__(self, gpt):
        super().__init__()
        self.tok, self.pos, self.blocks = gpt.tok, gpt.pos, gpt.blocks[:1]

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.size(1), device=idx.device))
        for block in self.blocks:
            x = block(x)
        return x


class _LastStage(torch.nn.Module):
    def __init__(self, gpt):
        super().__init__()
        self.blocks, self.ln_f, self.head = gpt.blocks[1:], gpt.ln_f, gpt.head

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def _batches(steps):
    from torchneuron.models import SAMPLE_TEXT, char_dataset

    return char_dataset(SAMPLE_TEXT * 4, _cfg().block_size, 8, steps, 0)


def pipeline(rank, world, port, out_dir, steps, schedule_name):
    """The GPT in two stages, one per rank, 4 microbatches per step."""
    _start(rank, world, port)
    from torch.distributed import pipelining

    gpt = _untied_gpt()
    module = _FirstStage(gpt) if rank == 0 else _LastStage(gpt)
    stage = pipelining.PipelineStage(module, rank, world, torch.device("neuron", torch.neuron.current_device()))
    schedule = getattr(pipelining, schedule_name)(stage, n_microbatches=4, loss_fn=_loss)
    torch.manual_seed(1)
    opt = torch.optim.AdamW(module.parameters(), lr=3e-3, weight_decay=0.1)
    losses = []
    for x, y in _batches(steps):
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            schedule.step(x.to("neuron"))
        else:
            micro = []
            schedule.step(target=y.to("neuron"), losses=micro)
            losses.append(sum(m.item() for m in micro) / len(micro))
        opt.step()
    torch.save({"losses": losses}, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


def pipeline_reference(out_dir, steps):
    """The same model and optimizer in one process, on the whole batch."""
    import torchneuron  # noqa: F401

    gpt = _untied_gpt()
    torch.manual_seed(1)
    opt = torch.optim.AdamW(gpt.parameters(), lr=3e-3, weight_decay=0.1)
    losses = []
    for x, y in _batches(steps):
        opt.zero_grad(set_to_none=True)
        loss = _loss(_LastStage(gpt)(_FirstStage(gpt)(x.to("neuron"))), y.to("neuron"))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    torch.save({"losses": losses}, os.path.join(out_dir, "reference.pt"))


def fsdp2_mixed(rank, world, port, out_dir, steps):
    """FSDP2 with a mixed precision policy: bfloat16 compute, float32 gradient reduction."""
    _start(rank, world, port)
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    _train_and_save(rank, world, out_dir, steps, wrap=_fully_shard(mp_policy=policy))


def compiled_fsdp2(rank, world, port, out_dir, steps):
    _start(rank, world, port)
    _train_and_save(rank, world, out_dir, steps, wrap=_fully_shard(), compile_backend="neuron")


def premul_sum(rank, world, port, out_dir):
    """PREMUL_SUM(f) (which gloo lacks): the inputs scaled by f, then summed."""
    _start(rank, world, port)
    factor = 0.25
    t = _inputs(rank, world).to("neuron")
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(factor))
    x = _inputs(rank, world).to("neuron")
    y = torch.empty(4, 3, device="neuron")
    dist.reduce_scatter_tensor(y, x, op=dist._make_nccl_premul_sum(factor))
    c = _inputs(rank, world)
    dist.all_reduce(c)
    cx = _inputs(rank, world)
    cy = torch.empty(4, 3)
    dist.reduce_scatter_tensor(cy, cx)
    torch.save({"all_reduce": (t.cpu(), c * factor), "reduce_scatter": (y.cpu(), cy * factor),
                "input kept": (x.cpu(), cx)}, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


def _linear_and_batches(rank):
    torch.manual_seed(3)
    model = torch.nn.Linear(4, 2)
    g = torch.Generator().manual_seed(50 + rank)
    return model, torch.randn(5, 4, generator=g), torch.randn(5, 4, generator=g)


def ddp_no_sync(rank, world, port, out_dir):
    """Gradient accumulation: the first micro-batch under no_sync (no
    all-reduce), the second synchronized. Then the reducer's time stats,
    which DDP logs at its tenth iteration."""
    _start(rank, world, port)
    model, x1, x2 = _linear_and_batches(rank)
    ddp_model = _ddp(model.to("neuron"))
    with ddp_model.no_sync():
        ddp_model(x1.to("neuron")).square().sum().backward()
    local = ddp_model.module.weight.grad.cpu()
    ddp_model(x2.to("neuron")).square().sum().backward()
    synced = ddp_model.module.weight.grad.cpu()
    for _ in range(10):
        ddp_model(x2.to("neuron")).square().sum().backward()
    timing = {k: v for k, v in ddp_model._get_ddp_logging_data().items() if k.startswith("avg_")}
    torch.save({"no_sync": local, "synced": synced, "timing": timing}, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


class _NormMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(8)
        self.up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def sequence_parallel(rank, world, port, out_dir):
    """SequenceParallel on the norm (the sequence dimension sharded), then a
    column-wise / row-wise MLP that gathers and scatters it again."""
    _start(rank, world, port)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    torch.manual_seed(4)
    module = _NormMLP()
    x = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(5))
    mesh = init_device_mesh("neuron", (world,))
    parallel = parallelize_module(_copy_to_neuron(module), mesh, {
        "norm": SequenceParallel(),
        "up": ColwiseParallel(input_layouts=Shard(1)),
        "down": RowwiseParallel(output_layouts=Shard(1)),
    })
    local = x.chunk(world, 1)[rank].to("neuron").requires_grad_()
    out = parallel(local)
    out.sum().backward()
    torch.save({"out": out.cpu(), "grad": local.grad.cpu(), "x": x, "state": module.state_dict()},
               os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


def _copy_to_neuron(module):
    import copy

    return copy.deepcopy(module).to("neuron")


def checkpoint_dead_rank(rank, world, port, out_dir):
    """A rank dies while the others save: the save raises and leaves no
    checkpoint to load (DCP writes its metadata last, after every rank's data)."""
    _start(rank, world, port, timeout=15)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    model, opt = _gpt_and_adamw(lambda m: fully_shard(m))
    _train(model, opt, 0, 1, shard=(rank, world))
    if rank == 1:
        os._exit(0)
    model_state, optim_state = get_state_dict(model, opt)
    try:
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=os.path.join(out_dir, "checkpoint"))
        error = None
    except Exception as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {e}"[:500]
    torch.save({"error": error}, os.path.join(out_dir, f"{rank}.pt"))
    os._exit(0)


def _collective_program(x, w, group):
    """Device work, functional collectives on its results, device work on
    theirs: run compiled, each collective must see finished inputs and the
    work after it finished results."""
    import torch.distributed._functional_collectives as fc

    world = dist.get_world_size(group)
    y = torch.tanh(x @ w) * 2 + 1  # a collective's input, still being computed
    total = fc.all_reduce(y, "sum", group)
    gathered = fc.all_gather_tensor(total * 0.5, 0, group)
    scattered = fc.reduce_scatter_tensor(gathered @ w, "sum", 0, group)
    swapped = fc.all_to_all_single(scattered.contiguous(), None, None, group)
    return (swapped @ w).sin() + total.sum() / world  # reads every result


def compiled_functional_collectives(rank, world, port, out_dir):
    """The program compiled for neuron against the same program eager on CPU
    tensors (gloo), forward and backward through an autograd collective."""
    import torch.distributed._functional_collectives as fc

    import torchneuron

    _start(rank, world, port)
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(7 + rank)
    x, w = torch.randn(512, 512, generator=g), torch.randn(512, 512, generator=g) / 16
    want = _collective_program(x, w, group)
    compiled = torch.compile(_collective_program, backend="neuron")
    got = compiled(x.to("neuron"), w.to("neuron"), group)

    def trained(w):
        h = fc.all_gather_tensor_autograd(torch.tanh(x_dev @ w), 0, group)
        return (h @ w).square().mean()

    x_dev = x
    wc = w.clone().requires_grad_()
    trained(wc).backward()
    x_dev = x.to("neuron")
    wn = w.to("neuron").requires_grad_()
    torch.compile(trained, backend="neuron")(wn).backward()
    stats = torchneuron.compile_stats()["dynamo"]
    torch.save({"forward": (got.cpu(), want), "gradient": (wn.grad.cpu(), wc.grad),
                "inputs": ((x_dev.cpu(), wn.detach().cpu()), (x, w)), "stats": stats},
               os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


def fsdp2_float8(rank, world, port, out_dir, steps):
    """TorchAO float8 training (tensorwise) under FSDP2, with the weights
    all-gathered in float8 and, for comparison, in float32 (cast after the
    gather); each rank trains on its half of every batch."""
    _start(rank, world, port)
    from torch.distributed.fsdp import fully_shard
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    found = {}
    for float8_gather in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64),
                                    torch.nn.GELU(), torch.nn.Linear(64, 64))
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=float8_gather)
        model = convert_to_float8_training(model, config=config).to("neuron")
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(steps):
            x, y = torch.randn(32, 64, generator=g), torch.randn(32, 64, generator=g)
            x, y = x.chunk(world)[rank], y.chunk(world)[rank]
            loss = torch.nn.functional.mse_loss(model(x.to("neuron")), y.to("neuron"))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        found["float8" if float8_gather else "float32"] = {
            "losses": losses, "weight type": type(model[0].weight.to_local()).__name__}
    torch.save(found, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()
