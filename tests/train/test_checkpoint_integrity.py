"""Checkpoint integrity: the checksum manifest, verification before every loader parses a file,
falling back to the newest intact checkpoint, pruning that keeps the good ones, checkpoints written
before manifests, and RNG states that resume bitwise."""

from __future__ import annotations

import json
import random
import zlib

import numpy as np
import pytest
import torch

from ropelab.config import ConfigError, ModelConfig, TrainConfig
from ropelab.model import Transformer
from ropelab.train import checkpoint as ckpt
from ropelab.train import integrity
from ropelab.train.distributed import DistEnv
from ropelab.train.integrity import DamagedCheckpoint
from ropelab.train.optim import build_optimizer

MODEL = ModelConfig(vocab_size=48, n_layer=1, d_model=16, n_head=2, d_ff=32, max_seq_len=16)
FILES = ["dcp/__0_0.distcp", "dcp/.metadata", "model.safetensors", "state.pt", "rng_rank0.pt"]


def fresh():
    model = Transformer(MODEL)
    return model, build_optimizer(model, TrainConfig(lr=1e-2))


def trained(seed=0):
    torch.manual_seed(seed)
    model, optimizer = fresh()
    idx = torch.randint(0, MODEL.vocab_size, (2, 8))
    model(idx, idx)[1].backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def save(run, step, keep=10, **kwargs):
    model, optimizer = trained(step)
    extra = {"phase": 0, "data": {"seed": 0, "next_step": step}}
    return ckpt.save_checkpoint(run, step, model, optimizer, extra, keep, **kwargs)


@pytest.fixture
def folder(tmp_path):
    return save(tmp_path / "run", 2)


def flip(path, at=None):
    data = bytearray(path.read_bytes())
    at = len(data) // 2 if at is None else at
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def one_line_error(exc_info, *parts):
    text = str(exc_info.value)
    assert "\n" not in text and isinstance(exc_info.value, ConfigError), text
    for part in parts:
        assert str(part) in text, text
    return text


def make_legacy(folder):
    """As written before manifests: no CHECKSUMS.json, a marker with the step only, numpy and python
    RNG states as numpy arrays and tuples."""
    (folder / integrity.MANIFEST).unlink()
    (folder / ckpt.MARKER).write_text("2")
    torch.save({"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
               folder / "rng_rank0.pt")


# ------------------------------------------------------------------ the manifest


def test_manifest_records_every_file_before_the_marker(folder):
    manifest = json.loads((folder / integrity.MANIFEST).read_text())
    on_disk = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    assert sorted(manifest["files"]) == sorted(set(on_disk) - {"COMPLETE", "CHECKSUMS.json"})
    assert set(FILES) <= set(manifest["files"])
    algorithm = manifest["algorithm"]
    try:
        import xxhash
    except ImportError:
        xxhash = None
    assert algorithm == ("xxh3_64" if xxhash else "crc32") == integrity.ALGORITHM
    for name, entry in manifest["files"].items():
        data = (folder / name).read_bytes()
        assert entry["size"] == len(data)
        expected = xxhash.xxh3_64(data).hexdigest() if algorithm == "xxh3_64" else f"{zlib.crc32(data):08x}"
        assert entry["checksum"] == expected, name
    step, line = (folder / ckpt.MARKER).read_text().splitlines()
    raw = (folder / integrity.MANIFEST).read_bytes()
    assert step == "2" and line == f"CHECKSUMS.json crc32={zlib.crc32(raw):08x}"
    assert ckpt.verify_checkpoint(folder) is True and ckpt.verify_checkpoint(folder, "sizes") is True


def test_phase_marker_is_in_the_manifest(tmp_path):
    folder = save(tmp_path / "run", 3, phase_end="short")
    assert "PHASE" in json.loads((folder / integrity.MANIFEST).read_text())["files"]
    (folder / "PHASE").write_text("shorT")
    with pytest.raises(DamagedCheckpoint) as err:
        ckpt.verify_checkpoint(folder)
    one_line_error(err, folder, "PHASE", "checksum mismatch")


def test_unknown_mode_is_refused(folder):
    with pytest.raises(ValueError, match="verify='yes'"):
        ckpt.verify_checkpoint(folder, "yes")


# ------------------------------------------------------------------ damage: one line, before any parser


def load_reading(folder, name):
    """The loader that parses `name`."""
    if name == "model.safetensors":
        return lambda: ckpt.load_weights(fresh()[0], folder)
    if name == "state.pt":
        return lambda: ckpt.read_state(folder)
    model, optimizer = fresh()
    return lambda: ckpt.load_checkpoint(folder, model, optimizer)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
@pytest.mark.parametrize("name", FILES)
def test_damaged_file_is_one_line_naming_it(folder, name, damage):
    (flip if damage == "flip" else truncate)(folder / name)
    reason = "checksum mismatch" if damage == "flip" else "bytes"
    with pytest.raises(DamagedCheckpoint) as err:
        ckpt.verify_checkpoint(folder)
    one_line_error(err, folder, name, reason)
    assert err.value.file == name and err.value.folder == folder
    with pytest.raises(DamagedCheckpoint) as err:  # the loader refuses before its parser sees the file
        load_reading(folder, name)()
    assert err.value.file == name and reason in err.value.reason and "unreadable" not in str(err.value)
    if damage == "flip":  # sizes alone cannot see a flipped bit
        assert ckpt.verify_checkpoint(folder, "sizes") is True
    else:
        with pytest.raises(DamagedCheckpoint, match=name.replace(".", r"\.")):
            ckpt.verify_checkpoint(folder, "sizes")


def test_loaders_check_only_what_they_read(folder):
    flip(folder / "model.safetensors")
    assert ckpt.read_state(folder)["step"] == 2  # state.pt is intact
    model, optimizer = fresh()
    ckpt.load_checkpoint(folder, model, optimizer)  # dcp/, state.pt, rng
    with pytest.raises(DamagedCheckpoint, match="model.safetensors"):
        ckpt.weights_vocab(folder)
    ckpt.load_weights(fresh()[0], folder, verify="never")  # a flipped weight still parses


def test_weights_vocab_from_dcp_metadata_is_verified(folder):
    (folder / "model.safetensors").unlink()
    with pytest.raises(DamagedCheckpoint, match="model.safetensors: missing"):
        ckpt.verify_checkpoint(folder)
    assert ckpt.weights_vocab(folder) == MODEL.vocab_size  # reads dcp/.metadata only, which is intact
    flip(folder / "dcp" / ".metadata", at=40)
    with pytest.raises(DamagedCheckpoint) as err:
        ckpt.weights_vocab(folder)
    one_line_error(err, "dcp/.metadata", "checksum mismatch")


def test_missing_file(folder):
    (folder / "dcp" / "__0_0.distcp").unlink()
    with pytest.raises(DamagedCheckpoint) as err:
        load_reading(folder, "dcp/__0_0.distcp")()
    one_line_error(err, folder, "dcp/__0_0.distcp: missing")


def test_manifest_missing_although_the_marker_names_it(folder):
    (folder / integrity.MANIFEST).unlink()
    with pytest.raises(DamagedCheckpoint) as err:
        ckpt.read_state(folder)
    one_line_error(err, folder, "CHECKSUMS.json: missing")


def test_damaged_manifest(folder):
    flip(folder / integrity.MANIFEST)
    with pytest.raises(DamagedCheckpoint) as err:
        ckpt.verify_checkpoint(folder, "sizes")
    one_line_error(err, "CHECKSUMS.json", "checksum mismatch")
    (folder / ckpt.MARKER).write_text("2\n")  # a marker that does not vouch for it: the manifest alone
    (folder / integrity.MANIFEST).write_text(json.dumps({"format": 1, "algorithm": "crc32", "files": {"state.pt": {"size": "1"}}}))
    with pytest.raises(DamagedCheckpoint) as err:
        ckpt.read_state(folder)
    one_line_error(err, "CHECKSUMS.json", "unreadable")
    outside = {"../x": {"size": 1, "checksum": "0"}}
    (folder / integrity.MANIFEST).write_text(json.dumps({"format": 1, "algorithm": "crc32", "files": outside}))
    with pytest.raises(DamagedCheckpoint, match="outside the checkpoint"):
        ckpt.verify_checkpoint(folder)


def test_a_file_added_after_the_manifest_is_not_read(tmp_path):
    folder = save(tmp_path / "run", 2, full_weights=False)
    model, _ = trained(5)
    from safetensors.torch import save_file

    save_file(ckpt.model_state(model), str(folder / ckpt.WEIGHTS))
    with pytest.raises(DamagedCheckpoint) as err:
        ckpt.load_weights(fresh()[0], folder)
    one_line_error(err, "model.safetensors", "not listed in CHECKSUMS.json")


def test_collective_share_splits_the_checksums(folder):
    names = sorted(json.loads((folder / integrity.MANIFEST).read_text())["files"])
    victim = names.index("state.pt")
    flip(folder / "state.pt")
    with pytest.raises(DamagedCheckpoint, match="state.pt"):
        integrity.check(folder, "always", share=(victim % 2, 2))
    assert integrity.check(folder, "always", share=((victim + 1) % 2, 2)) is True


def _verify_on_two_ranks(rank, folder, port, results):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        env = DistEnv(rank, 2)
        try:
            ckpt.verify_checkpoint(folder, env=env)
            results[rank] = "ok"
        except DamagedCheckpoint as exc:
            results[rank] = str(exc)
        good, damaged = ckpt.latest_intact_checkpoint(folder.parent.parent, env=env)
        results[rank + 2] = (good.name if good else None, [(p.name, why) for p, why in damaged])
    finally:
        dist.destroy_process_group()


def test_collective_verification_raises_on_every_rank(tmp_path):
    import socket

    import torch.multiprocessing as mp

    run = tmp_path / "run"
    save(run, 2)
    folder = save(run, 4)
    names = sorted(json.loads((folder / integrity.MANIFEST).read_text())["files"])
    victim = next(n for i, n in enumerate(names) if i % 2 == 1)  # checksummed by rank 1 only
    flip(folder / victim)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_verify_on_two_ranks, args=(folder, port, results), nprocs=2)
    reason = f"{victim}: checksum mismatch ({integrity.ALGORITHM})"
    assert results[0] == results[1] == f"{folder}: damaged checkpoint ({reason})"
    assert results[2] == results[3] == ("step_00000002", [("step_00000004", reason)])


# ------------------------------------------------------------------ falling back, pruning


def test_latest_intact_checkpoint_falls_back_past_damaged_ones(tmp_path):
    run = tmp_path / "run"
    first, second, third = (save(run, s) for s in (2, 4, 6))
    assert ckpt.latest_intact_checkpoint(run) == (third, [])
    truncate(third / "dcp" / "__0_0.distcp")
    flip(second / "state.pt")
    good, damaged = ckpt.latest_intact_checkpoint(run)
    assert good == first
    assert [p for p, _ in damaged] == [third, second]
    assert damaged[0][1].startswith("dcp/__0_0.distcp: ") and damaged[1][1].startswith("state.pt: checksum mismatch")
    assert ckpt.latest_intact_checkpoint(run, "sizes")[0] == second  # a flipped bit keeps the size
    flip(first / "dcp" / ".metadata", at=30)
    good, damaged = ckpt.latest_intact_checkpoint(run)
    assert good is None and [p for p, _ in damaged] == [third, second, first]
    assert damaged[2][1].startswith("dcp/.metadata: checksum mismatch")
    assert ckpt.latest_intact_checkpoint(tmp_path / "nothing") == (None, [])


def test_pruning_keeps_protected_checkpoints(tmp_path):
    run = tmp_path / "run"
    first, second = save(run, 2), save(run, 4)
    third = save(run, 6, keep=1, protect=[first])
    assert ckpt.list_checkpoints(run) == [first, third]
    save(run, 8, keep=1)
    assert ckpt.list_checkpoints(run) == [ckpt.step_dir(run, 8)]


def test_pruning_never_deletes_the_newest_intact_checkpoint(tmp_path):
    run = tmp_path / "run"
    first, second, third = (save(run, s) for s in (2, 4, 6))
    truncate(third / "model.safetensors")  # the newest has lost bytes: the one before it is the one to keep
    assert ckpt.prune(run, keep=1) == [first]
    assert ckpt.list_checkpoints(run) == [second, third]


def test_pruning_keeps_phase_checkpoints_and_counts_the_last_keep(tmp_path):
    run = tmp_path / "run"
    phase = save(run, 2, phase_end="short")
    for step in (4, 6, 8):
        save(run, step, keep=2)
    assert ckpt.list_checkpoints(run) == [phase, ckpt.step_dir(run, 6), ckpt.step_dir(run, 8)]


# ------------------------------------------------------------------ before manifests


def test_checkpoint_without_manifest_loads_unverified(folder):
    np.random.seed(3)
    random.seed(4)
    make_legacy(folder)  # with this process's numpy / python states, as the old trainer wrote them
    drawn = (np.random.standard_normal(5), [random.random() for _ in range(5)])
    assert ckpt.verify_checkpoint(folder) is False and ckpt.verify_checkpoint(folder, "sizes") is False
    assert ckpt.latest_intact_checkpoint(folder.parent.parent) == (folder, [])
    assert ckpt.read_state(folder)["step"] == 2
    model, optimizer = fresh()
    ckpt.load_checkpoint(folder, model, optimizer)
    assert np.array_equal(np.random.standard_normal(5), drawn[0]) and [random.random() for _ in range(5)] == drawn[1]
    ckpt.load_weights(fresh()[0], folder)
    assert ckpt.weights_vocab(folder) == MODEL.vocab_size


def test_every_loader_refuses_non_finite_weights_in_a_checkpoint_without_manifest(tmp_path, capsys):
    model, optimizer = trained()
    with torch.no_grad():
        model.blocks[0].mlp.up_proj.weight[1, 2] = float("nan")
    folder = ckpt.save_checkpoint(tmp_path / "run", 2, model, optimizer, {"data": {"seed": 0, "next_step": 2}}, 2)
    ckpt.load_weights(fresh()[0], folder)  # its checksums vouch for what was saved, NaN and all
    make_legacy(folder)
    reason = "tensor blocks.0.mlp.up_proj.weight holds NaN or infinite values; unverified (no checksums)"
    loaders = {"model.safetensors": lambda: ckpt.load_weights(fresh()[0], folder),
               "dcp": lambda: ckpt.load_checkpoint(folder, *fresh())}
    for file, load in loaders.items():
        with pytest.raises(DamagedCheckpoint) as err:
            load()
        assert one_line_error(err) == f"{folder}: damaged checkpoint ({file}: {reason})"
    (folder / ckpt.WEIGHTS).unlink()
    with pytest.raises(DamagedCheckpoint, match="dcp: tensor blocks.0.mlp.up_proj.weight holds NaN"):
        ckpt.load_weights(fresh()[0], folder)
    assert "warning" not in capsys.readouterr().err


def test_a_checkpoint_without_manifest_loads_with_one_line_of_warning(folder, capsys):
    make_legacy(folder)
    ckpt.load_checkpoint(folder, *fresh())
    assert capsys.readouterr().err == (f"ropelab: warning: {folder}: unverified (no checksums): written before "
                                       "checkpoints had them; its weights were checked only for being finite\n")
    ckpt.load_weights(fresh()[0], folder, verify="never")  # asked not to check: nothing said
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("name", FILES)
def test_damage_in_a_checkpoint_without_manifest_is_still_one_line(folder, name):
    make_legacy(folder)
    truncate(folder / name)
    with pytest.raises(ConfigError) as err:
        load_reading(folder, name)()
    text = one_line_error(err, name.split("/")[-1] if name != "dcp/__0_0.distcp" else "dcp")
    assert "Traceback" not in text


# ------------------------------------------------------------------ RNG states


def test_rng_state_is_plain_data_and_resumes_bitwise(tmp_path):
    torch.manual_seed(1)
    np.random.seed(2)
    random.seed(3)
    np.random.standard_normal(3)  # odd count: the legacy generator caches a gaussian
    random.gauss(0, 1)  # python's caches one too
    path = tmp_path / "rng.pt"
    torch.save(ckpt.rng_state(), path)
    assert np.random.get_state()[3] == 1 and random.getstate()[2] is not None

    def draws():
        return (torch.rand(4), np.random.standard_normal(4), np.random.randint(0, 1 << 30, 4),
                [random.random() for _ in range(3)], random.gauss(0, 1))

    expected = draws()
    state = torch.load(path, weights_only=True)  # loadable without admitting any global
    ckpt.set_rng_state(state)
    again = draws()
    assert torch.equal(expected[0], again[0]) and np.array_equal(expected[1], again[1])
    assert np.array_equal(expected[2], again[2]) and expected[3:] == again[3:]


def test_resume_restores_the_rng_bitwise(folder):
    np.random.seed(0)
    random.seed(0)
    state = torch.load(folder / "rng_rank0.pt", weights_only=True)
    ckpt.set_rng_state(state)
    expected = (torch.rand(3), np.random.rand(3), random.random())
    model, optimizer = fresh()
    ckpt.load_checkpoint(folder, model, optimizer)
    assert torch.equal(torch.rand(3), expected[0]) and np.array_equal(np.random.rand(3), expected[1])
    assert random.random() == expected[2]
    reference, _ = trained(2)
    assert all(torch.equal(a, b) for a, b in zip(reference.state_dict().values(), model.state_dict().values()))


def test_extra_state_must_be_plain_data(tmp_path):
    model, optimizer = trained()
    extra = {"loss": np.float32(0.5), "rows": [(1, "a")]}
    folder = ckpt.save_checkpoint(tmp_path / "run", 1, model, optimizer, extra, 2)
    state = torch.load(folder / "state.pt", weights_only=True)
    assert state["loss"] == 0.5 and type(state["loss"]) is float and state["rows"] == [(1, "a")]

    class Opaque:
        pass

    with pytest.raises(TypeError, match=r"extra\['what'\]: a Opaque"):
        ckpt.save_checkpoint(tmp_path / "run", 2, model, optimizer, {"what": Opaque()}, 2)
    assert not (ckpt.checkpoint_dir(tmp_path / "run") / ".tmp_step_00000002").exists()
