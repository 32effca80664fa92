"""CPU-side checks that an engine folder will build as a refittable TensorRT engine: the driver.

These run in CI without TensorRT or a GPU, on the ONNX graphs and ``manifest.json`` alone, and
catch what would otherwise only fail on an NVIDIA machine (or, worse, silently leave weights
stale after a refit). :func:`check_engine_folder` runs, on each graph of a consistent manifest:

- :func:`refit.rollout.tensorrt.check_graph.check_ops`: every op (subgraphs and local functions
  included) is one TensorRT's ONNX parser supports at the graph's opset;
- :func:`refit.rollout.tensorrt.check_graph.check_profiles`: every dynamic input dimension is named,
  declared in the manifest's ``dynamic_dims``, and covered by every shape profile of the graph;
- :func:`refit.rollout.tensorrt.check_weights.check_weight_map`: every external (refittable)
  initializer is fed by exactly one weight-map entry, and every entry names an initializer of the
  right shape and dtype (a quantized folder's int8 twins and scales included);
- :func:`refit.rollout.tensorrt.check_weights.check_qdq`: the Q/DQ structure of a quantized graph;
- :func:`refit.rollout.tensorrt.check_weights.check_foldable`: no mapped weight (Q/DQ twins aside)
  is read by a constant-only op TensorRT may fold;

then, where TensorRT plans were built, that they are present and every mapped weight refittable.

``python -m refit.rollout.tensorrt.check ENGINE_DIR`` runs them all and exits 1 on any problem.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from refit.core.errors import RefitError
from refit.core.manifest import Manifest
from refit.rollout.tensorrt.check_graph import TRT_OPS_SOURCE, check_ops, check_profiles
from refit.rollout.tensorrt.check_weights import check_foldable, check_qdq, check_weight_map, checkpoint_shapes


def check_engine_folder(engine_dir: str | Path) -> list[str]:
    """Every problem found in ``engine_dir`` by the checks above; an empty list means ready to build.

    The manifest's own consistency (:meth:`refit.core.manifest.Manifest.problems`: graphs, weight map
    into existing graphs, profiles covering every input, plans matching the profiles) comes first;
    the graph-level checks run only on a consistent manifest.
    """
    engine_dir = Path(engine_dir)
    try:
        manifest = Manifest.read(engine_dir, check=False)
    except RefitError as e:
        return [str(e)]
    problems = [f"manifest: {p}" for p in manifest.problems()]
    if problems:
        return problems
    hf_shapes = checkpoint_shapes(manifest)
    for graph, spec in manifest.graphs.items():
        path = engine_dir / spec.file
        if not path.exists():
            problems.append(f"{graph}: graph file {spec.file} is missing")
            continue
        if spec.data and not (engine_dir / spec.data).exists():
            problems.append(f"{graph}: weight file {spec.data} is missing")
        try:
            unsupported = check_ops(path, manifest.opset)
            problems += [f"{graph}: not supported by TensorRT's ONNX parser ({TRT_OPS_SOURCE}): {op}"
                         for op in unsupported]
            problems += check_profiles(manifest, path, graph)
            problems += check_weight_map(manifest, path, graph, hf_shapes)
            problems += check_qdq(manifest, path, graph)
            problems += check_foldable(manifest, path, graph)
        except RefitError as e:
            problems.append(f"{graph}: {e}")
    return problems + _check_plans(engine_dir, manifest)


def _check_plans(engine_dir: Path, manifest: Manifest) -> list[str]:
    """If TensorRT engines were built: plan files present, every mapped weight refittable."""
    problems = []
    for graph, rec in (manifest.tensorrt or {}).items():
        if not (engine_dir / rec.plan).is_file():
            problems.append(f"{graph}: TensorRT plan {rec.plan} is missing")
        if rec.not_refittable:
            problems.append(f"{graph}: {len(rec.not_refittable)} mapped weights are not refittable in the "
                            f"TensorRT engine, e.g. {list(rec.not_refittable[:3])}")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m refit.rollout.tensorrt.check",
                                description="Check, without TensorRT, that an engine folder will build as a refittable "
                                            "TensorRT engine: supported ops, named and covered shape profiles, 1:1 weight map.")
    p.add_argument("engine_dir", help="engine folder written by `refit export`")
    a = p.parse_args(argv)
    problems = check_engine_folder(a.engine_dir)
    if problems:
        print("\n".join(f"  - {line}" for line in problems))
        print(f"trt_check: {a.engine_dir}: {len(problems)} problem(s)")
        return 1
    m = Manifest.read(a.engine_dir)
    q, n_w = m.quantization, sum(len(v) for v in m.weight_map.values())
    quant = f", {sum(len(v) for v in q.weights.values())} int8 weights through DequantizeLinear ({q.scheme})" if q else ""
    print(f"trt_check: {a.engine_dir}: ok ({len(m.graphs)} graph(s), {sum(len(v) for v in m.profiles.values())} "
          f"profile(s), {n_w} mapped weights{quant}, ops per {TRT_OPS_SOURCE})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
