"""Where a resumed run starts: the checkpoint it continues from, and the checks that it may continue
there with this job's processes and config."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

from ropelab.config import ConfigError
from ropelab.sources.runs import CONFIG
from ropelab.train import checkpoint as ckpt
from ropelab.train.distributed import DistEnv
from ropelab.train.phases import Phase, phase_at


def own_checkpoint(run_dir: Path, requested) -> Path:
    """The checkpoint folder `--from-checkpoint` names (a step number, or a folder), refused unless it is
    one of the run's own: another run's weights start a new run (`train.init_from`)."""
    path = ckpt.step_dir(run_dir, int(requested)) if str(requested).isdigit() else Path(requested)
    if path.resolve().parent != ckpt.checkpoint_dir(run_dir).resolve():
        raise ConfigError(f"--from-checkpoint {requested}: not a checkpoint of {run_dir} (a step number or a "
                          f"folder in {ckpt.checkpoint_dir(run_dir)}); to start a new run from another run's "
                          f"weights, train into a new --out with train.init_from={requested} (or "
                          f"train.branch_from={requested} to continue its whole training state)")
    return path


def resume_checkpoint(run_dir: Path, requested: Optional[Path], verify: str, env: DistEnv) -> Optional[Path]:
    """The checkpoint a resume starts from, verified: `requested` (one of the run's own, `own_checkpoint`),
    refused when damaged; else the newest intact one, saying in one line per damaged newer checkpoint that
    it was passed over; None for a run killed before its first checkpoint (it starts again from step 0
    with its config.yaml)."""
    if requested is not None:
        if not requested.is_dir():
            raise ConfigError(f"{requested}: requested checkpoint does not exist")
        ckpt.verify_checkpoint(requested, verify, env=env)  # DamagedCheckpoint: one line naming the file
        ckpt.read_state(requested, verify="never")  # refuses an incomplete one
        return requested
    latest, damaged = ckpt.latest_intact_checkpoint(run_dir, verify, env)
    for folder, why in damaged if env.is_main else ():
        print(f"{folder}: damaged ({why}); falling back to {latest.name if latest else 'nothing'}", file=sys.stderr)
    if latest is None and damaged:
        raise ConfigError(f"{run_dir}: no intact checkpoint to resume from (every one is damaged)")
    if latest is None and env.is_main:
        print(f"{run_dir}: stopped before its first checkpoint; starting again from step 0 with its {CONFIG}",
              file=sys.stderr)
    return latest


def check_resume_world(state: dict, phases: list[Phase], env: DistEnv, path: Path) -> None:
    """Resuming on another world size is allowed only if every step keeps its global batch (DCP
    reshards weights and optimizer; each step then sees the same samples, split differently), and a
    resumed run keeps its window length; both may change at a phase boundary, where the next phase
    counts its data from its own start."""
    if any(state["step"] == phase.start for phase in phases):
        return
    saved_len, seq_len = state.get("seq_len"), phase_at(phases, state["step"]).config.data.seq_len
    if saved_len is not None and saved_len != seq_len:
        raise ConfigError(f"{path}: trained at data.seq_len={saved_len}, but config.yaml now says {seq_len}; a resumed "
                          "run keeps its windows (its data position and token count depend on them): put it back, or "
                          "start a new run from this one with train.branch_from")
    saved_batch = state.get("global_batch")
    batch = phase_at(phases, state["step"]).config.train.global_batch
    if saved_batch is not None and saved_batch != batch:
        raise ConfigError(
            f"{path}: written by {state.get('world', 1)} process(es) with global batch {saved_batch}; this job's "
            f"{env.world} process(es) make it {batch}. Resume with {state.get('world', 1)} process(es), or edit "
            f"train.grad_accum in config.yaml so that micro_batch * grad_accum * processes = {saved_batch}"
        )
