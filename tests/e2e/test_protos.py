"""The committed stubs are fresh, and every field we declare matches Triton's numbering."""

import difflib
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_committed_stubs_are_fresh(tmp_path):
    # protoc runs in its own process: its bundled protobuf must not meet the one loaded here.
    done = subprocess.run([sys.executable, str(ROOT / "protos" / "generate.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    fresh = sorted(tmp_path.rglob("*_pb2*.py"))
    assert fresh, "nothing generated"
    for path in fresh:
        rel = path.relative_to(tmp_path)
        committed = ROOT / "common" / "pb" / rel
        assert committed.exists(), f"{rel} is not committed; run python protos/generate.py"
        if committed.read_text() != path.read_text():
            diff = "".join(difflib.unified_diff(committed.read_text().splitlines(True), path.read_text().splitlines(True),
                                                str(committed), "fresh", n=1))
            pytest.fail(f"stale stub {rel}; run python protos/generate.py\n{diff[:2000]}")


def _messages(file_descriptor):
    out = {}

    def walk(desc, prefix):
        out[prefix + desc.name] = desc
        for nested in desc.nested_types:
            walk(nested, prefix + desc.name + ".")
    for desc in file_descriptor.message_types_by_name.values():
        walk(desc, "")
    return out


@pytest.mark.parametrize("ours_name, theirs_name", [("kserve", "service_pb2"), ("model_config", "model_config_pb2")])
def test_field_numbers_match_triton(ours_name, theirs_name):
    """Every field of ours exists in tritonclient's copy with the same number, type and label."""
    import tritonclient.grpc as triton

    import common.pb as pb

    ours = _messages(getattr(pb, ours_name).DESCRIPTOR)
    theirs = _messages(getattr(triton, theirs_name).DESCRIPTOR)
    checked = 0
    for name, desc in ours.items():
        assert name in theirs, f"message {name} is not in Triton's protocol"
        other = {f.name: f for f in theirs[name].fields}
        for field in desc.fields:
            assert field.name in other, f"{name}.{field.name} is not in Triton's protocol"
            t = other[field.name]
            assert (field.number, field.type, field.is_repeated) == (t.number, t.type, t.is_repeated), \
                f"{name}.{field.name}: ours {(field.number, field.type)} vs Triton {(t.number, t.type)}"
            checked += 1
    assert checked > 20


def test_service_methods_match_triton():
    import tritonclient.grpc as triton

    from common.pb import kserve

    ours = kserve.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    theirs = triton.service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert ours.full_name == theirs.full_name == "inference.GRPCInferenceService"
    for method in ours.methods:
        t = theirs.methods_by_name[method.name]
        assert method.input_type.full_name == t.input_type.full_name
        assert method.output_type.full_name == t.output_type.full_name
        assert (method.client_streaming, method.server_streaming) == (t.client_streaming, t.server_streaming)
