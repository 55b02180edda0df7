"""Manifest parsing and file verification (pure file I/O, no OpenVINO)."""

import json

import pytest

from engine.errors import ManifestError, ShardIntegrityError
from engine.manifest import file_entry, parse_manifest, safe_join, verify_files


@pytest.mark.parametrize("rel", ["../x", "/etc/passwd", "a/../../b", "", "a\\..\\b"])
def test_safe_join_refuses_escapes(tmp_path, rel):
    with pytest.raises(ManifestError):
        safe_join(tmp_path, rel)


def test_safe_join_allows_nested_paths(tmp_path):
    assert safe_join(tmp_path, "stage_0/model.xml") == (tmp_path / "stage_0" / "model.xml").resolve()


def test_verify_files_detects_each_kind_of_damage(tmp_path):
    f = tmp_path / "w.bin"
    f.write_bytes(b"0123456789")
    entry = file_entry(tmp_path, f)
    verify_files(tmp_path, (entry,))
    f.write_bytes(b"0123456780")
    with pytest.raises(ShardIntegrityError, match="sha256"):
        verify_files(tmp_path, (entry,))
    f.write_bytes(b"01234")
    with pytest.raises(ShardIntegrityError, match="truncated"):
        verify_files(tmp_path, (entry,))
    f.unlink()
    with pytest.raises(ShardIntegrityError, match="missing"):
        verify_files(tmp_path, (entry,))


def test_malformed_manifests_are_explained(tiny_export):
    good = json.loads((tiny_export("llama", 2) / "manifest.json").read_text())
    assert parse_manifest(good).splits == (2,)
    broken = json.loads(json.dumps(good))
    del broken["model"]["hidden_size"]
    with pytest.raises(ManifestError, match="malformed"):
        parse_manifest(broken)
    gap = json.loads(json.dumps(good))
    gap["stages"][1]["first_layer"] = 3
    with pytest.raises(ManifestError, match="inconsistent layer range"):
        parse_manifest(gap)
    short = json.loads(json.dumps(good))
    short["stages"] = short["stages"][:1]
    with pytest.raises(ManifestError, match="do not cover every layer"):
        parse_manifest(short)
