"""A checkpoint's manifest (ds_ppo/engine/checkpoint/manifest.py): who checksums which file, the parts of
several ranks merged into one manifest, and each kind of damage named. Plain files: no torch."""
from __future__ import annotations

import json

from ds_ppo.engine.checkpoint import manifest

FILES = {"policy/ds/zero_pp_rank_0_mp_rank_00_optim_states.pt": 400,
         "policy/ds/zero_pp_rank_1_mp_rank_00_optim_states.pt": 400,
         "policy/ds/zero_pp_rank_1_mp_rank_00_model_states.pt": 40,
         "rng/rank_00000.pt": 8, "rng/rank_00001.pt": 8,
         "hf/model.safetensors": 300, "hf/config.json": 5, "trainer_state.json": 3}


def test_each_rank_sums_its_own_files_and_a_share_of_the_rest():
    one, two = manifest.shares(FILES, 1), manifest.shares(FILES, 2)
    assert sorted(one[0]) == sorted(FILES)
    assert sorted(two[0] + two[1]) == sorted(FILES)  # every file once
    assert {"policy/ds/zero_pp_rank_1_mp_rank_00_optim_states.pt",
            "policy/ds/zero_pp_rank_1_mp_rank_00_model_states.pt",
            "rng/rank_00001.pt"} <= set(two[1])
    assert {"policy/ds/zero_pp_rank_0_mp_rank_00_optim_states.pt", "rng/rank_00000.pt"} <= \
        set(two[0])
    # the big unnamed file goes to the rank with fewer bytes so far (rank 0: 408 < 448)
    assert "hf/model.safetensors" in two[0]
    assert manifest.shares(FILES, 2) == two  # the same on every rank


def test_parts_of_two_ranks_make_one_manifest_that_names_each_damage(tmp_path):
    for rel, size in FILES.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(bytes(range(256)) * (size // 256) + b"x" * (size % 256))
    for rank in (1, 0):
        manifest.write_share(tmp_path, rank, 2)
    (tmp_path / "late.json").write_text("{}")  # a file no part covers: rank 0 sums it
    assert manifest.merge(tmp_path) == len(FILES) + 1
    assert not (tmp_path / ".manifest_parts").exists()
    listed = json.loads((tmp_path / manifest.MANIFEST).read_text())["files"]
    assert listed["hf/config.json"][0] == 5 and "late.json" in listed
    assert manifest.problems(tmp_path, 0, 2) == manifest.problems(tmp_path, 1, 2) == []
    (tmp_path / "ds_universal").mkdir()  # made later (another world size): not listed
    (tmp_path / "ds_universal" / "x").write_text("x")

    weights = tmp_path / "hf" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[100] ^= 0xFF
    weights.write_bytes(bytes(data))
    (tmp_path / "rng" / "rank_00001.pt").unlink()
    (tmp_path / "trainer_state.json").write_text("{}")
    found = dict(manifest.problems(tmp_path))
    assert found["hf/model.safetensors"].startswith("has changed since it was saved (CRC-32")
    assert found["rng/rank_00001.pt"] == "is missing"
    assert found["trainer_state.json"].startswith("is 2 bytes, 3 when it was saved (cut off")
    assert len(found) == 3
    # on two ranks, each finds the damage in its share
    assert {rel for rank in (0, 1) for rel, _ in manifest.problems(tmp_path, rank, 2)} == \
        set(found)
    assert manifest.problems(tmp_path, prefixes=("hf/",)) == [
        ("hf/model.safetensors", found["hf/model.safetensors"])]
