"""A preparation stopped part-way, as a Ctrl-C after its second shard would stop it."""

from __future__ import annotations

import pytest

from ropelab.data import prepare as prepare_module


def interrupt_after_two_shards(monkeypatch, run) -> None:
    """Run `run()`, a preparation, stopped by a KeyboardInterrupt once it recorded two shards."""
    real_write, writes = prepare_module.write_json, []

    def crash_on_fourth_progress(file, data):  # the first write is the empty progress record
        if file.name == "progress.json" and len(writes) == 3:
            raise KeyboardInterrupt
        writes.append(file.name)
        real_write(file, data)

    monkeypatch.setattr(prepare_module, "write_json", crash_on_fourth_progress)
    with pytest.raises(KeyboardInterrupt):
        run()
    monkeypatch.setattr(prepare_module, "write_json", real_write)
