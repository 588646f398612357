"""A checkpoint's files checked before any rank loads them: cut short, lost, or changed in place at the same size."""
import json

import torch

from rlaif.io import storage
from rlaif.training import FILE_LIST, checkpoint_damage


def saved(tmp_path):
    local = tmp_path / "step-00000010"
    local.mkdir(parents=True)
    torch.save({"model": {"w": torch.arange(4096, dtype=torch.float32)}}, local / "engine.pt")
    (local / "client_state.json").write_text(json.dumps({"step": 10}))
    files = storage.upload_dir(local, local.as_uri())  # in place: the listing a rank writes after its upload
    (local / FILE_LIST.format(rank=0)).write_text(json.dumps(files))
    return local


def test_a_whole_checkpoint_passes(tmp_path):
    assert checkpoint_damage(saved(tmp_path), "ddp") is None


def test_bytes_changed_in_place_are_found_though_the_archive_still_opens(tmp_path):
    local = saved(tmp_path)
    engine = local / "engine.pt"
    data = bytearray(engine.read_bytes())
    middle = data.index(torch.arange(4096, dtype=torch.float32)[2048:2050].numpy().tobytes())
    data[middle:middle + 4] = torch.tensor([7.0]).numpy().tobytes()
    engine.write_bytes(bytes(data))
    assert torch.load(engine, weights_only=True)["model"]["w"][2048] == 7.0  # it loads: only the checksum tells
    assert checkpoint_damage(local, "ddp") == "engine.pt does not match the checksum it was saved with"


def test_a_cut_short_archive_a_lost_file_and_a_torn_listing(tmp_path):
    local = saved(tmp_path)
    engine = local / "engine.pt"
    engine.write_bytes(engine.read_bytes()[: engine.stat().st_size // 2])
    assert checkpoint_damage(local, "ddp").startswith("engine.pt: ")

    local = saved(tmp_path / "lost")
    (local / "client_state.json").unlink()
    assert checkpoint_damage(local, "ddp") == "client_state.json is missing"
    rng = local.parent / "rng"
    (rng / "step").mkdir(parents=True)
    torch.save({"torch": torch.get_rng_state()}, rng / "step/rng-rank0.pt")
    listing = storage.upload_dir(rng / "step", (rng / "step").as_uri())
    (rng / "step/rng-rank0.pt").unlink()  # a file this rank listed, gone (no file is required under DeepSpeed)
    (rng / "step" / FILE_LIST.format(rank=0)).write_text(json.dumps(listing))
    (rng / "step" / FILE_LIST.format(rank=1)).write_text(json.dumps([{"path": "lost.pt", "sha256": "0"}]))
    assert checkpoint_damage(rng / "step", "deepspeed") == "rng-rank0.pt is missing"  # each rank checks its own list

    local = saved(tmp_path / "torn")
    listing = local / FILE_LIST.format(rank=0)
    listing.write_text(listing.read_text()[:20])
    assert checkpoint_damage(local, "ddp").startswith("files-rank0.json: ")
