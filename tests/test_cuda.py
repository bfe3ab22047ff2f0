"""What only a CUDA GPU can check: the Triton RoPE kernel inside `RotaryEmbedding`, compiled
FlexAttention, bf16 training with a crash and resume, torch.compile, and DDP / FSDP2 over NCCL.

Every test is marked `cuda` and skipped without CUDA; `benchmarks/gpu_check.py` runs them with
``pytest -m cuda`` on a GPU machine (a test skipped there counts as a failure of its check)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file

from ropelab import attention
from ropelab.attention import attend, resolve_backend
from ropelab.config import ModelConfig, RopeConfig, TrainConfig, build_run_config
from ropelab.model import Transformer
from ropelab.precision import mixed_precision
from ropelab.rope import RotaryEmbedding, triton_kernels
from ropelab.train import checkpoint as ckpt
from ropelab.train.distributed import DistEnv, clip_grad_norm, wrap_model
from ropelab.train.loop import train
from ropelab.train.metrics import read_metrics
from ropelab.train.optim import build_optimizer

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")]

CUDA = torch.device("cuda", 0)
CRASH_IN_SAVE = Path(__file__).parent / "train" / "crash_in_save.py"


def assert_near(actual: torch.Tensor, expected: torch.Tensor, name: str, fp32_tol: float = 1e-5) -> None:
    """fp32: to `fp32_tol`. bf16: to bf16 rounding, with an absolute floor of 1% of the largest value
    (sums of rounded products near zero carry more than relative bf16 error)."""
    if expected.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=fp32_tol, atol=fp32_tol, msg=lambda m: f"{name}: {m}")
        return
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(actual.float(), expected.float(), rtol=1.6e-2, atol=1e-2 * scale,
                               msg=lambda m: f"{name}: {m}")


# ----------------------------------------------------------------------- Triton RoPE kernel

B, T, C, H, K, D = 2, 77, 96, 4, 2, 64  # T spans three of the kernel's 32-token blocks, the last partial


@pytest.fixture
def kernel_calls(monkeypatch):
    """Keyword arguments of every call to the Triton kernel (so a silent fallback to the reference fails)."""
    module = triton_kernels()
    if module is None:
        pytest.skip("Triton is not installed")
    calls = []
    rotate_qk_ = module.rotate_qk_
    monkeypatch.setattr(module, "rotate_qk_", lambda *a, **kw: calls.append(kw) or rotate_qk_(*a, **kw))
    return calls


@pytest.mark.parametrize("cache", ["table", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("fraction", [0.1, 0.25, 0.5, 1.0])
def test_triton_rope_matches_the_reference(kernel_calls, fraction, layout, dtype, cache):
    """`RotaryEmbedding` on CUDA rotates q and k (projection views, as `Attention` makes them) with the
    Triton kernel, forward and backward, and gives the out-of-place reference's values and gradients
    (input and projection weights); pass-through channels are bit-identical."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, T, C, generator=g).to(CUDA, dtype).requires_grad_()
    wq = (torch.randn(H * D, C, generator=g) / C**0.5).to(CUDA, dtype).requires_grad_()
    wk = (torch.randn(K * D, C, generator=g) / C**0.5).to(CUDA, dtype).requires_grad_()
    positions = torch.randint(0, 4096, (B, T), generator=g).to(CUDA)
    upstream = tuple(torch.randn(B, heads, T, D, generator=g).to(CUDA, dtype) for heads in (H, K))
    rope = RotaryEmbedding(RopeConfig(fraction=fraction, layout=layout, cache=cache), D)
    r = rope.rotary_dims
    results = []
    for inplace in (None, False):  # the kernel, then the reference
        rope.inplace = inplace
        q = F.linear(x, wq).view(B, T, H, D).transpose(1, 2)
        k = F.linear(x, wk).view(B, T, K, D).transpose(1, 2)
        q_out, k_out = rope(q, k, positions)
        grads = torch.autograd.grad((q_out, k_out), (x, wq, wk), tuple(u.clone() for u in upstream))
        results.append((q_out.detach(), k_out.detach(), *grads))
    assert len(kernel_calls) == 2 and kernel_calls[1]["inverse"] and kernel_calls[0]["rotary_dims"] == r
    assert ("cos_table" in kernel_calls[0]) == (cache == "table")
    fast, reference = results
    for name, ours, theirs in zip(("q", "k", "dx", "dwq", "dwk"), fast, reference):
        assert_near(ours, theirs, name)
    assert torch.equal(fast[0][..., r:], reference[0][..., r:]) and torch.equal(fast[1][..., r:], reference[1][..., r:])


# ----------------------------------------------------------------------------- FlexAttention

ROWS = [[37, 100, 3, 116], [128, 1, 127]]  # documents per row, 256 tokens each


def ids_from_lengths(rows: list[list[int]]) -> torch.Tensor:
    return torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in rows])


def outputs_and_grads(backend, q, k, v, ids, upstream):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = attend(q, k, v, ids, backend)
    return (out, *torch.autograd.grad(out, (q, k, v), upstream))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_flex_attention_matches_dense_forward_and_backward(dtype):
    """Compiled FlexAttention with the document block mask (GQA, 4 query / 2 KV heads) against SDPA
    with the dense boolean mask: outputs and the gradients of q, k and v."""
    g = torch.Generator().manual_seed(0)
    q, upstream = (torch.randn(2, 4, 256, 64, generator=g).to(CUDA, dtype) for _ in range(2))
    k, v = (torch.randn(2, 2, 256, 64, generator=g).to(CUDA, dtype) for _ in range(2))
    ids = ids_from_lengths(ROWS).to(CUDA)
    flex = outputs_and_grads("flex", q, k, v, ids, upstream)
    assert attention._compiled_flex is not None  # the compiled kernel, not eager flex
    dense = outputs_and_grads("dense", q, k, v, ids, upstream)
    for name, ours, theirs in zip(("out", "dq", "dk", "dv"), flex, dense):
        assert_near(ours, theirs, name, fp32_tol=1e-4)


def test_model_with_document_mask_uses_flex_and_matches_dense():
    """The model's `auto` backend picks flex on CUDA; logits and weight gradients equal the dense
    backend's; a second batch of other documents (same shape) needs no new compilation."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=256, n_layer=2, d_model=256, n_head=4, n_kv_head=2, d_ff=512)).to(CUDA)
    gen = torch.Generator().manual_seed(1)
    graphs = []
    for rows in (ROWS, [[200, 56], [1, 2, 3, 250]]):
        ids = ids_from_lengths(rows).to(CUDA)
        assert resolve_backend("auto", ids, CUDA) == "flex"
        tokens, targets = (torch.randint(0, 256, (2, 256), generator=gen).to(CUDA) for _ in range(2))
        results = []
        for backend in ("auto", "dense"):
            model.set_attention_backend(backend)
            model.zero_grad(set_to_none=True)
            logits, loss = model(tokens, targets, doc_ids=ids)
            loss.backward()
            results.append((logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
        assert_near(results[0][0], results[1][0], "logits", fp32_tol=1e-4)
        for name, grad in results[0][1].items():
            torch.testing.assert_close(grad, results[1][1][name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[1] == graphs[0], "flex recompiled for new document boundaries"


# ------------------------------------------------------------------ DDP and FSDP2 over NCCL


class GroupOfOne(DistEnv):
    """A world of one with a process group open, so that `wrap_model` wraps (it leaves a plain
    world of one alone, which is what torchrun --nproc_per_node 1 gives the trainer)."""

    @property
    def active(self) -> bool:
        return True


@pytest.fixture
def nccl_group():
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        yield
    finally:
        dist.destroy_process_group()


def tiny_model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig.from_name("tiny-llama", vocab_size=256)).to(CUDA)


def train_steps(model: torch.nn.Module, steps: int = 3) -> list[float]:
    """bf16-autocast steps as the trainer takes them (clipped, AdamW) on fixed random tokens."""
    optimizer = build_optimizer(model, TrainConfig(lr=1e-3))
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, 256, (4, 65), generator=gen).to(CUDA)
        with mixed_precision(CUDA, True):
            _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        clip_grad_norm(model, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_ddp_and_fsdp2_over_nccl_train_like_one_process(nccl_group, parallel):
    """ropelab's wrapping over a one-rank NCCL group: DDP gives the plain model's losses exactly (the
    all-reduce of one rank is the identity); FSDP2 shards every weight (DTensor) and, computing in
    bf16 weights rather than under autocast alone, stays within bf16 rounding of them."""
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    reference = train_steps(tiny_model())
    model = tiny_model()
    wrapped = wrap_model(model, parallel, GroupOfOne(), CUDA, bf16=True)
    assert dist.get_backend() == "nccl"
    if parallel == "ddp":
        assert isinstance(wrapped, DistributedDataParallel)
        assert train_steps(wrapped) == reference
    else:
        assert wrapped is model and all(isinstance(p, DTensor) for p in model.parameters())
        torch.testing.assert_close(train_steps(wrapped), reference, rtol=2e-2, atol=0)


# ------------------------------------------------------------------ training runs on CUDA

STEPS = 20
RUN_OVERRIDES = [
    "preset=tiny-llama", "data.tokenizer=bytes", "data.seq_len=64", "train.micro_batch=4", f"train.steps={STEPS}",
    "train.eval_every=10", "train.eval_batches=2", "train.checkpoint_every=5", "train.progress=false",
    "train.lr=3e-3", "train.device=cuda", "train.precision=bf16",
]


def losses(run_dir: Path) -> list[float]:
    return [row["loss"] for row in read_metrics(run_dir)]


def run_command(cmd: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(ckpt.latest_checkpoint(run_dir) / ckpt.WEIGHTS))


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory) -> Path:
    """20 uninterrupted bf16 steps of tiny-llama on CUDA, in this process."""
    run_dir = tmp_path_factory.mktemp("cuda") / "reference"
    train(build_run_config(overrides=RUN_OVERRIDES), run_dir)
    rows = read_metrics(run_dir)
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1)) and rows[-1]["loss"] < rows[0]["loss"] - 0.5
    return run_dir


def test_bf16_run_killed_while_saving_resumes_exactly(reference_run, tmp_path):
    """SIGKILLed while writing its step-10 checkpoint (tests/train/crash_in_save.py), the run resumes
    from step 5 and ends with the uninterrupted run's losses and weights, bit for bit."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, str(CRASH_IN_SAVE), "train", "--out", str(run_dir), *RUN_OVERRIDES]
    crashed = run_command(cmd, env={"CRASH_RUN": str(run_dir), "CRASH_STEP": "10"})
    assert crashed.returncode == -9, crashed.stderr[-3000:]
    assert ckpt.latest_checkpoint(run_dir).name == "step_00000005"
    before = losses(run_dir)
    assert before == losses(reference_run)[:len(before)], "not reproducible on this GPU even before the kill"
    resumed = run_command([sys.executable, "-m", "ropelab", "train", "--out", str(run_dir), "--resume"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert losses(run_dir) == losses(reference_run)
    ours, theirs = final_weights(run_dir), final_weights(reference_run)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[name], theirs[name]) for name in ours)


def test_compiled_model_trains_like_eager_without_graph_breaks(reference_run, tmp_path):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    train(build_run_config(overrides=RUN_OVERRIDES + ["train.compile=true"]), tmp_path / "compiled")
    assert counters["stats"]["unique_graphs"] > 0 and not counters["graph_break"], dict(counters["graph_break"])
    torch.testing.assert_close(losses(tmp_path / "compiled"), losses(reference_run), rtol=2e-2, atol=0)


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_torchrun_on_one_gpu(reference_run, tmp_path, parallel):
    """`torchrun --nproc_per_node 1 -m ropelab train` with train.parallel=ddp|fsdp runs on the GPU and
    gives the in-process run's losses exactly (a world of one opens no process group: NCCL itself
    is checked by test_ddp_and_fsdp2_over_nccl_train_like_one_process)."""
    run_dir = tmp_path / parallel
    done = run_command([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                        "-m", "ropelab", "train", "--out", str(run_dir), *RUN_OVERRIDES, f"train.parallel={parallel}"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert ckpt.read_state(ckpt.latest_checkpoint(run_dir))["world"] == 1
    assert losses(run_dir) == losses(reference_run)
