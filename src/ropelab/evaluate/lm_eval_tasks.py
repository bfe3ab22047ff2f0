"""lm-evaluation-harness tasks for ropelab: the seed's zero-shot suite, task names, and their datasets.

  PAPER_TASKS          the partial-RoPE seed's suite (``--tasks paper``)
  resolve_tasks(spec)  "paper" or comma-separated names -> a list of task names, "paper" expanded
  load_tasks(names)    a TaskManager that knows every name, and each task loaded: a dataset that cannot
                       be read is one ConfigError line naming the task and the dataset. When the hub is
                       unreachable, offline mode goes on first, so cached datasets load and others fail at
                       once instead of retrying.
"""

from __future__ import annotations

import difflib
import logging
import re
from pathlib import Path
from typing import Optional, Sequence

import lm_eval

from ropelab import hub
from ropelab.config import ConfigError
from ropelab.errors import one_line

log = logging.getLogger(__name__)

# ------------------------------------------------------------------ the seed's suite

PAPER_TASKS: list[str] = [
    "arc_easy", "arc_challenge", "logiqa", "lambada_openai", "piqa", "sciq", "winogrande",
    "wsc273",  # the seed's "WSC": the 273-problem Winograd Schema Challenge (the harness's `wsc` is SuperGLUE's)
    "pubmedqa",
]
_PACKAGED_BUILDERS = {"json", "csv", "parquet", "text", "arrow", "pandas", "webdataset", "imagefolder", "audiofolder"}

# ------------------------------------------------------------------ tasks and their datasets


def _cfg(entry) -> dict:
    cfg = getattr(entry, "cfg", None) if not isinstance(entry, dict) else entry.get("cfg")
    return cfg if isinstance(cfg, dict) else {}


def _dataset_of(entry, exc: Optional[BaseException] = None) -> str:
    """The dataset of a task's index entry, else a repo id quoted in the error, else "?"."""
    cfg = _cfg(entry)
    path, name = cfg.get("dataset_path"), cfg.get("dataset_name")
    if path:
        return f"{path}" + (f" ({name})" if name else "")
    quoted = re.search(r"'([\w.-]+/[\w.-]+)'", str(exc or ""))
    return quoted[1] if quoted else "?"


def _needs_hub(entry) -> bool:
    cfg = _cfg(entry)
    path = cfg.get("dataset_path")
    if path is None:
        return True  # a Python task or a group: cannot tell, assume it may download
    return str(path) not in _PACKAGED_BUILDERS and not Path(str(path)).expanduser().exists()


def _task_manager(names: list[str], include_path: Optional[str]):
    """A TaskManager that knows every name. Indexing all of the harness's built-in tasks takes ~10 s, so
    first only the include path and the built-in task folders named like the tasks (arc for arc_easy,
    lambada for lambada_openai, ...) are indexed; that index is used when it holds every name as a plain
    task (groups and tags may gather tasks from other folders: they get the full index)."""
    from lm_eval.tasks import TaskManager

    if include_path is not None and not Path(include_path).is_dir():
        raise ConfigError(f"--include-path {include_path}: no such directory")
    builtin = Path(lm_eval.__file__).parent / "tasks"
    folders = sorted(
        {d for d in builtin.iterdir() if d.is_dir() and not d.name.startswith(("_", ".")) for n in names if n.startswith(d.name)},
        key=lambda d: d.name,
    )
    paths = [str(d) for d in folders] + ([str(include_path)] if include_path else [])  # the include path wins
    if paths:
        try:
            manager = TaskManager(include_path=paths, include_defaults=False)
        except TypeError:  # an lm-eval without include_defaults
            manager = None
        plain = getattr(manager, "all_subtasks", None) or []
        if manager is not None and all(name in plain for name in names):
            return manager
    manager = TaskManager(include_path=str(include_path) if include_path else None)
    unknown = [name for name in names if name not in manager.all_tasks]
    if unknown:
        hints = difflib.get_close_matches(unknown[0], manager.all_tasks, n=3)
        hint = f"; did you mean {', '.join(hints)}?" if hints else "; list them with `lm-eval ls tasks`"
        raise ConfigError(f"--tasks: unknown task {unknown[0]!r} in lm-eval {lm_eval.__version__}{hint}")
    return manager


def load_tasks(names: list[str], include_path: Optional[str] = None, probe_timeout: float = 3.0):
    """(TaskManager, {name: loaded}) after checking that every task's dataset can be read; a dataset
    that cannot be fetched raises ConfigError naming the task and the dataset. When the hub is
    unreachable, offline mode is switched on first so that cached datasets load and others fail at once."""
    manager = _task_manager(names, include_path)
    offline = hub.offline_variable() is not None
    index = getattr(manager, "task_index", {}) or {}
    if not offline and any(_needs_hub(index.get(n)) for n in names) and not hub.reachable(probe_timeout):
        offline = True
        log.info("ropelab: the Hugging Face hub is unreachable; using cached datasets only (offline mode)")
    if offline:
        hub.set_offline()
    loaded = {}
    for name in names:
        try:
            if hasattr(manager, "load"):
                loaded[name] = manager.load([name])
            else:  # lm-eval before TaskManager.load
                from lm_eval.tasks import get_task_dict

                loaded[name] = get_task_dict([name], manager)
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - network, missing cache, bad config: one line naming the dataset
            why = "offline and not in the local cache" if offline else "could not be loaded"
            raise ConfigError(
                f"task {name}: dataset {_dataset_of(index.get(name), exc)} {why} ({one_line(exc)})"
            ) from None
    return manager, loaded


def resolve_tasks(tasks: str | Sequence[str]) -> list[str]:
    if isinstance(tasks, str):
        tasks = list(PAPER_TASKS) if tasks == "paper" else [t.strip() for t in tasks.split(",")]
    names: list[str] = []
    for task in tasks:
        for name in (PAPER_TASKS if task == "paper" else [task]):
            if name and name not in names:
                names.append(name)
    if not names:
        raise ConfigError("--tasks: no task given (use `paper` or a comma-separated list)")
    return names
