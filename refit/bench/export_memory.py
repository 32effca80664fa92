"""What real sizes cost to export: ``python -m refit.bench.export_memory --work-dir DIR --old OLD_CHECKOUT``.

Builds full-depth random-weight checkpoints of published geometries (:mod:`refit.learner.builtin.published`,
``n_layers=None``; default SmolLM2-135M and Qwen2.5-0.5B, the local tokenizer) and exports each one, in a fresh
process per export and one export at a time, with the code of each checkout given (``--old``: e.g. a checkout of
main; ``--new``: default this one), side by side: the process's peak RSS (KB, ``wait4``'s ``ru_maxrss``, as
``/usr/bin/time -v`` reports it), wall seconds, the parity figure and whether both wrote the same engine weights
(the manifests' weight maps and engine-weight sha256). ``--push-check``: then push perturbed weights into the new
engine and compare with PyTorch (:func:`refit.bench.real.push_check`), in a further process.
Prints one line per export, then one JSON line (the records).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from refit.bench.real import EXPORT_ARGS, measured
from refit.core.manifest import Manifest
from refit.learner.builtin.published import build_published

MODELS = {"SmolLM2 135M": "smollm2-135m", "Qwen2.5 0.5B": "qwen25-05b"}
# the child runs in the checkout (``python -c`` puts its working folder first on sys.path) and says whose code it ran
_EXPORT = ("import sys, refit.export.onnx_export as e; print('code:', e.__file__, flush=True); "
           "from refit.rollout.build import main; sys.exit(main(sys.argv[1:]))")
_PUSH = ("import json, sys; from refit.bench.real import push_check; from refit.learner.builtin.models import "
         "build_tokenizer; tok = build_tokenizer(); p = [tok(t).input_ids for t in ('12+34=', 'sort 9172 = ', "
         "'Refit trains language models with', '7')]; print(json.dumps(push_check(sys.argv[1], sys.argv[2], p)))")


def build_checkpoint(name: str, root: Path) -> Path:
    """The full-depth random-weight checkpoint of ``name`` under ``root/models`` (built once, then reused)."""
    out = root / "models" / MODELS.get(name, name.lower().replace(" ", "-").replace(".", ""))
    if not (out / "config.json").exists():
        build_published(name, out, n_layers=None)
    return out


def export_once(source: Path, model_dir: Path, engine_dir: Path, rss_cap_gb: float | None = None) -> dict:
    """Export ``model_dir`` into a fresh ``engine_dir`` with the code of checkout ``source``, in its own process."""
    source, model_dir, engine_dir = source.resolve(), model_dir.resolve(), engine_dir.resolve()
    shutil.rmtree(engine_dir, ignore_errors=True)
    cmd = ["env", "-C", str(source), f"PYTHONPATH={source}", sys.executable, "-c", _EXPORT, str(model_dir), "-o",
           str(engine_dir), *EXPORT_ARGS]
    m = measured(cmd, rss_cap_gb)
    code = [ln.split(": ", 1)[1] for ln in m.stdout.splitlines() if ln.startswith("code: ")]
    rec = {"source": str(source), "code": code[0] if code else None, "rc": m.rc, "seconds": m.seconds,
           "peak_rss_kb": m.peak_rss_kb, "capped": m.capped}
    if code and not code[0].startswith(str(source) + "/"):
        raise SystemExit(f"the export meant to run {source} ran {code[0]}")
    stage = [ln for ln in m.stdout.splitlines() if "peak RSS (MB) by the end" in ln]
    if stage:
        rec["stages"] = stage[-1].split(": ", 1)[1]
    if m.rc != 0:
        rec["error"] = m.last_error
        return rec
    man = Manifest.read(engine_dir)
    rec.update(parity_logprob=man.parity.max_abs_logprob_diff, parity_logit=man.parity.max_abs_logit_diff,
               attention=man.attention, manifest_peak_rss_mb=man.export_peak_rss_mb,
               engine_weights_sha256=dict(man.hashes.engine_weights_sha256),
               weight_map_sha256=_map_digest(man))
    return rec


def _map_digest(man) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(man.to_dict()["weight_map"], sort_keys=True).encode()).hexdigest()[:16]


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m refit.bench.export_memory", description=__doc__.split("\n")[0])
    p.add_argument("--work-dir", required=True, help="where the checkpoints and engines go")
    p.add_argument("--old", required=True, help="the other checkout (its repository root) to export with")
    p.add_argument("--new", default=str(Path(__file__).resolve().parents[2]), help="default: this checkout")
    p.add_argument("--models", default=",".join(MODELS), help="comma list of published geometries (full depth)")
    p.add_argument("--rss-cap-gb", type=float, default=None, help="stop an export above this peak RSS")
    p.add_argument("--push-check", action="store_true", help="push perturbed weights into each new engine")
    a = p.parse_args(argv)
    root = Path(a.work_dir)
    records = []
    for name in [n.strip() for n in a.models.split(",") if n.strip()]:
        model_dir = build_checkpoint(name, root)
        row = {"model": name, "model_dir": str(model_dir)}
        for side, source in (("old", Path(a.old)), ("new", Path(a.new))):
            engine_dir = root / "engines" / f"{side}-{model_dir.name}"
            rec = export_once(source, model_dir, engine_dir, a.rss_cap_gb)
            row[side] = rec
            print(f"{name} {side}: rc {rec['rc']}, peak RSS {rec['peak_rss_kb']} KB, {rec['seconds']} s, parity "
                  f"{rec.get('parity_logprob')}" + (f"; stages (MB) {rec['stages']}" if "stages" in rec else ""),
                  flush=True)
        old, new = row["old"], row["new"]
        if old["rc"] == 0 and new["rc"] == 0:
            row["same_engine_weights"] = old["engine_weights_sha256"] == new["engine_weights_sha256"]
            row["same_weight_map"] = old["weight_map_sha256"] == new["weight_map_sha256"]
            row["rss_ratio"] = round(new["peak_rss_kb"] / old["peak_rss_kb"], 3)
        if a.push_check and new["rc"] == 0:
            new_src = Path(a.new).resolve()
            m = measured(["env", "-C", str(new_src), f"PYTHONPATH={new_src}", sys.executable, "-c", _PUSH,
                          str(model_dir.resolve()), str((root / "engines" / f"new-{model_dir.name}").resolve())],
                         a.rss_cap_gb)
            lines = [ln for ln in m.stdout.splitlines() if ln.startswith("{")]
            row["push"] = json.loads(lines[-1]) if lines else f"failed: {m.last_error}"
            print(f"{name} push into the new engine: {row['push']}", flush=True)
        records.append(row)
    print(json.dumps({"bench": "export_memory", "records": records}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
