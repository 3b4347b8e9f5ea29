"""Memory and throughput for real workloads: micro-batches, activation checkpointing, torch.compile
(``node.runtime.local_training``), the outer state's placement (``gossip.placement``), MFU (``node.runtime.mfu``) and their
flags. Everything runs on the CPU; the CUDA paths have tests of their own that run where CUDA is."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from gossip.fragments import merge_fragment
from gossip.outer import NesterovOuter, NoLoCoOuter
from gossip.placement import OuterPlacement, to_host
from node.runtime.mfu import flops_per_token, lookup_peak_tflops, mfu, peak_flops, peak_memory_mb
from node.runtime.local_training import LocalTrainer, checkpoint_blocks
from swarm.models.presets import PRESETS, preset

CPU = torch.device("cpu")
FAMILIES = [name for name in ("nano", "llama-tiny") if name in PRESETS]  # one preset of each model family


def _batch(name: str, rows: int, seed: int = 1, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` random sequences of ``length`` tokens (the preset's context by default)."""
    cfg = preset(name)
    g = torch.Generator().manual_seed(seed)
    shape = (rows, length or cfg.context)
    x = torch.randint(0, cfg.vocab_size, shape, generator=g)
    return x, torch.randint(0, cfg.vocab_size, shape, generator=g)


def _loss_and_grads(trainer: LocalTrainer, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    trainer.model.train()
    trainer.optimizer.zero_grad(set_to_none=True)
    loss = trainer._accumulate(x, y)
    return loss, [p.grad.clone() for p in trainer.model.parameters()]


# ---- micro-batches ------------------------------------------------------------------------------
@pytest.mark.parametrize("micro", [1, 3, 4, 7])
def test_micro_batched_gradient_equals_the_full_batch_gradient(micro):
    x, y = _batch("nano", 7)  # 7 rows: 3 gives a ragged last micro-batch of 1
    full_loss, full = _loss_and_grads(LocalTrainer(cfg=preset("nano"), device=CPU, lr=1e-3, seed=0), x, y)
    loss, grads = _loss_and_grads(LocalTrainer(cfg=preset("nano"), device=CPU, lr=1e-3, seed=0, micro_batch_size=micro), x, y)
    assert torch.allclose(loss, full_loss, rtol=1e-6, atol=1e-6)
    for a, b in zip(grads, full):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_micro_batched_steps_follow_the_full_batch_steps():
    x, y = _batch("nano", 8)
    full = LocalTrainer(cfg=preset("nano"), device=CPU, lr=1e-3, seed=0)
    micro = LocalTrainer(cfg=preset("nano"), device=CPU, lr=1e-3, seed=0, micro_batch_size=3)
    for _ in range(3):
        assert full.step(x, y) == pytest.approx(micro.step(x, y), rel=1e-5)
    for a, b in zip(full.parameters(), micro.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_whole_batch_step_is_bit_identical_to_the_plain_training_step():
    """Without the new options a step is exactly what it was: forward, backward, clip, AdamW."""
    x, y = _batch("nano", 4)
    trainer = LocalTrainer(cfg=preset("nano"), device=CPU, lr=1e-3, seed=0, micro_batch_size=4)
    ref = LocalTrainer(cfg=preset("nano"), device=CPU, lr=1e-3, seed=0)
    for _ in range(2):
        loss = trainer.step(x, y)
        for group in ref.optimizer.param_groups:
            group["lr"] = ref.current_lr()
        _, ref_loss = ref.model(x, y)
        ref.optimizer.zero_grad(set_to_none=True)
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.model.parameters(), 1.0)
        ref.optimizer.step()
        ref.steps += 1
        assert loss == float(ref_loss.item())
    assert all(torch.equal(a, b) for a, b in zip(trainer.parameters(), ref.parameters()))


def test_a_non_finite_loss_raises_and_leaves_the_weights_alone():
    trainer = LocalTrainer(cfg=preset("nano"), device=CPU, lr=1e-3, seed=0, micro_batch_size=2)
    with torch.no_grad():
        trainer.model.blocks[0].ln1.weight.fill_(float("nan"))
    before = [p.clone() for p in trainer.parameters()]
    with pytest.raises(FloatingPointError, match="lower --lr"):
        trainer.step(*_batch("nano", 4))
    for a, b in zip(trainer.parameters(), before):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


# ---- activation checkpointing ---------------------------------------------------------------------
def _saved_bytes(trainer: LocalTrainer, x: torch.Tensor, y: torch.Tensor) -> int:
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        trainer.model(x, y)[1].backward()
    return saved


@pytest.mark.parametrize("name", FAMILIES)
def test_activation_checkpointing_gives_identical_loss_and_gradients_and_keeps_less(name):
    x, y = _batch(name, 2)
    plain = LocalTrainer(cfg=preset(name), device=CPU, lr=1e-3, seed=0)
    ckpt = LocalTrainer(cfg=preset(name), device=CPU, lr=1e-3, seed=0, activation_checkpointing=True)
    assert [n for n, _ in ckpt.model.named_parameters()] == [n for n, _ in plain.model.named_parameters()]
    loss, grads = _loss_and_grads(ckpt, x, y)
    ref_loss, ref = _loss_and_grads(plain, x, y)
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref))
    assert _saved_bytes(ckpt, x, y) < _saved_bytes(plain, x, y) / 2


def test_checkpointing_needs_the_blocks_in_model_blocks():
    with pytest.raises(ValueError, match="model.blocks"):
        checkpoint_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_evaluation_under_checkpointing_needs_no_recomputation():
    trainer = LocalTrainer(cfg=preset("nano"), device=CPU, lr=1e-3, seed=0, activation_checkpointing=True)
    plain = LocalTrainer(cfg=preset("nano"), device=CPU, lr=1e-3, seed=0)
    batches = [_batch("nano", 2, seed) for seed in (1, 2)]
    assert trainer.evaluate(batches) == plain.evaluate(batches)


# ---- torch.compile --------------------------------------------------------------------------------
def test_compiled_training_steps_like_eager():
    """The compile path with the ``eager`` backend (Dynamo's tracing without code generation: seconds)."""
    torch._dynamo.reset()
    x, y = _batch("nano", 6)
    compiled = LocalTrainer(cfg=preset("nano"), device=CPU, lr=1e-3, seed=0, compile=True, compile_backend="eager",
                            micro_batch_size=4, activation_checkpointing=True)
    eager = LocalTrainer(cfg=preset("nano"), device=CPU, lr=1e-3, seed=0, micro_batch_size=4)
    assert compiled.train_model is not compiled.model
    for _ in range(2):
        assert compiled.step(x, y) == pytest.approx(eager.step(x, y), rel=1e-5)
    assert compiled.train_model is not compiled.model  # it did not fall back
    for a, b in zip(compiled.parameters(), eager.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_a_failing_compilation_falls_back_to_eager_with_one_warning(caplog):
    torch._dynamo.reset()

    def broken_backend(gm, example_inputs):
        raise RuntimeError("no C++ compiler here\nmore lines of a long traceback")

    x, y = _batch("nano", 4)
    trainer = LocalTrainer(cfg=preset("nano"), device=CPU, lr=1e-3, seed=0, compile=True, compile_backend=broken_backend)
    eager = LocalTrainer(cfg=preset("nano"), device=CPU, lr=1e-3, seed=0)
    with caplog.at_level(logging.WARNING, logger="locomesh.node"):
        losses = [trainer.step(x, y) for _ in range(2)]
    assert losses == [eager.step(x, y) for _ in range(2)]
    assert trainer.train_model is trainer.model
    warnings = [r.getMessage() for r in caplog.records if r.name == "locomesh.node"]
    assert len(warnings) == 1 and "torch.compile failed" in warnings[0] and "\n" not in warnings[0]
    assert "no C++ compiler here" in warnings[0]


@pytest.mark.slow
def test_compiled_training_with_inductor():
    """torch.compile's default backend generates C++ on the CPU: about a minute on two busy cores,
    so it runs with the slow tests only."""
    torch._dynamo.reset()
    x, y = _batch("nano", 4)
    trainer = LocalTrainer(cfg=preset("nano"), device=CPU, lr=1e-3, seed=0, compile=True)
    eager = LocalTrainer(cfg=preset("nano"), device=CPU, lr=1e-3, seed=0)
    assert trainer.step(x, y) == pytest.approx(eager.step(x, y), rel=1e-4)
    assert trainer.train_model is not trainer.model


def test_forward_loss_is_the_models_loss():
    trainer = LocalTrainer(cfg=preset("nano"), device=CPU, lr=1e-3, seed=0)
    x, y = _batch("nano", 2)
    with torch.no_grad():
        assert torch.equal(trainer.forward_loss(x, y), trainer.model(x, y)[1])


# ---- outer state placement ------------------------------------------------------------------------
def test_outer_state_on_the_cpu_is_pinned_only_with_a_cuda_model():
    assert OuterPlacement.choose(CPU, "cpu").device == CPU and not OuterPlacement.choose(CPU, "cpu").pin
    assert OuterPlacement.choose(CPU, "same").device == CPU
    on_cuda = OuterPlacement.choose(torch.device("cuda"), "cpu")
    assert on_cuda.device == CPU and on_cuda.pin == torch.cuda.is_available()
    assert OuterPlacement.choose(torch.device("cuda"), "same").device.type == "cuda"
    with pytest.raises(ValueError):
        OuterPlacement.choose(CPU, "gpu")
    phi = OuterPlacement.choose(CPU, "cpu").copy_of([torch.ones(3, dtype=torch.float64)])
    assert phi[0].device == CPU and phi[0].dtype == torch.float32 and not phi[0].is_pinned()


def _round_trip(placement: OuterPlacement, outer: NesterovOuter, params: list[torch.Tensor], phi: list[torch.Tensor],
                deltas_of_peers: list[torch.Tensor]) -> None:
    """One outer round as the daemon runs it: θ snapshot, Δ, mean with a peer's Δ, outer step, θ ← φ."""
    theta = placement.copy_of(params)
    delta = to_host([p - t for p, t in zip(phi, theta)])
    mean = [(d + o) / 2 for d, o in zip(delta, deltas_of_peers)]
    outer.step(phi, mean)
    merge_fragment(params, phi, 0.0)


def test_outer_rounds_are_bit_identical_to_the_plain_cpu_copies():
    """The placement's copies are the fp32 copies the node always made: same φ, momentum and θ."""
    torch.manual_seed(0)
    params = [torch.randn(5, 3), torch.randn(7)]
    ref_params = [p.clone() for p in params]
    placement = OuterPlacement.choose(CPU, "cpu")
    phi = placement.copy_of(params)
    ref_phi = [p.detach().to("cpu", torch.float32).clone() for p in ref_params]
    outer, ref_outer = NesterovOuter(0.7, 0.9), NesterovOuter(0.7, 0.9)
    for r in range(3):
        for p, q in zip(params, ref_params):
            step = torch.randn(p.shape, generator=torch.Generator().manual_seed(r))
            p.add_(step, alpha=0.01)
            q.add_(step, alpha=0.01)
        peer = [torch.randn(p.shape, generator=torch.Generator().manual_seed(100 + r)) * 1e-2 for p in params]
        _round_trip(placement, outer, params, phi, peer)
        # the node before the placement: .to("cpu", float32).clone() snapshots and a blocking merge
        theta = [q.detach().to("cpu", torch.float32).clone() for q in ref_params]
        ref_outer.step(ref_phi, [(p - t + o) / 2 for p, t, o in zip(ref_phi, theta, peer)])
        for q, p in zip(ref_params, ref_phi):
            q.copy_(p.to(q.device, q.dtype))
    assert all(torch.equal(a, b) for a, b in zip(phi, ref_phi))
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
    assert all(torch.equal(a, b) for a, b in zip(outer.state_tensors(phi), ref_outer.state_tensors(ref_phi)))


def test_outer_momentum_follows_phi_and_travels_as_host_tensors():
    outer = NoLoCoOuter()
    outer.load_state_tensors([torch.ones(3)])
    phi = [torch.zeros(3)]
    outer.step(phi, [torch.ones(3)], [torch.ones(3)])
    state = outer.state_tensors(phi)
    assert state[0].device == CPU and state[0].data_ptr() != outer.buffers[0].data_ptr()


cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda_only
@pytest.mark.parametrize("where", ["cpu", "same"])
def test_outer_rounds_on_cuda_match_the_cpu(where):
    torch.manual_seed(0)
    params = [torch.randn(64, 32, device="cuda"), torch.randn(33, device="cuda")]
    cpu_params = [p.cpu() for p in params]
    placement = OuterPlacement.choose(torch.device("cuda"), where)
    phi, cpu_phi = placement.copy_of(params), OuterPlacement(CPU).copy_of(cpu_params)
    if where == "cpu":
        assert all(t.device == CPU and t.is_pinned() for t in phi)
        assert all(t.is_pinned() for t in placement.copy_of(params))
    else:
        assert all(t.is_cuda for t in phi)
    outer, cpu_outer = NesterovOuter(0.7, 0.9), NesterovOuter(0.7, 0.9)
    for r in range(3):
        for p, q in zip(params, cpu_params):
            p.add_(0.01)
            q.add_(0.01)
        peer = [torch.full(p.shape, 1e-3 * (r + 1)) for p in params]
        _round_trip(placement, outer, params, phi, peer)
        _round_trip(OuterPlacement(CPU), cpu_outer, cpu_params, cpu_phi, peer)
        assert all(b.device == phi[0].device for b in outer.buffers.values())
    for a, b in zip(params, cpu_params):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-6, atol=1e-6)


@cuda_only
def test_cuda_training_keeps_bf16_autocast_and_fused_adamw():
    trainer = LocalTrainer(cfg=preset("nano"), device=torch.device("cuda"), lr=1e-3, seed=0, micro_batch_size=2, activation_checkpointing=True)
    assert trainer.optimizer.defaults["fused"]
    assert math.isfinite(trainer.step(*_batch("nano", 4)))
    assert peak_memory_mb(torch.device("cuda")) > 0


# ---- MFU -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,tflops", [
    ("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0), ("NVIDIA H200", 989.4),
    ("NVIDIA A100-SXM4-40GB", 312.0), ("NVIDIA A100 80GB PCIe", 312.0), ("NVIDIA A10G", 125.0), ("NVIDIA L4", 121.0),
    ("NVIDIA L40S", 362.0), ("NVIDIA GeForce RTX 4090", 165.2), ("NVIDIA GeForce RTX 3090", 71.0),
    ("Tesla V100-SXM2-16GB", 125.0), ("Tesla V100-PCIE-32GB", 112.0), ("Tesla T4", 65.0), ("Some Future GPU", None),
])
def test_peak_tflops_by_gpu_name(name, tflops):
    assert lookup_peak_tflops(name) == tflops


def test_mfu_is_none_on_the_cpu_unless_a_peak_is_given():
    assert peak_flops(CPU) is None
    assert mfu(1e6, 1000.0, peak_flops(CPU)) is None
    assert peak_flops(CPU, 2.0) == 2e12
    assert mfu(6e9, 1e4, 2e14) == pytest.approx(0.3)
    assert mfu(6e9, 0.0, 2e14) is None


def test_flops_per_token_is_the_palm_formula():
    cfg = preset("nano")
    model = LocalTrainer(cfg=cfg, device=CPU, lr=1e-3).model
    dense = sum(p.numel() for p in model.parameters()) - cfg.context * cfg.d_model  # learned positions are lookups
    assert flops_per_token(cfg) == 6 * dense + 12 * cfg.n_layer * cfg.d_model * cfg.context


def test_peak_memory_on_the_cpu_is_the_peak_rss():
    assert 10 < peak_memory_mb(CPU) < 1 << 20


# ---- flags -----------------------------------------------------------------------------------------
def test_flags_reach_the_config_and_misfits_are_refused():
    from node.cli.app import join_flags
    from node.config import ConfigError, load_config

    for name in ("micro_batch_size", "activation_checkpointing", "compile", "outer_device", "peak_tflops"):
        assert name in join_flags.__annotations__
    cfg = load_config({"micro_batch_size": 4, "activation_checkpointing": True, "compile": True, "outer_device": "same",
                       "peak_tflops": 312.0})
    assert (cfg.micro_batch_size, cfg.activation_checkpointing, cfg.compile, cfg.outer_device, cfg.peak_tflops) == (4, True, True, "same", 312.0)
    assert load_config({}).outer_device == "cpu" and load_config({}).micro_batch_size is None
    for flags, message in [
        ({"micro_batch_size": 32, "batch_size": 16}, "at most 16"),
        ({"compile": True, "stages": 2, "model": "micro"}, "--compile is for whole-model replicas"),
        ({"micro_batch_size": 2, "activation_checkpointing": True, "stages": 2, "model": "micro"}, "are for whole-model"),
        ({"algorithm": "zo", "micro_batch_size": 2}, "do not apply to --algorithm zo"),
        ({"outer_device": "gpu"}, "--outer-device"),
        ({"peak_tflops": 0}, "--peak-tflops"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(flags)
    assert load_config({"algorithm": "zo", "compile": True}).compile


def test_summary_and_metrics_carry_throughput_mfu_and_memory():
    from node.runtime.summary import Summary
    from node.runtime.metrics import NodeMetrics

    summary = Summary()
    assert summary.tokens_per_s == 0.0 and summary.mfu is None and summary.peak_mem_mb is None
    metrics = NodeMetrics()
    assert math.isnan(metrics.registry.get_sample_value("locomesh_mfu"))


def test_a_daemon_trains_with_micro_batches_checkpointing_and_outer_state_on_its_device(tmp_path, nodes):
    """A real ``node join`` with the new flags through one outer round: the summary reports the inner
    steps' tokens/s, no MFU on the CPU (asked for: on a GPU machine ``auto`` would pick CUDA), and the peak memory."""
    from tests.helpers.swarm_utils import start_node

    node = start_node(tmp_path, "n", ["--model", "nano", "--device", "cpu", "--batch-size", "6", "--micro-batch-size", "4",
                                      "--activation-checkpointing", "--outer-device", "same", "--inner-steps", "6",
                                      "--max-steps", "12", "--threads", "1", "--eval-batches", "2", "--averaging-timeout", "10"])
    nodes.append(node)
    assert node.process.wait(timeout=180) == 0, node.log()[-3000:]
    info = node.info()
    assert info["steps"] == 12 and info["outer_rounds"] == 2
    assert info["tokens_per_s"] > 0 and info["mfu"] is None and info["peak_mem_mb"] > 10
    assert 0 < info["inner_s"] <= info["train_s"]  # the training share of its loop
    assert math.isfinite(info["val_loss"])


# ---- the CUDA recipe, run on the CPU ------------------------------------------------------------
@pytest.mark.parametrize("name,optimizer", list(zip(FAMILIES, ["adamw", "muon"])))
def test_the_cuda_recipe_runs_on_the_cpu(name: str, optimizer: str) -> None:
    """bf16 autocast and fused optimizer kernels, the path a GPU node takes, exercised where there is no GPU:
    it trains, its numbers differ from fp32 (so autocast is really on) by no more than bf16 rounding, and
    evaluation runs under it too."""
    kwargs = dict(cfg=preset(name), device=CPU, lr=3e-3, warmup_steps=0, seed=0, inner_optimizer=optimizer)
    fast, plain = LocalTrainer(**kwargs, accelerated=True), LocalTrainer(**kwargs)
    assert not plain.accelerated and LocalTrainer(**kwargs, accelerated=None).accelerated is False  # the CPU default
    adamw = fast.optimizer if optimizer == "adamw" else fast.optimizer.adamw
    assert all(group["fused"] for group in adamw.param_groups)
    x, y = _batch(name, 4, length=64)  # bf16 autocast is slow on a CPU: short sequences keep this a few seconds
    fast_losses = [fast.step(x, y) for _ in range(4)]
    plain_losses = [plain.step(x, y) for _ in range(4)]
    assert fast_losses[-1] < fast_losses[0] - 0.05  # it learns the batch
    assert fast_losses[0] != plain_losses[0] and fast_losses[0] == pytest.approx(plain_losses[0], rel=0.02)
    assert fast_losses[-1] == pytest.approx(plain_losses[-1], rel=0.05)
    evaluated = fast.evaluate([(x, y)])
    assert evaluated == pytest.approx(plain.evaluate([(x, y)]), rel=0.05) and math.isfinite(evaluated)


def test_compile_defaults_to_the_device_and_caches_kernels_in_a_lasting_folder(monkeypatch, tmp_path):
    """compile=None (the daemon's --compile default) compiles on CUDA only: on the CPU the model runs eager;
    Inductor's kernels go to ~/.cache/locomesh/inductor unless TORCHINDUCTOR_CACHE_DIR says otherwise."""
    from node.runtime.local_training import compile_cache_dir

    trainer = LocalTrainer(cfg=preset("nano"), device=CPU, lr=1e-3, seed=0)
    assert trainer.train_model is trainer.model
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compile_cache_dir() == tmp_path / "locomesh" / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert compile_cache_dir() == tmp_path / "mine"


def test_compile_is_auto_unless_asked():
    from node.config import load_config

    assert load_config({}).compile is None and load_config({}).compile_mode == "default"
    assert load_config({"compile": False}).compile is False


def test_time_shares_of_the_training_loop():
    """A replica's status answer: the share of its loop's wall time in inner steps and blocked in rounds."""
    import time

    from node.runtime.summary import Summary, time_shares

    summary = Summary()
    summary.inner_s, summary.comm_wait_s = 6.0, 2.0
    shares = time_shares(summary, time.monotonic() - 10.0)
    assert 0.55 < shares["training_share"] <= 0.6 and 0.18 < shares["blocked_share"] <= 0.2, shares
    assert time_shares(summary, None) == {"training_share": None, "blocked_share": None}  # before the loop starts
