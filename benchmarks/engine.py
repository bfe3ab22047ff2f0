"""`ropelab study --engine auto` against `eager` on the claims' shapes: equal losses, speed, and where a step's time goes.

    python benchmarks/engine.py                       # all four parts (equality compiles 10 runs: 10+ minutes on 2 cores)
    python benchmarks/engine.py --parts speed --steps 80
    python benchmarks/engine.py --parts startup --startup-runs 8 --tokens-per-param 20   # the claims' longest runs

equality: every position encoding of configs/claims/partial-scaling.yaml (NoPE, two channels, 10 %, 25 %,
    100 %) at two seeds on its 1-layer shape (d_model 64, one head, d_ff 192, bytes, 8 x 256, fp32), 50
    steps eager and 50 compiled (`ROPELAB_COMPILE=1`, what `auto` sets): the largest relative difference of
    the step losses and the difference of the final validation losses.
speed: on the 2-layer size and on the largest (3 layers), `ropelab.study.engine.choose_layout` measures
    eager's layout (one single-thread trainer per core, `ropelab study`'s default --jobs), one trainer on
    every core, compiled steps, and an installed tcmalloc/jemalloc, each a set of real `ropelab train`
    processes run at once; tokens/s per run and GFLOP/s of the whole machine (PaLM's 6N + attention FLOPs
    per token) against the sgemm rate measured here (1024^3 fp32 on every core).
profile: one eager step of the 2-layer size under torch.profiler, its CPU time split into matrix
    products, attention and everything else (elementwise, norms, loss, optimizer).
startup: the claims' smallest and largest sizes (1 layer of d_model 32, d_ff 64; 3 layers of d_model 64,
    d_ff 192) trained for `--tokens-per-param` tokens per non-embedding parameter (the frontier's budgets are
    2.5, 5, 10 and 20), `--startup-runs` runs each, one single-thread trainer per core at once (eager's layout):
    each run a fresh `python -m ropelab train` (`eager`) against a child of the warm-start server with the
    CPU's peak measured once (`auto`, `ropelab.study.warm_start`), in alternating rounds; each run's wall time
    from its start to its exit, and its tokens/s over that wall (start-up included) and over its steps alone.
Prints tables, then ONE JSON line with every figure. On a shared machine the figures are upper bounds of the load.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ropelab import machine
from ropelab.config import build_run_config, load_yaml
from ropelab.model import Transformer
from ropelab.study.engine import StudyPeaks, choose_layout, eager_layout, run_probes
from ropelab.study.warm_start import WarmStarter, plain_start
from ropelab.train.loop import COMPILE_ENV, train
from ropelab.train.metrics import read_metrics

CLAIMS = Path(__file__).resolve().parents[1] / "configs/claims/partial-scaling.yaml"
POSITIONS = {"nope": ["model.rope.fraction=0.0"], "2ch": ["model.rope.rotary_dims=2"], "rope10": ["model.rope.fraction=0.1"],
             "rope25": ["model.rope.fraction=0.25"], "rope100": ["model.rope.fraction=1.0"]}
MATMUL = ("mm", "addmm", "bmm", "matmul", "linear")
ATTENTION = ("attention", "softmax", "_efficient_attention", "flash")
SHAPES = {"1x32": (1, 32, 64), "3x64": (3, 64, 192)}  # the claims' smallest and largest sizes: layers, d_model, d_ff


def claims_tree(layers: int, position: list[str], seed: int, steps: int, shape: tuple[str, ...] = ()) -> dict:
    base = load_yaml(CLAIMS)["base"]
    overrides = [f"model.n_layer={layers}", f"seed={seed}", f"train.steps={steps}", f"train.eval_every={steps}",
                 f"train.checkpoint_every={steps}", "train.progress=false", "data.corpus=stdlib", *shape, *position]
    return build_run_config(base, overrides=overrides).to_dict()


def equality(steps: int, folder: Path, positions=tuple(POSITIONS)) -> list[dict]:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder / "inductor")
    rows = []
    for name, position in POSITIONS.items():
        if name not in positions:
            continue
        for seed in (0, 1):
            curves = {}
            for compiled in ("0", "1"):
                os.environ[COMPILE_ENV] = compiled
                torch._dynamo.reset()  # each run compiles afresh, as in its own process (else dynamo's recompile limit falls back to eager)
                run = folder / f"{name}-{seed}-{compiled}"
                result = train(build_run_config(claims_tree(1, position, seed, steps)), run)
                curves[compiled] = ([r["loss"] for r in read_metrics(run) if "loss" in r], result.final_val_loss)
            (eager, eager_val), (comp, comp_val) = curves["0"], curves["1"]
            rows.append({"position": name, "seed": seed, "steps": len(eager),
                         "max_rel_loss_diff": max(abs(a - b) / abs(a) for a, b in zip(eager, comp)),
                         "val_eager": eager_val, "val_compiled": comp_val, "val_diff": abs(comp_val - eager_val)})
            r = rows[-1]
            print(f"{r['position']:<9}{r['seed']:>5}{r['max_rel_loss_diff']:>19.2e}{r['val_eager']:>11.4f}"
                  f"{r['val_compiled']:>14.4f}{r['val_diff']:>10.1e}", flush=True)
    os.environ.pop(COMPILE_ENV)
    return rows


def sgemm_gflops(threads: int) -> float:
    torch.set_num_threads(threads)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    for _ in range(3):
        a @ b
    start, reps = time.perf_counter(), 20
    for _ in range(reps):
        a @ b
    return 2 * 1024 ** 3 * reps / (time.perf_counter() - start) / 1e9


def speed(layers: int, steps: int, folder: Path, cores: int) -> dict:
    tree = claims_tree(layers, POSITIONS["rope25"], 0, steps)
    config = build_run_config(tree)
    config.model.vocab_size = config.model.vocab_size or 256
    model = Transformer(config.model)
    flops = model.flops_per_token(config.data.seq_len)
    tokens_per_step = config.train.micro_batch * config.train.grad_accum * config.data.seq_len
    planned = -(-20 * model.num_params(non_embedding=True) // tokens_per_step)  # the frontier's largest budget, 20 tokens/param
    record = choose_layout(tree, runs=10, steps=planned, cores=cores, folder=folder / f"probe{layers}", study_dir=folder,
                           probe_steps=steps, measure=lambda t, lay, f, s: run_probes(t, lay, f, s, steps=steps))
    eager = eager_layout(cores, cores)
    for m in record["measured"]:
        m["tokens_per_s_per_run"] = tokens_per_step / m["step_s"]
        m["gflops"] = flops * m["tokens_per_s_per_run"] * m["processes"] / 1e9
        m["eager"] = (m["processes"], m["threads"], m["compile"], m["allocator"]) == (eager.processes, eager.threads, False, None)
    return {"layers": layers, "flops_per_token": flops, "planned_steps": planned, **record}


def run_round(start, tree: dict, names: list[str], env: dict, folder: Path) -> list[float]:
    """Start a trainer of `tree` per name at once; each one's wall time from its start to its exit."""
    config = folder / "run.yaml"
    config.write_text(json.dumps(tree))
    started = []
    for name in names:
        began = time.perf_counter()
        started.append((name, start(["train", "--config", str(config), "--out", str(folder / name), "--no-progress"], env,
                                    folder / f"{name}.log"), began))
    walls = {}
    while len(walls) < len(started):
        for name, process, began in started:
            if name not in walls and process.poll() is not None:
                if process.returncode != 0:
                    raise RuntimeError(f"{folder / name}.log: exit code {process.returncode}")
                walls[name] = time.perf_counter() - began
        time.sleep(0.005)
    return [walls[name] for name in names]


def startup(shapes: list[str], runs: int, tokens_per_param: float, folder: Path, cores: int) -> dict:
    """Plain processes against warm-started ones (module docstring)."""
    began = time.perf_counter()
    with WarmStarter(folder / "warm-start.log") as starter:
        ready_s = time.perf_counter() - began
        peaks, rows = StudyPeaks(), []
        for shape in shapes:
            layers, d_model, d_ff = SHAPES[shape]
            sized = (f"model.d_model={d_model}", f"model.d_ff={d_ff}")
            config = build_run_config(claims_tree(layers, POSITIONS["rope25"], 0, 1, sized))
            config.model.vocab_size = config.model.vocab_size or 256
            tokens_per_step = config.train.micro_batch * config.train.grad_accum * config.data.seq_len
            steps = math.ceil(tokens_per_param * Transformer(config.model).num_params(non_embedding=True) / tokens_per_step)
            tree = claims_tree(layers, POSITIONS["rope25"], 0, steps, sized)
            began = time.perf_counter()
            environments = {"eager": {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}}
            environments["auto"] = {**environments["eager"], **peaks.environment(tree, 1)}
            peak_s = time.perf_counter() - began
            walls = {"eager": [], "auto": []}
            for first in range(0, runs, cores):
                names = [f"r{i}" for i in range(first, min(runs, first + cores))]
                for engine, start in (("eager", plain_start), ("auto", starter.start)):
                    run_folder = folder / shape / engine
                    run_folder.mkdir(parents=True, exist_ok=True)
                    walls[engine] += run_round(start, tree, names, environments[engine], run_folder)
            for engine, measured in walls.items():
                trained = [json.loads((folder / shape / engine / f"r{i}" / "result.json").read_text())["tokens_per_s"]
                           for i in range(runs)]
                rows.append({"shape": shape, "engine": engine, "steps": steps, "runs": runs,
                             "wall_s_per_run": statistics.median(measured),
                             "tokens_per_s_per_run": steps * tokens_per_step / statistics.median(measured),
                             "training_tokens_per_s_per_run": statistics.median(trained),
                             **({"peak_measured_s": peak_s} if engine == "auto" else {})})
    return {"server_ready_s": ready_s, "tokens_per_param": tokens_per_param, "rows": rows}


def profile(layers: int) -> dict:
    from ropelab.train.optim import build_optimizer

    torch.set_num_threads(os.cpu_count() or 1)
    config = build_run_config(claims_tree(layers, POSITIONS["rope25"], 0, 10))
    config.model.vocab_size = 256
    model = Transformer(config.model)
    optimizer = build_optimizer(model, config.train)
    tokens = torch.randint(0, 256, (config.train.micro_batch, config.data.seq_len + 1))

    def step():
        _, loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(3):
        step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            step()
    shares = {"matmul": 0.0, "attention": 0.0, "elementwise and other": 0.0}
    for event in prof.key_averages():
        name = event.key.lower()
        kind = ("matmul" if any(name == f"aten::{m}" or name.endswith(f"::{m}") for m in MATMUL) else
                "attention" if any(a in name for a in ATTENTION) else "elementwise and other")
        if name.startswith("aten::") or "ropelab" in name:
            shares[kind] += event.self_cpu_time_total
    total = sum(shares.values())
    return {k: v / total for k, v in shares.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", nargs="+", default=["equality", "speed", "startup", "profile"])
    parser.add_argument("--steps", type=int, default=50, help="steps of each equality run and of each speed probe")
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 3], help="layers of the speed part's sizes")
    parser.add_argument("--positions", nargs="+", default=list(POSITIONS), choices=list(POSITIONS),
                        help="position encodings of the equality part")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES), help="sizes of the startup part")
    parser.add_argument("--startup-runs", type=int, default=4, help="runs of each size and engine in the startup part")
    parser.add_argument("--tokens-per-param", type=float, default=2.5,
                        help="the startup part's run length in tokens per non-embedding parameter")
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    figures = {"machine": machine.describe(), "sgemm_gflops": sgemm_gflops(cores)}
    print(f"{figures['machine']}; sgemm {figures['sgemm_gflops']:.0f} GFLOP/s (1024^3 fp32, {cores} threads)", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        if "equality" in args.parts:
            print(f"\ncompiled vs eager, fp32, {args.steps} steps, 1 layer")
            print(f"{'position':<9}{'seed':>5}{'max rel loss diff':>19}{'val eager':>11}{'val compiled':>14}{'val diff':>10}")
            figures["equality"] = equality(args.steps, Path(folder) / "equality", args.positions)
        if "speed" in args.parts:
            figures["speed"] = [speed(layers, args.steps, Path(folder) / "speed", cores) for layers in args.sizes]
            for s in figures["speed"]:
                print(f"\n{s['layers']} layer(s), {s['flops_per_token'] / 1e6:.2f} MFLOP/token; auto chose "
                      f"{s['chosen']}; {'; '.join(s['notes']) or ''}")
                print(f"{'layout':<38}{'tokens/s per run':>17}{'GFLOP/s':>9}{'of sgemm':>10}{'wall s':>8}")
                for m in s["measured"]:
                    label = f"{m['processes']} x {m['threads']} thread(s), {'compiled' if m['compile'] else 'eager'}" + \
                        (" (eager engine)" if m["eager"] else "") + (", " + Path(m["allocator"]).name if m["allocator"] else "")
                    print(f"{label:<38}{m['tokens_per_s_per_run']:>17,.0f}{m['gflops']:>9.1f}"
                          f"{m['gflops'] / figures['sgemm_gflops']:>10.0%}{m['wall_s']:>8.1f}")
        if "startup" in args.parts:
            figures["startup"] = startup(args.shapes, args.startup_runs, args.tokens_per_param, Path(folder) / "startup", cores)
            print(f"\nstart-up: {args.startup_runs} runs per size, {cores} single-thread trainers at once, "
                  f"{args.tokens_per_param:g} tokens/param; warm-start server ready in {figures['startup']['server_ready_s']:.1f} s")
            print(f"{'size':<6}{'engine':<7}{'steps':>6}{'wall s per run':>16}{'tokens/s per run':>18}{'in training':>13}")
            for r in figures["startup"]["rows"]:
                print(f"{r['shape']:<6}{r['engine']:<7}{r['steps']:>6}{r['wall_s_per_run']:>16.2f}"
                      f"{r['tokens_per_s_per_run']:>18,.0f}{r['training_tokens_per_s_per_run']:>13,.0f}")
        if "profile" in args.parts:
            figures["profile"] = profile(args.sizes[0])
            print(f"\none eager step, {args.sizes[0]} layers, {cores} threads: " +
                  ", ".join(f"{k} {v:.0%}" for k, v in figures["profile"].items()))
    print(json.dumps(figures, default=str))


if __name__ == "__main__":
    main()
