"""torch.distributed on neuron (issue: distributed training), with real
processes on loopback: every collective against the same collective on CPU
tensors with gloo, DDP and FSDP2 against one process with the whole batch,
and a dead rank."""

import os
import socket
import sys

import pytest
import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))
import distributed_workers as workers  # noqa: E402

WORLD = 2


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(fn, out_dir, *args, world=WORLD, join=True):
    os.makedirs(out_dir, exist_ok=True)
    count = os.environ.get("TORCHNEURON_DEVICE_COUNT")
    os.environ["TORCHNEURON_DEVICE_COUNT"] = str(max(world, int(count or 1)))  # a device per rank
    try:
        mp.start_processes(fn, args=(world, _port(), str(out_dir), *args), nprocs=world, start_method="spawn",
                           join=join)
    finally:
        if count is None:
            del os.environ["TORCHNEURON_DEVICE_COUNT"]
        else:
            os.environ["TORCHNEURON_DEVICE_COUNT"] = count
    return [torch.load(os.path.join(out_dir, f"{r}.pt"), weights_only=False) for r in range(world)
            if os.path.exists(os.path.join(out_dir, f"{r}.pt"))]


@pytest.mark.parametrize("mode", ["op", "adaptive"])
def test_every_collective_matches_gloo_on_cpu_tensors(tmp_path, mode):
    ranks = _spawn(workers.collectives, tmp_path, mode)
    assert len(ranks) == WORLD
    expected = {"all_reduce sum", "all_reduce product", "all_reduce min", "all_reduce max", "all_reduce avg",
                "all_reduce band", "all_reduce bor", "all_reduce bxor", "all_reduce async", "broadcast", "reduce",
                "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor avg", "all_to_all",
                "all_to_all_single", "gather", "scatter", "send/recv", "batch_isend_irecv", "irecv before send"}
    for rank, found in enumerate(ranks):
        assert set(found["neuron"]) == set(found["cpu"]) == expected
        for name, (cpu_results, cpu_inputs) in found["cpu"].items():
            results, inputs = found["neuron"][name]
            assert len(results) == len(cpu_results), (rank, name)
            for got, want in zip(results, cpu_results):
                torch.testing.assert_close(got, want, msg=f"rank {rank}: {name}")
            for got, want in zip(inputs, cpu_inputs):  # inputs are left as they were
                torch.testing.assert_close(got, want, msg=f"rank {rank}: {name} changed its input")
    # The collectives did move data: ranks see each other's values.
    assert not torch.equal(ranks[0]["neuron"]["all_gather"][0][1], ranks[0]["neuron"]["all_gather"][1][0])
    torch.testing.assert_close(ranks[0]["neuron"]["all_reduce sum"][0][0], ranks[1]["neuron"]["all_reduce sum"][0][0])


@pytest.mark.parametrize("backend", [None, "gloo"])
def test_init_process_group_with_no_backend_or_gloo_covers_neuron_and_cpu_tensors(tmp_path, backend):
    ranks = _spawn(workers.default_group, tmp_path, backend)
    for found in ranks:
        assert torch.equal(found["neuron"], torch.full((3,), 3.0))
        assert torch.equal(found["cpu"], torch.full((3,), 3.0))
        assert f"neuron:{backend or 'neuron'}" in str(found["backends"])


STEPS = 10


def _alone(target, out_dir, *args) -> None:
    """`target(out_dir, *args)` in a process of its own (no process group)."""
    process = mp.get_context("spawn").Process(target=target, args=(str(out_dir), *args))
    process.start()
    process.join(900)
    assert process.exitcode == 0


@pytest.fixture(scope="module")
def single_process_losses(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    _alone(workers.single, out, STEPS)
    return torch.load(os.path.join(out, "single.pt"))


def _mean_over_ranks(ranks) -> list:
    return [sum(r["losses"][k] for r in ranks) / len(ranks) for k in range(STEPS)]


def _assert_matches(losses, reference, **tolerance):
    assert len(losses) == len(reference)
    for step, (got, want) in enumerate(zip(losses, reference)):
        assert got == pytest.approx(want, **tolerance), (step, losses, reference)


def test_ddp_matches_one_process_with_the_whole_batch(tmp_path, single_process_losses):
    ranks = _spawn(workers.ddp, tmp_path, STEPS)
    losses = _mean_over_ranks(ranks)
    assert losses[-1] < losses[0]  # it trained
    _assert_matches(losses, single_process_losses["losses"], abs=1e-5)


@pytest.mark.parametrize("reshard", [True, False])
def test_fsdp2_matches_one_process_with_the_whole_batch(tmp_path, single_process_losses, reshard):
    ranks = _spawn(workers.fsdp2, tmp_path, STEPS, reshard)
    losses = _mean_over_ranks(ranks)
    _assert_matches(losses, single_process_losses["losses"], abs=1e-5)


def test_a_dead_rank_makes_the_others_raise_within_the_timeout(tmp_path):
    ranks = _spawn(workers.dead_rank, tmp_path, join=True)
    survivor = ranks[0]
    assert survivor["error"] is not None, "the collective with a dead peer returned"
    assert survivor["seconds"] < 60


def test_a_hung_rank_makes_the_others_raise_once_the_timeout_passes(tmp_path):
    survivor = _spawn(workers.hung_rank, tmp_path)[0]
    assert survivor["error"] is not None, "the collective with a hung peer returned"
    assert 5 < survivor["seconds"] < 19, survivor  # the group timeout is 10 s; the peer sleeps 20 s


def test_device_mesh_and_dtensor_ops_and_redistribution(tmp_path):
    ranks = _spawn(workers.dtensors, tmp_path)
    a, b = ranks[0]["a"], ranks[0]["b"]
    for rank, found in enumerate(ranks):
        out = found["out"]
        assert out["device"].startswith("neuron")
        torch.testing.assert_close(out["local shard"], a.chunk(WORLD, 0)[rank])
        torch.testing.assert_close(out["matmul"], a @ b)
        torch.testing.assert_close(out["sum"], a.sum())
        torch.testing.assert_close(out["shard1 -> replicate"], a)
        torch.testing.assert_close(out["replicate -> shard0"], a.chunk(WORLD, 0)[rank])
        torch.testing.assert_close(out["shard0 -> shard1"], a.chunk(WORLD, 1)[rank])
        torch.testing.assert_close(out["partial -> replicate"], torch.full((3,), float(sum(range(1, WORLD + 1)))))


def test_tensor_parallel_gpt_matches_one_process(tmp_path, single_process_losses):
    ranks = _spawn(workers.tensor_parallel, tmp_path, STEPS)
    for found in ranks:
        _assert_matches(found["losses"], single_process_losses["unclipped"], abs=1e-5)


def test_compiled_ddp_matches_one_process(tmp_path, single_process_losses):
    ranks = _spawn(workers.compiled_ddp, tmp_path, STEPS)
    losses = _mean_over_ranks(ranks)
    _assert_matches(losses, single_process_losses["losses"], abs=1e-4)


def test_a_checkpoint_saved_on_two_ranks_loads_on_one_and_training_resumes(tmp_path):
    steps, more = 4, 3
    ranks = _spawn(workers.checkpoint_save, tmp_path, steps, more)
    assert (tmp_path / "checkpoint" / ".metadata").exists()
    _alone(workers.checkpoint_load, tmp_path, steps, more)
    resumed = torch.load(tmp_path / "resumed.pt")["after"]
    on_two = [sum(r["after"][k] for r in ranks) / len(ranks) for k in range(more)]
    _assert_matches(resumed, on_two, abs=1e-5)


def test_fsdp2_with_tensor_parallel_on_a_2x2_mesh(tmp_path, single_process_losses):
    ranks = _spawn(workers.fsdp_tp, tmp_path, 5, world=4)
    assert len(ranks) == 4
    for k in range(5):  # the two data-parallel halves average to the whole batch's loss
        by_dp = {r["dp"]: r["losses"][k] for r in ranks}
        got = sum(by_dp.values()) / 2
        assert got == pytest.approx(single_process_losses["unclipped"][k], abs=1e-5), (k, ranks)


def test_zero_redundancy_optimizer_with_ddp_matches_one_process(tmp_path, single_process_losses):
    ranks = _spawn(workers.zero, tmp_path, STEPS)
    losses = _mean_over_ranks(ranks)
    _assert_matches(losses, single_process_losses["losses"], abs=1e-5)


_TORCHRUN_SCRIPT = """
import os, torch, torch.distributed as dist
torch.neuron.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group()
rank = dist.get_rank()
t = torch.full((4,), float(rank + 1), device="neuron")
dist.all_reduce(t)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2).to("neuron"))
model(t[None]).sum().backward()
print(f"rank {rank} of {dist.get_world_size()} on {t.device}: {t.cpu().tolist()}", flush=True)
dist.destroy_process_group()
"""


def _torchrun(script, *flags, env=None):
    import subprocess

    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *flags, str(script)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, TORCHNEURON_DEVICE_COUNT="2", **(env or {})))


def test_torchrun_on_one_host_and_as_two_hosts(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_TORCHRUN_SCRIPT)
    one_host = _torchrun(script, "--nproc-per-node", "2", "--master-port", str(_port()))
    out = one_host.communicate(timeout=600)[0]
    assert one_host.returncode == 0, out[-3000:]
    assert "rank 0 of 2 on neuron:0: [3.0, 3.0, 3.0, 3.0]" in out and "rank 1 of 2 on neuron:1" in out
    # Two "hosts" (two launchers, a node rank each) meeting over TCP on loopback.
    port = str(_port())
    hosts = [_torchrun(script, "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node),
                       "--master-addr", "127.0.0.1", "--master-port", port) for node in (0, 1)]
    outs = [h.communicate(timeout=600)[0] for h in hosts]
    assert all(h.returncode == 0 for h in hosts), outs
    assert "rank 0 of 2 on neuron:0: [3.0, 3.0, 3.0, 3.0]" in outs[0]
    assert "rank 1 of 2 on neuron:0: [3.0, 3.0, 3.0, 3.0]" in outs[1]


@pytest.fixture(scope="module")
def pipeline_reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline")
    _alone(workers.pipeline_reference, out, STEPS)
    return torch.load(os.path.join(out, "reference.pt"))["losses"]


@pytest.mark.parametrize("schedule", ["ScheduleGPipe", "Schedule1F1B"])
def test_a_two_stage_pipeline_matches_one_process(tmp_path, pipeline_reference, schedule):
    ranks = _spawn(workers.pipeline, tmp_path, STEPS, schedule)
    losses = ranks[1]["losses"]  # the last stage computes the loss
    assert losses[-1] < losses[0]
    _assert_matches(losses, pipeline_reference, abs=1e-5)


def test_fsdp2_with_a_bfloat16_mixed_precision_policy_trains_close_to_float32(tmp_path, single_process_losses):
    ranks = _spawn(workers.fsdp2_mixed, tmp_path, STEPS)
    losses = _mean_over_ranks(ranks)
    assert losses[-1] < losses[0]
    _assert_matches(losses, single_process_losses["losses"], rel=2e-2)


def test_fsdp2_all_gathers_float8_weights_as_torchao_trains_them(tmp_path):
    """TorchAO's float8 training under FSDP2 with enable_fsdp_float8_all_gather:
    the shards are cast to float8 before the all-gather (the weights are
    TorchAO's float8 weight wrapper) and training follows the same model
    gathered in float32 and cast after: the same global amax, so the same
    casts."""
    ranks = _spawn(workers.fsdp2_float8, tmp_path, 5)
    for found in ranks:
        assert found["float8"]["weight type"] == "WeightWithDynamicFloat8CastTensor", found
        assert found["float32"]["weight type"] != "WeightWithDynamicFloat8CastTensor", found
        _assert_matches(found["float8"]["losses"], found["float32"]["losses"], rel=1e-5)


def test_compiled_fsdp2_matches_one_process(tmp_path, single_process_losses):
    ranks = _spawn(workers.compiled_fsdp2, tmp_path, STEPS)
    losses = _mean_over_ranks(ranks)
    _assert_matches(losses, single_process_losses["losses"], abs=1e-4)


def test_premul_sum_scales_then_sums(tmp_path):
    for found in _spawn(workers.premul_sum, tmp_path):
        for name, (got, want) in found.items():
            torch.testing.assert_close(got, want, msg=name)


def test_ddp_no_sync_accumulates_locally_then_averages(tmp_path):
    ranks = _spawn(workers.ddp_no_sync, tmp_path)
    local = []
    for rank, found in enumerate(ranks):
        model, x1, x2 = workers._linear_and_batches(rank)
        model(x1).square().sum().backward()
        torch.testing.assert_close(found["no_sync"], model.weight.grad)  # not reduced
        model(x2).square().sum().backward()
        local.append(model.weight.grad.clone())
    mean = sum(local) / len(local)
    for found in ranks:
        torch.testing.assert_close(found["synced"], mean)
        # The reducer has a neuron timer: its figures, not "only collected for CPU and CUDA".
        assert found["timing"]["avg_forward_compute_time"] > 0, found["timing"]


def test_sequence_parallel_norm_with_a_tensor_parallel_mlp(tmp_path):
    ranks = _spawn(workers.sequence_parallel, tmp_path)
    module = workers._NormMLP()
    module.load_state_dict(ranks[0]["state"])
    x = ranks[0]["x"].clone().requires_grad_()
    out = module(x)
    out.sum().backward()
    for rank, found in enumerate(ranks):
        torch.testing.assert_close(found["out"], out.detach().chunk(WORLD, 1)[rank])
        torch.testing.assert_close(found["grad"], x.grad.chunk(WORLD, 1)[rank])


def test_a_rank_dying_during_a_checkpoint_leaves_none_to_load(tmp_path):
    survivor = _spawn(workers.checkpoint_dead_rank, tmp_path)[0]
    assert survivor["error"] is not None
    assert not (tmp_path / "checkpoint" / ".metadata").exists()


def test_functional_collectives_inside_a_compiled_graph_run_in_order_with_its_device_work(tmp_path):
    """A graph with functional collectives compiles in pieces around them
    (none of it falls back to eager) and gives gloo-on-CPU's results."""
    for rank, found in enumerate(_spawn(workers.compiled_functional_collectives, tmp_path)):
        got, want = found["forward"]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"rank {rank}")
        got, want = found["gradient"]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=f"rank {rank}")
        for got, want in zip(*found["inputs"]):  # the inputs are left as they were
            assert torch.equal(got, want), f"rank {rank}"
        stats = found["stats"]
        assert stats.get("graphs_fallback", 0) == 0, stats
        assert stats["graphs_around_kernels"] >= 3, stats  # forward, training forward and backward


# The discrete memory model (a device with memory of its own, here the CPU
# driver under TORCHNEURON_MEMORY=discrete): gloo works on host copies and
# what it wrote is copied back (distributed/collectives.py).
@pytest.fixture
def discrete(monkeypatch):
    monkeypatch.setenv("TORCHNEURON_MEMORY", "discrete")


def test_every_collective_on_the_discrete_model_matches_gloo_on_cpu_tensors(tmp_path, discrete):
    ranks = _spawn(workers.collectives, tmp_path, "op")
    assert len(ranks) == WORLD
    for rank, found in enumerate(ranks):
        assert found["memory_model"] == "discrete"
        assert set(found["neuron"]) == set(found["cpu"]) and len(found["cpu"]) == 22
        for name, (cpu_results, cpu_inputs) in found["cpu"].items():
            results, inputs = found["neuron"][name]
            for got, want in zip(results, cpu_results):
                torch.testing.assert_close(got, want, msg=f"rank {rank}: {name}")
            for got, want in zip(inputs, cpu_inputs):
                torch.testing.assert_close(got, want, msg=f"rank {rank}: {name} changed its input")
    torch.testing.assert_close(ranks[0]["neuron"]["all_reduce sum"][0][0], ranks[1]["neuron"]["all_reduce sum"][0][0])


def test_ddp_and_fsdp2_on_the_discrete_model_match_one_process(tmp_path, single_process_losses, discrete):
    for name, worker, extra in (("ddp", workers.ddp, ()), ("fsdp2", workers.fsdp2, (True,))):
        ranks = _spawn(worker, tmp_path / name, STEPS, *extra)
        _assert_matches(_mean_over_ranks(ranks), single_process_losses["losses"], abs=1e-5)


def test_a_checkpoint_saved_on_the_discrete_model_loads_and_training_resumes(tmp_path, discrete):
    steps, more = 3, 2
    ranks = _spawn(workers.checkpoint_save, tmp_path, steps, more)
    _alone(workers.checkpoint_load, tmp_path, steps, more)
    resumed = torch.load(tmp_path / "resumed.pt")["after"]
    on_two = [sum(r["after"][k] for r in ranks) / len(ranks) for k in range(more)]
    _assert_matches(resumed, on_two, abs=1e-5)
