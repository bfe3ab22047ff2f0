"""A GPU machine's first contact: every CUDA path of ropelab checked and the GPU targets measured, by
one command that writes everything under one folder.

    python benchmarks/gpu_check.py --out gpu_check          # one CUDA device; under 8 minutes
    python benchmarks/gpu_check.py --dry-run                # the same code on CPU, tiny shapes (the tests run it)
    python benchmarks/gpu_check.py --stages gpu smollm2     # some stages only (a rerun of those that failed)

Stages, each a subprocess with its own timeout (`STAGES`: 260 + 150 + 50 s at most). A stage that
fails or runs out of time is recorded with the tail of its output and the next one still runs; the
exit status is 1 if any failed. Without CUDA (and without --dry-run) every stage is skipped. No
install is needed: the stages run with this checkout's src/ on PYTHONPATH.
1. cuda_tests: ``pytest -m cuda`` over `CUDA_TEST_FILES`, output in cuda_tests.log and JUnit XML in
   cuda_tests.xml: the Triton RoPE kernel against the reference, compiled FlexAttention against the
   dense mask, a bf16 run killed and resumed exactly, torch.compile, DDP / FSDP2 over NCCL and torchrun
   on the one GPU (tests/test_cuda.py); the fused norm + projection layers under CUDA autocast, bf16 and
   fp16, against autocast's own plain expressions, alone and in a training step (tests/test_layers.py,
   tests/test_model.py); the chunked loss casting the head once under CUDA autocast against autocast's
   per-product casts (tests/train/test_loss.py). On a CUDA machine a skipped test fails the stage: nothing there should skip.
2. gpu: ``benchmarks/gpu.py``, its JSON record kept (also in gpu.json): the RoPE kernel's bandwidth as
   a share of the datasheet HBM peak, tokens/s and MFU of a compiled llama-3.2-1b training step at
   4 x 2048 tokens in bf16; the targets (>= 70% of the peak at fraction 1.0, >= 40% MFU) marked met
   or not.
3. smollm2: tokens/s and MFU of a training step (forward with loss, backward, fused AdamW, eager,
   bf16 autocast as the trainer runs it) of a ropelab `Transformer` of SmolLM2-135M's exact shape
   (`smollm2_config`) at 4 x 512 and 1 x 2048 tokens. Its weights are random: a throughput figure,
   not the released model. ``--measure-smollm2`` is what this stage runs.
With --dry-run everything runs on the CPU: cuda_tests is skipped ("skipped: no CUDA"), gpu.py runs
its own --dry-run, and the SmolLM2-shape step runs 2 layers at 4 x 16 and 1 x 64 tokens.
Prints a table, then ONE JSON line with every figure (also written to DIR/gpu_check.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
TAIL_CHARS = 3000
ROPE_TARGET, MFU_TARGET = 0.70, 0.40  # benchmarks/gpu.py's targets
CUDA_TEST_FILES = ("tests/test_cuda.py", "tests/test_layers.py", "tests/test_model.py", "tests/train/test_loss.py")  # their `cuda`-marked tests


class StageFailed(Exception):
    """A stage's command failed or its output lacks what the stage reports; `figures` is what it got."""

    def __init__(self, error: str, figures: Optional[dict] = None):
        super().__init__(error)
        self.figures = figures or {}


def child_env() -> dict:
    """Every stage's environment: ropelab from this checkout (a GPU machine's python3 may not have it
    installed), output unbuffered so that a killed stage's log holds what it printed."""
    path = os.pathsep.join(p for p in (str(REPO / "src"), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


def run_logged(cmd: list[str], log: Path, timeout: float) -> int:
    """Run `cmd` in the repository root with its output in `log`; its exit status. On timeout its
    whole process group (torchrun's workers too) is killed and StageFailed raised."""
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=child_env(),
                                start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise StageFailed(f"timed out after {timeout:g} s") from None


def last_json(log: Path, benchmark: str) -> dict:
    """The last line of `log` that is a JSON record of `benchmark`."""
    for line in reversed(log.read_text().splitlines()):
        if line.startswith("{"):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record.get("benchmark") == benchmark:
                return record
    raise StageFailed(f"no JSON line of {benchmark!r} in {log.name}")


# ------------------------------------------------------------------------------- stages


def junit_counts(xml: Path) -> dict:
    """Test counts of a JUnit XML file and the tests that did not pass (with the first line of why)."""
    root = ET.parse(xml).getroot()
    suites = list(root.iter("testsuite"))
    tests, failed, errors, skipped = (sum(int(s.get(key, 0)) for s in suites)
                                      for key in ("tests", "failures", "errors", "skipped"))
    not_passed = []
    for case in root.iter("testcase"):
        for outcome in ("failure", "error", "skipped"):
            element = case.find(outcome)
            if element is not None:
                why = (element.get("message") or "").strip().splitlines()[:1]
                not_passed.append(f"{outcome}: {case.get('name')}{': ' + why[0] if why else ''}")
    return {"tests": tests, "passed": tests - failed - errors - skipped, "failed": failed, "errors": errors,
            "skipped": skipped, "not_passed": not_passed}


def cuda_tests(log: Path, dry_run: bool, timeout: float) -> dict:
    xml = log.with_suffix(".xml")
    # -v and --durations: which tests pass and what their time is, for sizing the next check;
    # -rfEs: the reasons of failures, errors and skips at the end, where the recorded tail is;
    # -n 0: one process for the one GPU (pyproject.toml's addopts start a pytest-xdist worker per core)
    code = run_logged([sys.executable, "-m", "pytest", "-n", "0", "-m", "cuda", "-v", "--tb=short", "--durations=15",
                       "-rfEs", "-p", "no:cacheprovider", f"--junitxml={xml}", *CUDA_TEST_FILES], log, timeout)
    if not xml.is_file():
        raise StageFailed(f"exit status {code}, no JUnit XML written")
    figures = {**junit_counts(xml), "junit": xml.name}
    if code != 0:
        raise StageFailed(f"exit status {code}: {figures['failed']} failed, {figures['errors']} errors", figures)
    if figures["skipped"] and torch.cuda.is_available():
        raise StageFailed(f"{figures['skipped']} tests skipped on a CUDA machine", figures)
    return figures


def target(value: Optional[float], goal: float) -> dict:
    return {"value": value, "target": goal, "met": None if value is None else value >= goal}


def gpu_benchmark(log: Path, dry_run: bool, timeout: float) -> dict:
    code = run_logged([sys.executable, str(HERE / "gpu.py"), *(["--dry-run"] if dry_run else [])], log, timeout)
    if code != 0:
        raise StageFailed(f"exit status {code}")
    record = last_json(log, "gpu")
    log.with_suffix(".json").write_text(json.dumps(record, indent=1))
    rope, train = record["rope"], record["train"]
    targets = {f"rope_share_{cache}@1": target(rope[f"{cache}@1"]["share"], ROPE_TARGET) for cache in ("table", "none")}
    return {"rope": rope, "train": train, "targets": {**targets, "train_mfu": target(train["mfu"], MFU_TARGET)}}


def smollm2(log: Path, dry_run: bool, timeout: float) -> dict:
    code = run_logged([sys.executable, str(Path(__file__).resolve()), "--measure-smollm2",
                       *(["--dry-run"] if dry_run else [])], log, timeout)
    if code != 0:
        raise StageFailed(f"exit status {code}")
    record = last_json(log, "smollm2_step")
    return {key: value for key, value in record.items() if key != "benchmark"}


def pct(share: Optional[float]) -> str:
    return "-" if share is None else f"{share:.0%}"


def describe_tests(f: dict) -> str:
    return f"{f['passed']} passed, {f['failed']} failed, {f['errors']} errors, {f['skipped']} skipped"


def describe_gpu(f: dict) -> str:
    t, train = f["targets"], f["train"]
    return (f"RoPE at fraction 1: {pct(t['rope_share_table@1']['value'])} (table), "
            f"{pct(t['rope_share_none@1']['value'])} (none) of HBM peak, target {ROPE_TARGET:.0%}; "
            f"{train['preset']} {train['batch']}x{train['seq']}: {train['tokens_per_s']:,.0f} tokens/s, "
            f"MFU {pct(train['mfu'])}, target {MFU_TARGET:.0%}")


def describe_smollm2(f: dict) -> str:
    return "; ".join(f"{key}: {run['tokens_per_s']:,.0f} tokens/s, MFU {pct(run['mfu'])}"
                     for key, run in f["runs"].items())


class Stage(NamedTuple):
    run: Callable[[Path, bool, float], dict]  # (log, dry_run, timeout) -> figures, or StageFailed
    timeout_s: float  # together under the 8 minutes a first GPU check is given
    dry_run_on_cpu: bool  # whether --dry-run runs it (tiny, on the CPU) rather than skipping it
    describe: Callable[[dict], str]


STAGES = {
    "cuda_tests": Stage(cuda_tests, 260, False, describe_tests),
    "gpu": Stage(gpu_benchmark, 150, True, describe_gpu),
    "smollm2": Stage(smollm2, 50, True, describe_smollm2),
}


def skip_reason(stage: Stage, dry_run: bool) -> Optional[str]:
    if dry_run and not stage.dry_run_on_cpu:
        return "skipped: dry run" if torch.cuda.is_available() else "skipped: no CUDA"
    if not dry_run and not torch.cuda.is_available():
        return "skipped: no CUDA"
    return None


def tail(log: Path) -> str:
    return log.read_text(errors="replace")[-TAIL_CHARS:] if log.is_file() else ""


def run_stage(name: str, stage: Stage, out: Path, dry_run: bool) -> dict:
    skipped = skip_reason(stage, dry_run)
    if skipped:
        print(f"[gpu_check] {name}: {skipped}", flush=True)
        return {"status": skipped}
    log = out / f"{name}.log"
    print(f"[gpu_check] {name}: running (timeout {stage.timeout_s:g} s, output in {log})", flush=True)
    start = time.perf_counter()
    record = {"status": "ok", "timeout_s": stage.timeout_s, "log": log.name}
    try:
        record["figures"] = stage.run(log, dry_run, stage.timeout_s)
    except StageFailed as exc:
        record.update(status="failed", error=str(exc), figures=exc.figures, tail=tail(log))
    except Exception as exc:  # a bug in a stage's own code must not cost the other stages
        record.update(status="failed", error=f"{type(exc).__name__}: {exc}", figures={},
                      tail=(tail(log) + "\n" + traceback.format_exc())[-TAIL_CHARS:])
    record["seconds"] = time.perf_counter() - start
    print(f"[gpu_check] {name}: {record['status']} in {record['seconds']:.0f} s", flush=True)
    return record


def print_report(stages: dict) -> None:
    for name, record in stages.items():
        if record["status"] == "failed":
            print(f"--- {name} failed: {record['error']}; the end of {record['log']}:\n{record['tail']}\n---")
    print(f"{'stage':<11} {'status':<17} {'time':>6}  figures")
    for name, record in stages.items():
        seconds = f"{record['seconds']:.0f} s" if "seconds" in record else "-"
        figures = ""
        if record["status"] == "ok":
            figures = STAGES[name].describe(record["figures"])
        elif record["status"] == "failed":
            figures = record["error"]
        print(f"{name:<11} {record['status']:<17} {seconds:>6}  {figures}")


# ------------------------------------------------------------------ the SmolLM2-shape step


def smollm2_config(n_layer: int = 30):
    """SmolLM2-135M's shape (HuggingFaceTB/SmolLM2-135M, config.json): Llama blocks, 30 layers,
    d_model 576, 9 query and 3 KV heads of 64, SwiGLU d_ff 1536, RMSNorm eps 1e-5, RoPE theta
    100000 on every channel, vocabulary 49152, tied embeddings."""
    from ropelab.config import ModelConfig, RopeConfig

    return ModelConfig(name="smollm2-135m-shape", vocab_size=49_152, n_layer=n_layer, d_model=576, n_head=9,
                       n_kv_head=3, head_dim=64, d_ff=1536, norm="rmsnorm", norm_eps=1e-5, mlp="swiglu",
                       tie_embeddings=True, max_seq_len=8192, rope=RopeConfig(fraction=1.0, theta=100_000.0))


def measure_smollm2(dry_run: bool) -> dict:
    """tokens/s and MFU of a training step of the SmolLM2-135M shape (2 layers and short sequences on
    the CPU for a dry run). Imported here, in the stage's own process, which has ropelab on its path."""
    from ropelab.config import TrainConfig
    from ropelab.model import Transformer
    from ropelab.precision import matmul_dtype, mixed_precision
    from ropelab.train.optim import build_optimizer
    from ropelab.train.throughput import Throughput

    spec = importlib.util.spec_from_file_location("gpu_benchmark", HERE / "gpu.py")
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    if dry_run:
        device, n_layer, shapes, steps, warmup = torch.device("cpu"), 2, [(4, 16), (1, 64)], 1, 0
    else:
        device, n_layer, shapes, steps, warmup = torch.device("cuda"), 30, [(4, 512), (1, 2048)], 10, 2
    torch.manual_seed(0)
    config = smollm2_config(n_layer)
    model = Transformer(config).to(device).train()
    optimizer = build_optimizer(model, TrainConfig())

    def train_step(idx: torch.Tensor) -> None:
        with mixed_precision(device, True):
            _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    runs = {}
    for batch, seq in shapes:
        idx = torch.randint(0, config.vocab_size, (batch, seq + 1), device=device)
        seconds = gpu.median_seconds(lambda: train_step(idx), device, steps, warmup)
        tracker = Throughput(model, seq, batch * seq, device, matmul_dtype(device, True), window=1)
        runs[f"{batch}x{seq}"] = {"batch": batch, "seq": seq, "step_s": seconds, **tracker.update(seconds)}
    return {
        "benchmark": "smollm2_step",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run)",
        "model": dataclasses.asdict(config), "params": model.num_params(),
        "weights": "random: SmolLM2-135M's shape, not its released weights (a throughput figure only)",
        "step": "forward with loss, backward, AdamW, zero_grad; bf16 autocast; eager",
        "fused_adamw": bool(optimizer.defaults.get("fused")), "steps": steps, "peak_flops": tracker.peak,
        "peak_source": tracker.peak_source, "runs": runs,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("gpu_check"),
                        help="folder for every output (default: gpu_check)")
    parser.add_argument("--dry-run", action="store_true", help="run on the CPU with tiny shapes")
    parser.add_argument("--stages", nargs="+", choices=list(STAGES), default=list(STAGES),
                        help="stages to run (default: all)")
    parser.add_argument("--measure-smollm2", action="store_true",
                        help="only measure the SmolLM2-shape step, print its JSON line (what the smollm2 stage runs)")
    args = parser.parse_args(argv)
    if args.measure_smollm2:
        print(json.dumps(measure_smollm2(args.dry_run)))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    stages = {name: run_stage(name, STAGES[name], args.out, args.dry_run) for name in args.stages}
    failed = [name for name, record in stages.items() if record["status"] == "failed"]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    record = {"benchmark": "gpu_check", "device": device, "torch": torch.__version__, "dry_run": args.dry_run,
              "out": str(args.out), "ok": not failed, "failed": failed, "seconds": time.perf_counter() - start,
              "stages": stages}
    print_report(stages)
    line = json.dumps(record)
    (args.out / "gpu_check.json").write_text(line + "\n")
    print(line)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
