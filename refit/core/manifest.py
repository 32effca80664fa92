"""The engine folder's manifest: the typed record every backend reads, checked, in one place.

``manifest.json`` is the contract between the exporter and every backend (ONNX Runtime, TensorRT, the parity gate, the
TensorRT checks): model geometry, special ids, the padding rule, the graphs and their I/O names, the HF -> engine weight
map, tied aliases, the shape profiles, hashes, export options, library versions, the parity record and, once built, the
TensorRT plans. :class:`Manifest` is that record (its sections, :class:`Dims`, :class:`GraphSpec`, ..., are the
records of :mod:`refit.core.manifest_sections`). It is read (:meth:`Manifest.read`), written (:meth:`Manifest.write`,
atomically) and converted (:meth:`Manifest.from_dict`, :meth:`Manifest.to_dict`) here and nowhere else; code
elsewhere reads its fields.

On disk the layout is unchanged (``FORMAT = "refit-engine/1"``): engine folders exported before this record existed load
as they are, and ``to_dict()`` gives back exactly the JSON read.

Unknown keys. Inside a known section (``dims``, a graph, a weight-map entry, a TensorRT plan, ...) an unknown or missing
key is an error, in one line: a misspelt or half-written manifest fails where it is read, not as a KeyError deep inside
a backend. Unknown *top-level* sections are preserved deliberately in :attr:`Manifest.extra` and written back verbatim:
an exporter that adds a section within the same format (a newer Refit, another branch's exporter) still produces a
folder this one can run, and ``build_engines`` rewriting the manifest does not drop the section. No code reads
``extra``; a reader that needs a section adds a typed field for it here.

:meth:`Manifest.check` validates what the types cannot: the kind and its graphs, positive dims, a 1:1 weight map into
existing graphs, tied aliases, every graph input covered by every shape profile, TensorRT plans that match the graphs
and profiles. :meth:`Manifest.read` runs it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

from refit.core.errors import RefitError
from refit.core.manifest_sections import (Capabilities, Dims, GraphSpec, Hashes, Lora, Padding, Parity, Profiles,
                                          Quantization, SpecialIds, TrtPlan, WeightTarget)
from refit.core.records import OMIT_IF_NONE, LayoutError, build_record, plain, read_json

MANIFEST = "manifest.json"  # file name inside an engine folder
FUSED_INPUTS = frozenset({"seqlens_k", "query_seqlens"})  # graph inputs only a fused-attention decoder has
FORMAT = "refit-engine/1"  # on-disk layout; bump when a reader of the old one would misread the new
KINDS = ("decoder", "seq2seq")
GRAPHS_OF_KIND = {"decoder": ("decoder",), "seq2seq": ("encoder", "decoder")}
DTYPES = ("fp32", "fp16", "bf16")
SIDES = ("left", "right")
TRANSFORMS = ("identity", "transpose", "affine")  # HF tensor -> the tensor the engine stores


# ------------------------------------------------------------------------------- the record

@dataclass(frozen=True)
class Manifest:
    """An engine folder's ``manifest.json``. Mappings are the record's own: read them, do not change them."""

    backend: str  # the graphs' format: "onnx" in every engine folder (the engine that runs them: options.backend)
    model_type: str  # HF config.model_type ("gpt2", "llama", "t5", ...)
    architecture: str  # HF class, e.g. "GPT2LMHeadModel"
    kind: str  # "decoder" | "seq2seq"
    dtype: str  # "fp32" | "fp16" | "bf16": weights and activations of the engine
    opset: int  # ONNX default-domain opset of the graphs
    source_model: str  # absolute path of the HF checkpoint exported (may not exist on this machine)
    padding: Padding
    special_ids: SpecialIds
    dims: Dims
    graphs: Mapping[str, GraphSpec]  # {"decoder": ..., "encoder": ... (seq2seq)}
    dynamic_dims: Mapping[str, str]  # {dim name used in the graphs' shapes: meaning}
    profiles: Profiles  # {graph: {"prefill"|"decode"|"encode": {input: ShapeRange}}}, in profile order
    weight_map: Mapping[str, tuple[WeightTarget, ...]]  # {canonical HF name: its engine weights}
    tied: Mapping[str, str]  # {HF alias: canonical HF name}; aliases are not in weight_map
    hashes: Hashes
    cache_key: str  # sha256 of (weights, options, exporter version): an export is reused when equal
    options: Mapping[str, object]  # ExportOptions as exported (asdict), kept as written: older option sets load
    versions: Mapping[str, str]  # {library: version} at export time
    trace_seconds: float  # tracing + writing the graphs, before the parity gate
    capabilities: Capabilities | None = field(default=None, metadata=OMIT_IF_NONE)  # the probe's findings
    parity: Parity | None = field(default=None, metadata=OMIT_IF_NONE)  # added once the gate passed
    export_seconds: float | None = field(default=None, metadata=OMIT_IF_NONE)  # whole export, gate included
    # the exporting process's peak resident size (MB, its high-water mark by the end of the export;
    # refit/export/memory.py)
    export_peak_rss_mb: int | None = field(default=None, metadata=OMIT_IF_NONE)
    tensorrt: Mapping[str, TrtPlan] | None = field(default=None, metadata=OMIT_IF_NONE)  # {graph: plan} once built
    # decoder attention (refit/export/fused.py): "fused" = GroupQueryAttention over a preallocated KV buffer
    # (graph inputs seqlens_k/query_seqlens, compact rows); "plain" or None (folders exported before
    # the field existed) = standard ops, concatenated cache, attention_mask input
    attention: str | None = field(default=None, metadata=OMIT_IF_NONE)
    attention_reason: str | None = field(default=None, metadata=OMIT_IF_NONE)  # why this attention was chosen
    # {graph: {initializer: what it is}}: float initializers that no weight feeds, e.g. a rotary
    # ``inv_freq`` buffer or a folded scale; constants of the graph that training never changes
    # (refit/export/weight_map.py decides by provenance: no HF parameter reaches them)
    constants: Mapping[str, Mapping[str, str]] | None = field(default=None, metadata=OMIT_IF_NONE)
    # int8 rollout engine (refit/export/quantize.py; ExportOptions.quantize): its linear layers' int8 twins; None: fp32
    quantization: Quantization | None = field(default=None, metadata=OMIT_IF_NONE)
    # LoRA-ready engine (refit/export/lora.py; ExportOptions.lora): the layers that take an adapter; None: none do
    lora: Lora | None = field(default=None, metadata=OMIT_IF_NONE)
    extra: Mapping[str, object] = field(default_factory=dict)  # unknown top-level sections, kept verbatim

    # ---------------------------------------------------------------------- file

    @classmethod
    def read(cls, engine_dir: str | Path, check: bool = True) -> "Manifest":
        """The manifest of ``engine_dir``; RefitError (one line) when it is not a usable engine folder.

        ``check=False`` skips :meth:`check` (the layout is still parsed strictly), for a caller that
        lists every problem itself (``python -m refit.rollout.tensorrt.check``).
        """
        engine_dir = Path(engine_dir)
        f = engine_dir / MANIFEST
        if not engine_dir.is_dir():
            raise RefitError(f"engine folder {engine_dir} does not exist")
        if not f.exists():
            raise RefitError(f"{engine_dir} is not a Refit engine folder: no {MANIFEST} (run `refit export` first)")
        m = cls.from_dict(read_json(f, "is corrupt"), where=str(f))
        if check:
            m.check(where=str(f))
        return m

    def write(self, engine_dir: str | Path) -> Path:
        """Check, then write ``engine_dir/manifest.json`` atomically (temp file + ``os.replace``); its path."""
        self.check()
        f = Path(engine_dir) / MANIFEST
        tmp = f.with_name(f".{MANIFEST}.tmp-{os.getpid()}")
        try:
            with open(tmp, "w") as out:
                out.write(json.dumps(self.to_dict(), indent=1))
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, f)
        finally:
            tmp.unlink(missing_ok=True)
        return f

    # ---------------------------------------------------------------------- dict

    @classmethod
    def from_dict(cls, raw: object, where: str = "manifest") -> "Manifest":
        """Parse the JSON layout; a wrong format, missing or unknown key or wrong type is one RefitError line.

        Only the layout is checked here; :meth:`check` checks the content.
        """
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            got = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
            raise RefitError(f"{where} has format {got!r}, this Refit reads {FORMAT!r}")
        known = {f.name for f in fields(cls)} - {"extra"}
        body = {k: v for k, v in raw.items() if k in known}
        extra = {k: v for k, v in raw.items() if k not in known and k != "format"}
        try:
            return build_record(cls, body, "", fixed={"extra": extra})
        except LayoutError as e:
            raise RefitError(f"{where}: {e}") from None

    def to_dict(self) -> dict:
        """The JSON layout: ``format`` first, the fields in order, then the preserved ``extra`` sections."""
        out = {"format": FORMAT, **plain(self)}
        del out["extra"]
        out.update(self.extra)
        return out

    # ---------------------------------------------------------------------- check

    def problems(self) -> list[str]:
        """Everything inconsistent in this manifest, one line each; empty when it is usable."""
        return (_scalar_problems(self) + _capability_problems(self) + _graph_problems(self)
                + _weight_map_problems(self) + _profile_problems(self) + _plan_problems(self) + _lora_problems(self))

    def check(self, where: str = "manifest") -> None:
        """Raise RefitError (one line: the first problem, and how many more) unless :meth:`problems` is empty."""
        found = self.problems()
        if found:
            more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
            raise RefitError(f"{where} is inconsistent: {found[0]}{more}")


# ------------------------------------------------------------------------------- checks

def _scalar_problems(m: Manifest) -> list[str]:
    p = []
    if m.kind not in KINDS:
        p.append(f"kind {m.kind!r} is not one of {', '.join(KINDS)}")
    if m.dtype not in DTYPES:
        p.append(f"dtype {m.dtype!r} is not one of {', '.join(DTYPES)}")
    if m.padding.prompt_side not in SIDES:
        p.append(f"padding.prompt_side {m.padding.prompt_side!r} is not left or right")
    for f in fields(Dims):
        v = getattr(m.dims, f.name)
        if not (v is None and f.name == "max_positions") and v <= 0:
            p.append(f"dims.{f.name} is {v}, must be positive")
    for name in ("pad", "eos"):
        if getattr(m.special_ids, name) < 0:
            p.append(f"special_ids.{name} is negative")
    if m.export_peak_rss_mb is not None and m.export_peak_rss_mb <= 0:
        p.append(f"export_peak_rss_mb is {m.export_peak_rss_mb}, must be positive")
    if m.attention not in (None, "plain", "fused"):
        p.append(f"attention {m.attention!r} is not plain or fused")
    elif m.kind == "decoder" and "decoder" in m.graphs:
        fused_inputs = FUSED_INPUTS & set(m.graphs["decoder"].inputs)
        if (m.attention == "fused") != bool(fused_inputs):  # absent (older folders) reads as plain
            said = repr(m.attention) if m.attention else "absent (read as plain)"
            graph = f"fused ({', '.join(sorted(fused_inputs))} inputs)" if fused_inputs else "plain (no seqlens_k input)"
            p.append(f"attention is {said} but the decoder graph is {graph}")
    if m.kind == "seq2seq" and m.special_ids.decoder_start is None:
        p.append("special_ids.decoder_start is null, a seq2seq engine needs it")
    return p


def _capability_problems(m: Manifest) -> list[str]:
    """The probe's record (absent in folders exported before it) agrees with the geometry the engines use."""
    c = m.capabilities
    if c is None:
        return []
    pairs = [("kind", c.kind, m.kind), ("n_layers", c.n_layers, m.dims.n_layers),
             ("n_kv_heads", c.n_kv_heads, m.dims.n_kv_heads), ("head_dim", c.head_dim, m.dims.head_dim),
             ("padding_side", c.padding_side, m.padding.prompt_side),
             ("decoder_start_id", c.decoder_start_id, m.special_ids.decoder_start)]
    return [f"capabilities.{name} is {a!r}, the manifest says {b!r}" for name, a, b in pairs if a != b]


def _graph_problems(m: Manifest) -> list[str]:
    p = []
    want = GRAPHS_OF_KIND.get(m.kind)
    if want is not None and sorted(m.graphs) != sorted(want):
        p.append(f"a {m.kind} engine has graphs {list(want)}, this one {list(m.graphs)}")
    for g, spec in m.graphs.items():
        if not spec.inputs or not spec.outputs:
            p.append(f"graph {g} lists no inputs or no outputs")
        if m.hashes.graphs_sha256.get(g) != spec.sha256 or m.hashes.engine_weights_sha256.get(g) != spec.weights_sha256:
            p.append(f"hashes of graph {g} differ from graphs.{g}")
    p += [f"hashes name graph {g}, which is not in graphs" for g in
          sorted((set(m.hashes.graphs_sha256) | set(m.hashes.engine_weights_sha256)) - set(m.graphs))]
    return p


def _weight_map_problems(m: Manifest) -> list[str]:
    """1:1: every HF tensor feeds >= 1 engine weight of an existing graph, every engine weight has one owner."""
    p, owners = [], {}
    for hf_name, targets in m.weight_map.items():
        if not targets:
            p.append(f"weight map: {hf_name} feeds no engine weight")
        for t in targets:
            if t.graph not in m.graphs:
                p.append(f"weight map: {hf_name} -> {t.graph}:{t.engine} names no graph of this manifest")
            if t.transform not in TRANSFORMS:
                p.append(f"weight map: {hf_name} -> {t.graph}:{t.engine} has unknown transform {t.transform!r}")
            elif (t.transform == "affine") != (t.scale is not None and t.shift is not None):
                p.append(f"weight map: {hf_name} -> {t.graph}:{t.engine}: scale and shift go with transform affine")
            if t.stored_dtype is not None and t.stored_dtype not in DTYPES:
                p.append(f"weight map: {hf_name} -> {t.graph}:{t.engine} has unknown stored_dtype {t.stored_dtype!r}")
            first = owners.setdefault((t.graph, t.engine), hf_name)
            if first != hf_name:
                p.append(f"weight map: engine weight {t.graph}:{t.engine} is fed by both {first} and {hf_name}")
    for alias, canon in m.tied.items():
        if alias in m.weight_map:
            p.append(f"tied: alias {alias} is also in the weight map")
        if canon not in m.weight_map:
            p.append(f"tied: {alias} -> {canon}, which is not in the weight map")
    return p


def _lora_problems(m: Manifest) -> list[str]:
    """Every adapter target names graphs of this manifest and positive widths."""
    if m.lora is None:
        return []
    p = [] if m.lora.targets else ["lora: no target layers"]
    for name, t in m.lora.targets.items():
        if not t.graphs or any(g not in m.graphs for g in t.graphs):
            p.append(f"lora: target {name} names graphs {list(t.graphs)}, not all in graphs")
        if t.in_features <= 0 or t.out_features <= 0:
            p.append(f"lora: target {name} has widths {t.in_features} x {t.out_features}, must be positive")
    return p


def _profile_problems(m: Manifest) -> list[str]:
    """Every graph has profiles, and each profile gives every input of its graph (and nothing else) a range."""
    p = [f"profiles name graph {g}, which is not in graphs" for g in m.profiles if g not in m.graphs]
    for g, spec in m.graphs.items():
        profs = m.profiles.get(g)
        if not profs:
            p.append(f"graph {g} has no shape profiles")
            continue
        for pname, prof in profs.items():
            where = f"{g}/{pname}"
            p += [f"{where}: input {x} has no min/opt/max" for x in spec.inputs if x not in prof]
            p += [f"{where}: {x!r} is not an input of graph {g}" for x in prof if x not in spec.inputs]
            for x, r in prof.items():
                if not len(r.min) == len(r.opt) == len(r.max):
                    p.append(f"{where}.{x}: min/opt/max ranks {len(r.min)}/{len(r.opt)}/{len(r.max)} differ")
                elif not all(0 <= lo <= o <= hi for lo, o, hi in zip(r.min, r.opt, r.max)):
                    p.append(f"{where}.{x}: needs 0 <= min <= opt <= max, "
                             f"got {list(r.min)}/{list(r.opt)}/{list(r.max)}")
    return p


def _plan_problems(m: Manifest) -> list[str]:
    p = []
    for g, rec in (m.tensorrt or {}).items():
        if g not in m.graphs:
            p.append(f"TensorRT plan for {g}, which is not in graphs")
        elif list(rec.profiles) != list(m.profiles.get(g, {})):
            want = list(m.profiles.get(g, {}))
            p.append(f"{g}: TensorRT profiles {list(rec.profiles)} differ from the manifest's {want}")
    return p
