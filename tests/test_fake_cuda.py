"""The CPU's stand-in for a CUDA device (fake_cuda.py) raises where CUDA raises and nowhere else: the
device-placement tests (test_devices.py) mean something only if it does."""

import pytest
import torch

from fake_cuda import MIXED, fake_cuda


def test_mixing_devices_raises_as_cuda_does():
    with fake_cuda():
        on_gpu, on_host = torch.ones(3, device="cuda"), torch.ones(3)
        assert on_gpu.device.type == "cuda" and on_gpu.is_cuda and on_host.device.type == "cpu"
        with pytest.raises(RuntimeError, match="found at least two devices"):
            on_gpu + on_host
        assert (on_gpu + torch.tensor(2.0)).device.type == "cuda"  # a 0-dim host tensor is a scalar to CUDA
        assert (on_gpu + on_host.to(on_gpu.device)).device.type == "cuda"
        assert torch.zeros(2, device=on_gpu.device).device.type == "cuda"
        moved = on_gpu.cpu()
        assert moved.device.type == "cpu" and on_gpu.device.type == "cuda"  # a move copies; the source stays
        with pytest.raises(TypeError, match="numpy"):
            on_gpu.numpy()


def test_indexing_follows_cuda_rules():
    """The first GPU run's train crash: a host tensor indexed by a device one (model/vocab.frequency_coverage)."""
    from eaglewire.model.vocab import frequency_coverage

    with fake_cuda():
        counts = torch.arange(10)
        t2d = torch.zeros(10, dtype=torch.bool, device="cuda")
        t2d[:3] = True
        with pytest.raises(RuntimeError, match="indices should be either on cpu or on the same device"):
            frequency_coverage(counts, t2d)
        assert frequency_coverage(counts, t2d.cpu()) == pytest.approx(3 / 45)
        assert counts.to("cuda")[torch.tensor([1, 2])].device.type == "cuda"  # device tensor, host indices: fine


def test_modules_train_on_the_fake_device():
    with fake_cuda():
        layer = torch.nn.Linear(4, 2).to("cuda")
        assert layer.weight.device.type == "cuda"
        opt = torch.optim.AdamW(layer.parameters())
        layer(torch.randn(3, 4, device="cuda")).sum().backward()
        opt.step()
        assert layer.weight.grad.device.type == "cuda"
        with pytest.raises(RuntimeError, match="found at least two devices"):
            layer(torch.randn(3, 4))  # input left on the host


def test_generators_and_the_mixed_message():
    with fake_cuda():
        probs = torch.ones(4, device="cuda")
        assert torch.multinomial(probs, 1, generator=torch.Generator(device="cuda")).device.type == "cuda"
        with pytest.raises(RuntimeError, match="'cuda' device type for generator"):
            torch.multinomial(probs, 1, generator=torch.Generator())
    assert "cuda:0 and cpu" in MIXED
    assert not torch.ones(1).is_cuda  # patched only while it lasts


def test_an_engines_host_states_are_checked_against_states_on_the_device(chat_tiny_target):
    """prepare --capture ENGINE on a GPU: the engine's states come from files (host), ours from the target (device)."""
    import copy

    from eaglewire.data.engine_capture import check_slots, states_here
    from eaglewire.model.target import Target

    with fake_cuda():
        target = Target(model=copy.deepcopy(chat_tiny_target.model).to("cuda"), tokenizer=None)
        here = states_here(target, [1, 2, 3, 4, 5])
        assert here[0].device.type == "cuda"
        engine = torch.stack([here[2].cpu(), here[5].cpu()], dim=1)  # [T, 2, H] as read from a file
        checks = check_slots(engine, [2, 5], here)
    assert [(c.boundary, c.closest) for c in checks] == [(2, 2), (5, 5)]


def test_fake_graphs_replay_into_the_captured_buffers_as_cuda_graphs_do():
    """A replay recomputes from the static inputs into the very tensors the capture returned (a caller keeping one
    past the next replay sees it overwritten), and a Python value read at capture stays baked in."""
    from eaglewire.decode.step_graphs import StepGraphs

    scale = {"now": 2.0}
    weight = None

    def step(x):
        return (x * weight + scale["now"],)  # weight: a device tensor; scale: a Python float, baked in

    with fake_cuda(graphs=True):
        weight = torch.full((3,), 10.0, device="cuda")
        graphs = StepGraphs(step)
        first = graphs("k", x=torch.ones(3, device="cuda"))[0]
        assert first.tolist() == [12.0] * 3 and first.device.type == "cuda"
        scale["now"] = 100.0  # a graph never sees it
        weight.fill_(1.0)  # a buffer it reads: it does
        second = graphs("k", x=torch.full((3,), 5.0, device="cuda"))[0]
        assert second is first and first.tolist() == [7.0] * 3  # the same buffer, overwritten
        assert len(graphs) == 1


def test_fake_graphs_refuse_a_host_read_or_copy_inside_a_capture():
    from eaglewire.decode.step_graphs import capture

    with fake_cuda(graphs=True):
        x = torch.ones(4, device="cuda")
        for body in (lambda: x.sum().item(), lambda: x.tolist(), lambda: x.cpu(),
                     lambda: x + torch.tensor([1.0, 2.0, 3.0, 4.0]).to("cuda")):
            with pytest.raises(RuntimeError, match="operation not permitted when stream is capturing"):
                capture(body, warmup=0)
        graph, out = capture(lambda: x * 2 + torch.arange(4, device="cuda"), warmup=1)  # device-only: captured
        x.fill_(3.0)
        graph.replay()
        assert out.tolist() == [6.0, 7.0, 8.0, 9.0]
