"""A part of a split generate removes only its own shards when it starts: part 10 and up number theirs past six
digits (shard-1000000.tar), which were read as part 1's (its first six digits), so part 1 deleted part 10's."""
from types import SimpleNamespace

from rlaif.io import storage
from rlaif.stages import generate


def test_a_part_removes_only_its_own_shards_past_part_ten(tmp_path):
    storage.configure(None)
    stage = tmp_path / "generate"
    stage.mkdir()
    for part in (1, 10, 11):
        (stage / f"shard-{part * generate.PART_SHARD_STRIDE:06d}.tar").write_bytes(b"x")
    ctx = SimpleNamespace(url=storage.normalize(str(stage)), part_index=1, num_parts=12)
    generate.invalidate(ctx)
    assert sorted(p.name for p in stage.glob("shard-*")) == ["shard-1000000.tar", "shard-1100000.tar"]
