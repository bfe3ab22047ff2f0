"""No code runs from a checkpoint: a pickle planted in state.pt, rng_rank0.pt, dcp/.metadata or a
dcp shard's non-tensor entry, whose unpickling would create a file, is refused with one line and
the file is never created. Each payload is first shown to be live with an ordinary loader."""

from __future__ import annotations

import io
import os
import pickle

import pytest
import torch

from ropelab.config import ConfigError, ModelConfig, TrainConfig
from ropelab.model import Transformer
from ropelab.train import checkpoint as ckpt
from ropelab.train import integrity
from ropelab.train.integrity import DamagedCheckpoint
from ropelab.train.optim import build_optimizer
from ropelab.train.safe_pickle import MetadataUnpickler, UnsafeCheckpoint, load_dcp_metadata, load_plain

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the tests' own dcp calls
MODEL = ModelConfig(vocab_size=48, n_layer=1, d_model=16, n_head=2, d_ff=32, max_seq_len=16)


class CreatesFile:
    """Unpickling it opens `path` for writing (creating it)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


class RunsShell:
    """Unpickling it runs `touch path` in a shell."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


PAYLOADS = [CreatesFile, RunsShell]


def fresh():
    model = Transformer(MODEL)
    return model, build_optimizer(model, TrainConfig(lr=1e-2))


@pytest.fixture
def folder(tmp_path):
    torch.manual_seed(0)
    model, optimizer = fresh()
    idx = torch.randint(0, MODEL.vocab_size, (2, 8))
    model(idx, idx)[1].backward()
    optimizer.step()
    return ckpt.save_checkpoint(tmp_path / "run", 2, model, optimizer, {"phase": 0}, keep=2)


def reseal(folder):
    """Rewrite the manifest and the marker to match the planted files (as whoever planted them could),
    so that what refuses them is the loader, not the checksum."""
    (folder / ckpt.MARKER).write_text(f"2\n{integrity.write_manifest(folder, {})}\n")


def refused(exc_info, path):
    text = str(exc_info.value)
    assert isinstance(exc_info.value, ConfigError) and "\n" not in text, text
    assert str(path) in text and "refusing to load" in text, text
    return text


def plant_state(folder, payload):
    torch.save({"step": 2, "world": 1, "phase": payload}, folder / "state.pt")


def plant_rng(folder, payload):
    torch.save({"torch": torch.get_rng_state(), "numpy": payload, "python": None}, folder / "rng_rank0.pt")


def plant_metadata(folder, payload):
    (folder / "dcp" / ".metadata").write_bytes(pickle.dumps(payload))


def plant_in_metadata(folder, payload):
    """A real dcp Metadata object with the payload tucked into a field."""
    metadata = load_dcp_metadata(folder / "dcp" / ".metadata")
    metadata.planner_data = {"model.embed.weight": payload}
    (folder / "dcp" / ".metadata").write_bytes(pickle.dumps(metadata))


def live(kind, folder, payload_class, tmp_path):
    """Plant a payload aimed at a control path, read the file the ordinary way and check it fires."""
    control = tmp_path / f"control-{kind}-{payload_class.__name__}"
    PLANT[kind](folder, payload_class(control))
    path = folder / FILE[kind]
    if kind.startswith("metadata"):
        with open(path, "rb") as f:
            pickle.load(f)
    else:
        torch.load(path, weights_only=False)
    assert control.exists(), "the payload is not live; the test would prove nothing"


PLANT = {"state": plant_state, "rng": plant_rng, "metadata": plant_metadata, "metadata-nested": plant_in_metadata}
FILE = {"state": "state.pt", "rng": "rng_rank0.pt", "metadata": "dcp/.metadata", "metadata-nested": "dcp/.metadata"}


def loaders(folder, kind):
    model, optimizer = fresh()
    yield lambda: ckpt.load_checkpoint(folder, model, optimizer)
    if kind == "state":
        yield lambda: ckpt.read_state(folder)
    if kind.startswith("metadata"):
        (folder / ckpt.WEIGHTS).unlink()  # the weights then come from dcp/
        reseal(folder)
        yield lambda: ckpt.load_weights(fresh()[0], folder)
        yield lambda: ckpt.weights_vocab(folder)


@pytest.mark.parametrize("payload_class", PAYLOADS)
@pytest.mark.parametrize("kind", list(PLANT))
def test_planted_pickle_is_refused_and_never_runs(folder, tmp_path, kind, payload_class):
    backup = (folder / FILE[kind]).read_bytes()
    live(kind, folder, payload_class, tmp_path)
    (folder / FILE[kind]).write_bytes(backup)
    target = tmp_path / f"pwned-{kind}"
    PLANT[kind](folder, payload_class(target))
    with pytest.raises(DamagedCheckpoint, match=FILE[kind].replace(".", r"\.")):  # the manifest catches it first
        next(loaders(folder, kind))()
    reseal(folder)
    for load in loaders(folder, kind):
        with pytest.raises(UnsafeCheckpoint) as err:
            load()
        refused(err, folder / FILE[kind])
    for verify in ("never", "sizes"):  # the loader refuses it whatever the verification
        model, optimizer = fresh()
        with pytest.raises(UnsafeCheckpoint):
            ckpt.load_checkpoint(folder, model, optimizer, verify=verify)
    assert not target.exists()


@pytest.mark.parametrize("payload_class", PAYLOADS)
def test_planted_pickle_in_a_checkpoint_without_manifest(folder, tmp_path, payload_class):
    (folder / integrity.MANIFEST).unlink()
    (folder / ckpt.MARKER).write_text("2")
    target = tmp_path / "pwned"
    plant_rng(folder, payload_class(target))
    model, optimizer = fresh()
    with pytest.raises(UnsafeCheckpoint) as err:  # old rng files may hold numpy arrays; nothing else
        ckpt.load_checkpoint(folder, model, optimizer)
    text = refused(err, folder / "rng_rank0.pt")
    assert "open" in text or "system" in text
    assert not target.exists()


@pytest.mark.parametrize("payload_class", PAYLOADS)
def test_planted_pickle_in_a_dcp_shard_entry(folder, tmp_path, payload_class):
    """dcp stores non-tensor values (optimizer hyper-parameters) as pickles inside the shards; torch's
    default planner reads them with weights_only=False."""
    import shutil

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    def plant(path):
        model, optimizer = fresh()
        model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))[1].backward()
        optimizer.step()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        optim_sd["param_groups"][0]["lr"] = payload_class(path)
        shutil.rmtree(folder / "dcp")
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder / "dcp"))
        reseal(folder)

    control = tmp_path / "control"
    plant(control)
    model, optimizer = fresh()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder / "dcp"))
    assert control.exists(), "the payload is not live; the test would prove nothing"

    target = tmp_path / "pwned"
    plant(target)
    model, optimizer = fresh()
    with pytest.raises(UnsafeCheckpoint) as err:
        ckpt.load_checkpoint(folder, model, optimizer)
    text = refused(err, folder / "dcp")
    assert "optim.param_groups.0.lr" in text
    ckpt.load_checkpoint(folder, *fresh()[:1])  # the model part holds tensors only: it loads
    assert not target.exists()


def test_metadata_unpickler_reads_real_metadata(folder):
    path = folder / "dcp" / ".metadata"
    with open(path, "rb") as f:
        ordinary = pickle.load(f)
    safe = MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
    assert safe == ordinary
    assert safe.state_dict_metadata["model.embed.weight"].size == torch.Size([MODEL.vocab_size, MODEL.d_model])


def test_metadata_unpickler_refuses_other_globals():
    for payload in (pickle.dumps(print), pickle.dumps(torch.nn.Linear), pickle.dumps(os.getcwd)):
        with pytest.raises(pickle.UnpicklingError, match="it would import"):
            MetadataUnpickler(io.BytesIO(payload)).load()


def test_metadata_that_is_not_metadata_is_refused(folder, tmp_path):
    (folder / "dcp" / ".metadata").write_bytes(pickle.dumps({"a": torch.Size([1])}))
    with pytest.raises(UnsafeCheckpoint, match="not dcp Metadata"):
        load_dcp_metadata(folder / "dcp" / ".metadata")


def test_safe_reader_and_planner_work_with_dcp_load(folder):
    import torch.distributed.checkpoint as dcp

    from ropelab.train.safe_pickle import SafeFileSystemReader, SafeLoadPlanner

    model, _ = fresh()
    state = {"model": model.state_dict()}
    dcp.load(state, storage_reader=SafeFileSystemReader(str(folder / "dcp")), planner=SafeLoadPlanner(folder / "dcp"))
    model.load_state_dict(state["model"])
    reference, _ = fresh()
    ckpt.load_weights(reference, folder)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values()))


def test_load_plain_reports_garbage_in_one_line(tmp_path):
    path = tmp_path / "state.pt"
    torch.save({"step": 1}, path)
    path.write_bytes(path.read_bytes()[:-30])  # a truncated zip archive
    with pytest.raises(DamagedCheckpoint) as err:
        load_plain(path)
    assert "\n" not in str(err.value) and "state.pt: unreadable" in str(err.value)
    path.write_bytes(b"not a checkpoint at all")  # read as a legacy pickle: an opcode the safe reader refuses
    with pytest.raises(UnsafeCheckpoint) as err:
        load_plain(path)
    assert "\n" not in str(err.value) and "Unsupported operand" in refused(err, path)
