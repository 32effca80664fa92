"""The engine manifest record: on-disk layout kept, strict parsing, one-line checks, atomic write.

``tests/data/manifest-*.json`` are manifests written before :class:`refit.core.manifest.Manifest`
existed (plain dicts dumped by the exporter and ``build_engines``): a GPT-2-like ONNX export,
and a tiny T5 with a ``tensorrt`` section from the stand-in build. They are the old layout that
existing engine folders carry; most tests here start from them and need no export.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from refit.core.errors import RefitError
from refit.core.manifest import FORMAT, MANIFEST, Manifest
from refit.rollout.engine import ModelSpec

DATA = Path(__file__).parent / "data"
OLD = {"gpt2": DATA / "manifest-gpt2-onnx.json", "t5": DATA / "manifest-t5-tensorrt.json"}


def _raw(name: str) -> dict:
    return json.loads(OLD[name].read_text())


def _one_line_error(raw: dict, *words: str) -> str:
    """Parse and check ``raw``; it must fail with one RefitError line holding ``words``."""
    with pytest.raises(RefitError) as e:
        Manifest.from_dict(raw).check()
    msg = str(e.value)
    assert "\n" not in msg, msg
    for w in words:
        assert w in msg, msg
    return msg


def _layout(v, depth=0):
    """Key paths of a manifest, map keys (graph, input, HF names) folded to '*': the layout, not the content."""
    if isinstance(v, dict):
        mapped = depth > 0 and not {"file", "vocab_size", "pad", "plan", "min", "engine"} & set(v) and all(
            isinstance(x, (dict, list)) for x in v.values())
        return {("*" if mapped else k): _layout(x, depth + 1) for k, x in v.items()}
    if isinstance(v, list):
        return [_layout(v[0], depth + 1)] if v and isinstance(v[0], dict) else "list"
    return type(v).__name__ if v is not None else "null"


# ---------------------------------------------------------------------------- layout

@pytest.mark.parametrize("name", sorted(OLD))
def test_old_layout_parses_checks_and_round_trips_byte_for_byte(name):
    text = OLD[name].read_text()
    m = Manifest.from_dict(json.loads(text))
    m.check()
    assert json.dumps(m.to_dict(), indent=1) == text  # the exporter wrote json.dumps(dict, indent=1)
    assert Manifest.from_dict(m.to_dict()) == m and m.extra == {}


def test_old_layout_fields_are_typed():
    t5 = Manifest.from_dict(_raw("t5"))
    assert t5.kind == "seq2seq" and set(t5.graphs) == {"encoder", "decoder"}
    assert t5.special_ids.decoder_start is not None and t5.dims.max_positions is None  # T5: relative positions
    assert t5.tensorrt["decoder"].profiles == ("prefill", "decode") and t5.tensorrt["encoder"].profiles == ("encode",)
    assert t5.tensorrt["decoder"].device.compute_capability == "0.0"
    assert t5.profiles["encoder"]["encode"]["input_ids"].max == (t5.dims.max_batch, t5.dims.max_len)
    tied_to = set(t5.tied.values())
    assert tied_to <= set(t5.weight_map) and not set(t5.tied) & set(t5.weight_map)
    assert {t.graph for name in tied_to for t in t5.weight_map[name]} == {"encoder", "decoder"}


def test_model_spec_comes_from_the_manifest_fields():
    m = Manifest.from_dict(_raw("gpt2"))
    spec = ModelSpec.from_manifest(m)
    assert (spec.kind, spec.pad_id, spec.eos_id, spec.decoder_start_id, spec.prompt_side, spec.vocab_size) == (
        "decoder", m.special_ids.pad, m.special_ids.eos, None, "left", m.dims.vocab_size)
    assert m.dims.max_positions < m.dims.max_len and spec.max_len == m.dims.max_positions  # learned positions cap it
    t5 = ModelSpec.from_manifest(Manifest.from_dict(_raw("t5")))
    assert t5.kind == "seq2seq" and t5.prompt_side == "right" and t5.max_len == 128


@pytest.mark.parametrize("arch", ["tiny-gpt2", "tiny-t5"])
def test_fresh_export_keeps_the_old_layout_and_round_trips(engine_dirs, arch, tmp_path):
    d = engine_dirs[arch]
    text = (d / MANIFEST).read_text()
    m = Manifest.read(d)
    assert json.dumps(m.to_dict(), indent=1) == text
    old = _raw("t5" if arch == "tiny-t5" else "gpt2")
    old.pop("tensorrt", None)
    fresh = json.loads(text)
    caps = fresh.pop("capabilities")  # the sections added since (optional: old folders load without them)
    assert fresh.pop("attention") == "fused" and fresh.pop("attention_reason")
    assert fresh["options"].pop("attention") == "auto"  # the ExportOptions field that chose it
    # the gate's reference dtype and how the engine ran (refit/export/precision.py)
    assert fresh["parity"].pop("reference_dtype") == fresh["dtype"] and fresh["parity"].pop("engine_run")
    # int8 engines (refit/export/quantize.py) add manifest.quantization
    assert fresh["options"].pop("quantize") == "none"
    assert isinstance(fresh.pop("export_peak_rss_mb"), int)  # the export's own peak RSS (refit/export/memory.py)
    assert "tokenizer_config.json" in fresh["hashes"].pop("tokenizer_sha256")  # the engine's tokenizer/ files
    for graph, constants in fresh.pop("constants", {}).items():  # initializers no weight reaches
        assert graph in fresh["graphs"] and all(v == "constant" or v.startswith("buffer ") for v in constants.values())
    if m.attention == "fused":  # the fused graph names its own dynamic dims (cap instead of past/total)
        assert set(fresh.pop("dynamic_dims")) == {"batch", "seq", "cap", "keep"} | ({"enc_seq"} if m.kind == "seq2seq"
                                                                                    else set())
        old.pop("dynamic_dims")
    assert _layout(fresh) == _layout(old) and caps["kind"] == fresh["kind"]
    m.write(tmp_path)
    assert (tmp_path / MANIFEST).read_text() == text and [p.name for p in tmp_path.iterdir()] == [MANIFEST]


def test_unknown_top_level_section_is_preserved(tmp_path):
    raw = _raw("gpt2")
    raw["sparsity"] = {"scheme": "2:4", "per_channel": True}  # e.g. a newer exporter's section
    m = Manifest.from_dict(raw)
    assert m.extra == {"sparsity": raw["sparsity"]} and m.to_dict() == raw
    replace(m, export_seconds=1.0).write(tmp_path)  # what build_engines does: rewrite with one field changed
    back = json.loads((tmp_path / MANIFEST).read_text())
    assert back["sparsity"] == raw["sparsity"] and back["export_seconds"] == 1.0


def test_export_peak_rss_is_a_typed_optional_field(tmp_path):
    """Old folders load without it; present, it is a positive whole number of MB, written back as read."""
    raw = _raw("gpt2")
    assert Manifest.from_dict(raw).export_peak_rss_mb is None and "export_peak_rss_mb" not in raw
    m = replace(Manifest.from_dict(raw), export_peak_rss_mb=2345)
    m.write(tmp_path)
    back = json.loads((tmp_path / MANIFEST).read_text())
    assert back["export_peak_rss_mb"] == 2345 and Manifest.read(tmp_path) == m
    assert list(back).index("export_peak_rss_mb") == list(back).index("export_seconds") + 1
    raw["export_peak_rss_mb"] = 0
    _one_line_error(raw, "export_peak_rss_mb is 0")
    raw["export_peak_rss_mb"] = "big"
    with pytest.raises(RefitError, match="export_peak_rss_mb"):
        Manifest.from_dict(raw)


def test_capabilities_record_must_agree_with_the_geometry(engine_dirs):
    """The probe's record is typed and checked: a capabilities block that contradicts dims is one line."""
    raw = json.loads((engine_dirs["tiny-gpt2"] / MANIFEST).read_text())
    assert Manifest.from_dict(raw).capabilities.tied_head is True
    raw["capabilities"]["n_kv_heads"] = 3
    _one_line_error(raw, "capabilities.n_kv_heads is 3")
    raw["capabilities"]["tied_head"] = "yes"
    with pytest.raises(RefitError, match="capabilities.tied_head: expected bool"):
        Manifest.from_dict(raw)


# ---------------------------------------------------------------------------- strict parsing

def test_unknown_missing_or_mistyped_key_in_a_section_fails_in_one_line():
    raw = _raw("gpt2")
    raw["dims"]["max_lenn"] = 64
    _one_line_error(raw, "dims: unknown key(s) max_lenn")
    raw = _raw("gpt2")
    del raw["special_ids"]["eos"]
    _one_line_error(raw, "special_ids: missing eos")
    raw = _raw("gpt2")
    raw["dims"]["n_layers"] = "2"
    _one_line_error(raw, "dims.n_layers: expected int")
    raw = _raw("t5")
    raw["tensorrt"]["decoder"]["profiles"] = "prefill"
    _one_line_error(raw, "tensorrt.decoder.profiles: expected a list")
    raw = _raw("gpt2")
    del raw["graphs"]
    _one_line_error(raw, "missing graphs")


def test_read_errors_are_one_line(tmp_path):
    cases = {}
    cases["missing"] = (tmp_path / "nope", "engine folder", "does not exist")
    (tmp_path / "empty").mkdir()
    cases["empty"] = (tmp_path / "empty", "is not a Refit engine folder: no manifest.json", "refit export")
    for name, content in (("corrupt", "{not json"), ("old", json.dumps({"format": "refit-engine/0"})),
                          ("list", "[]")):
        (tmp_path / name).mkdir()
        (tmp_path / name / MANIFEST).write_text(content)
    cases["corrupt"] = (tmp_path / "corrupt", "is corrupt")
    cases["old"] = (tmp_path / "old", "has format 'refit-engine/0'", f"this Refit reads '{FORMAT}'")
    cases["list"] = (tmp_path / "list", "has format 'list'")
    for folder, *words in cases.values():
        with pytest.raises(RefitError) as e:
            Manifest.read(folder)
        assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


# ---------------------------------------------------------------------------- check()

def test_check_catches_a_broken_weight_map():
    raw = _raw("gpt2")
    a, b = list(raw["weight_map"])[:2]
    raw["weight_map"][b].append(dict(raw["weight_map"][a][0]))
    engine = raw["weight_map"][a][0]["engine"]
    _one_line_error(raw, f"engine weight decoder:{engine} is fed by both {a} and {b}")
    raw = _raw("gpt2")
    raw["weight_map"][a][0]["graph"] = "encoder"
    _one_line_error(raw, f"{a} -> encoder:", "names no graph of this manifest")
    raw = _raw("gpt2")
    raw["weight_map"][a] = []
    _one_line_error(raw, f"{a} feeds no engine weight")
    raw = _raw("t5")
    canon = next(iter(raw["tied"].values()))
    del raw["weight_map"][canon]
    _one_line_error(raw, f"-> {canon}, which is not in the weight map")


def test_check_catches_a_missing_graph():
    raw = _raw("t5")
    del raw["graphs"]["encoder"]
    msg = _one_line_error(raw, "a seq2seq engine has graphs ['encoder', 'decoder'], this one ['decoder']")
    assert "more)" in msg  # the weight map and profiles still name the encoder: counted, not listed
    raw = _raw("gpt2")
    raw["kind"] = "seq2seq"
    _one_line_error(raw, "special_ids.decoder_start is null")


def test_check_catches_a_profile_that_does_not_cover_an_input():
    raw = _raw("gpt2")
    del raw["profiles"]["decoder"]["decode"]["position_ids"]
    _one_line_error(raw, "decoder/decode: input position_ids has no min/opt/max")
    raw = _raw("gpt2")
    raw["profiles"]["decoder"]["prefill"]["extra_input"] = raw["profiles"]["decoder"]["prefill"]["input_ids"]
    _one_line_error(raw, "decoder/prefill: 'extra_input' is not an input of graph decoder")
    raw = _raw("gpt2")
    raw["profiles"]["decoder"]["prefill"]["input_ids"]["opt"][1] = 10_000
    _one_line_error(raw, "decoder/prefill.input_ids: needs 0 <= min <= opt <= max")
    raw = _raw("t5")
    raw["tensorrt"]["decoder"]["profiles"] = ["decode", "prefill"]
    _one_line_error(raw, "decoder: TensorRT profiles ['decode', 'prefill'] differ from the manifest's")


def test_check_catches_bad_dims_and_kind():
    raw = _raw("gpt2")
    raw["dims"]["max_len"] = 0
    _one_line_error(raw, "dims.max_len is 0, must be positive")
    raw = _raw("gpt2")
    raw["kind"] = "encoder"
    _one_line_error(raw, "kind 'encoder' is not one of decoder, seq2seq")


def test_read_checks_and_write_refuses_an_inconsistent_manifest(tmp_path):
    good = _raw("gpt2")
    (tmp_path / MANIFEST).write_text(json.dumps(good))
    assert Manifest.read(tmp_path) == Manifest.from_dict(good)
    broken = _raw("gpt2")
    del broken["profiles"]["decoder"]["decode"]["position_ids"]
    with pytest.raises(RefitError, match="input position_ids has no min/opt/max"):
        Manifest.from_dict(broken).write(tmp_path)
    assert json.loads((tmp_path / MANIFEST).read_text()) == good, "a refused write must leave the file as it was"
    (tmp_path / MANIFEST).write_text(json.dumps(broken))
    with pytest.raises(RefitError, match=f"{MANIFEST} is inconsistent: decoder/decode: input position_ids"):
        Manifest.read(tmp_path)
    assert Manifest.read(tmp_path, check=False).profiles["decoder"]["decode"].keys() == \
        Manifest.from_dict(broken).profiles["decoder"]["decode"].keys()
