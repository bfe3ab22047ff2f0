import json

import pytest

from ropelab.train.metrics import MetricsLog, read_metrics


def test_a_last_line_cut_short_is_left_out(tmp_path):
    rows = [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "lo')
    assert read_metrics(tmp_path) == rows


def test_resume_drops_rows_after_the_checkpoint_and_appends(tmp_path):
    log = MetricsLog(tmp_path, tensorboard=False)
    for step in range(1, 7):
        log.write({"step": step, "loss": 1.0 / step})
    log.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "lo')  # killed while writing
    log = MetricsLog(tmp_path, resume_step=4, tensorboard=False)
    log.write({"step": 5, "loss": 0.5})
    log.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 5]
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]


def test_a_damaged_metrics_file_is_one_line_and_left_as_it_was(tmp_path):
    from ropelab.config import ConfigError
    from ropelab.train.metrics import read_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo\n{"step": 3, "loss": 1.0}\n')
    with pytest.raises(ConfigError, match=r"metrics.jsonl:2: not a JSON row") as info:
        read_metrics(tmp_path)
    assert "\n" not in str(info.value)
    path.write_bytes(b'{"step": 1}\n\xff\xfe\n')
    with pytest.raises(ConfigError, match="not UTF-8"):
        read_metrics(tmp_path)
    assert path.read_bytes() == b'{"step": 1}\n\xff\xfe\n'
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')  # a last line cut short by a kill
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 2.0}]
