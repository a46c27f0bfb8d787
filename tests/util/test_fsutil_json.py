"""fsutil.read_json_object: a JSON file mmfast wrote, read as a dict or as nothing."""

from mmfast.util.fsutil import marker_kind, read_json_object, write_marker


def test_a_json_object_is_read_and_anything_else_is_empty(tmp_path):
    cases = {
        "object.json": (b'{"kind": "export", "n": 2}', {"kind": "export", "n": 2}),
        "list.json": (b"[1, 2]", {}),
        "half.json": (b'{"kind": "exp', {}),
        "latin1.json": ('{"caption": "caf\u00e9"}'.encode("latin-1"), {}),
        "empty.json": (b"", {}),
    }
    for name, (raw, want) in cases.items():
        (tmp_path / name).write_bytes(raw)
        assert read_json_object(tmp_path / name) == want, name
    assert read_json_object(tmp_path / "missing.json") == {}
    assert read_json_object(tmp_path) == {}  # a folder where the file should be


def test_a_marker_names_its_kind_and_a_damaged_one_none(tmp_path):
    write_marker(tmp_path, "export")
    assert marker_kind(tmp_path) == "export"
    (tmp_path / ".mmfast-prepared").write_text('{"kind": 3}')
    assert marker_kind(tmp_path) is None
    (tmp_path / ".mmfast-prepared").write_text("[]")
    assert marker_kind(tmp_path) is None
