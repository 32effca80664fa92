"""Weights of an ONNX Runtime engine folder outside its sessions: the held set, and a file push's scratch graphs.

- :func:`read_engine_weights` reads every external initializer of every graph from the ``.onnx.data`` files through
  the graphs' external-data records (the held set of :class:`refit.rollout.ort_backend.OrtEngine`);
  :func:`engine_weight_shapes` gives their shapes from the records alone (an engine that holds no copy);
- :func:`write_pushed_graphs` writes a push, one mapped tensor at a time (shapes checked as they are written), to a
  graph + data file pair per graph in a scratch folder beside the engine folder (:func:`push_scratch`, never
  inside it), which the engine then opens its new sessions from; :func:`remove_graph_pair` deletes a pair.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import torch

from refit.core.errors import RefitError
from refit.core.manifest import Manifest
from refit.export.graph import write_graph

_NP = {1: np.float32, 10: np.float16, 7: np.int64, 6: np.int32, 11: np.float64, 3: np.int8,
       16: np.int16}  # onnx TensorProto -> numpy; bf16 (16) read as its bytes, then viewed as torch.bfloat16


def _external_initializers(engine_dir: Path, manifest: Manifest):
    """(graph, initializer proto, its external-data record) for every external initializer of every graph."""
    import onnx

    for graph, spec in manifest.graphs.items():
        proto = onnx.load(str(engine_dir / spec.file), load_external_data=False)
        for init in proto.graph.initializer:
            if init.data_location != onnx.TensorProto.EXTERNAL:
                continue
            if init.data_type not in _NP:
                raise RefitError(f"{spec.file}: weight {init.name} has ONNX dtype {init.data_type}, "
                                 "which the onnxruntime backend cannot hold")
            yield graph, init, {e.key: e.value for e in init.external_data}


def engine_weight_shapes(engine_dir: Path, manifest: Manifest) -> dict[str, dict[str, tuple[int, ...]]]:
    """{graph: {initializer: shape}} of every external initializer (the graphs' records only; no data read)."""
    out: dict[str, dict[str, tuple[int, ...]]] = {g: {} for g in manifest.graphs}
    for graph, init, _ in _external_initializers(engine_dir, manifest):
        out[graph][init.name] = tuple(init.dims)
    return out


def read_engine_weights(engine_dir: Path, manifest: Manifest) -> dict[str, dict[str, torch.Tensor]]:
    """{graph: {initializer: tensor}} for every external initializer, read from the ``.onnx.data`` files."""
    out: dict[str, dict[str, torch.Tensor]] = {g: {} for g in manifest.graphs}
    for graph, init, ext in _external_initializers(engine_dir, manifest):
        dt = np.dtype(_NP[init.data_type])
        count = int(np.prod(init.dims)) if init.dims else 1
        arr = np.fromfile(engine_dir / ext["location"], dtype=dt, count=count, offset=int(ext.get("offset", 0)))
        if arr.size != count:
            raise RefitError(f"{engine_dir / ext['location']} is truncated (weight {init.name})")
        t = torch.from_numpy(arr.reshape(tuple(init.dims)))
        out[graph][init.name] = t.view(torch.bfloat16) if init.data_type == 16 else t
    return out


def remove_graph_pair(path: Path) -> None:
    """A graph file and its ``.data`` file (push_via="file"'s scratch pairs)."""
    path.unlink(missing_ok=True)
    path.with_name(path.name + ".data").unlink(missing_ok=True)


class _ShapeChecked(Mapping):
    """A graph's lazily mapped weights, each passed to ``check(name, tensor)`` as it is made."""

    def __init__(self, view, check):
        self._view, self._check = view, check

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self._view[name]
        self._check(name, t)
        return t

    def __contains__(self, name) -> bool:
        return name in self._view

    def __iter__(self):
        return iter(self._view)

    def __len__(self) -> int:
        return len(self._view)


def push_scratch(engine_dir: Path) -> Path:
    """A fresh scratch folder beside ``engine_dir`` (never in it) for pushed graph pairs, as an absolute path (the
    sessions open ``engine_dir / file``, which must not prefix it again). ``.NAME.push-XXXX.tmp-PID``: a killed
    run's is removed by the next guard_engine (refit/core/integrity.py)."""
    import tempfile

    return Path(tempfile.mkdtemp(prefix=f".{engine_dir.name}.push-", suffix=f".tmp-{os.getpid()}",
                                 dir=engine_dir.parent)).resolve()


def write_pushed_graphs(sources: dict[str, Path], views: dict[str, Mapping[str, torch.Tensor]], scratch: Path,
                        version: int, check: Callable[[str, str, torch.Tensor], None]) -> dict[str, Path]:
    """{graph: ``<scratch>/<graph>.v<version>.onnx``}: each graph of ``views`` written from its source graph file
    ``sources[graph]`` with the pushed weights, one tensor at a time, ``check(graph, name, tensor)`` on each as it
    is made. On any failure every pair written so far is removed and the error raised."""
    import onnx

    written: dict[str, Path] = {}
    try:
        for g, view in views.items():
            proto = onnx.load(str(sources[g]), load_external_data=False)
            written[g] = scratch / f"{g}.v{version}.onnx"
            write_graph(proto, _ShapeChecked(view, lambda n, t, g=g: check(g, n, t)), written[g])
    except BaseException:
        for path in written.values():
            remove_graph_pair(path)
        raise
    return written
