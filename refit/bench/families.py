"""The family table (docs/families.md), from real runs: ``python -m refit.bench.families [--only NAME] [--readme F]``.

For each family of :data:`refit.bench.export_families.FAMILIES` (GPT-2 ... Marian): build its tiny checkpoint
(random weights, the local tokenizer), export it through the parity gate, run the CPU-side
TensorRT checks (``refit.rollout.tensorrt.check``), then two PPO steps (top-k 20, top-p 0.9, exact-KL
penalty, a weight push and probe each step) and two distillation steps with the model as its own
teacher (one on-policy and one dataset batch, the teacher engine's top-k). KL(0) is the KL of the
first batch, taken before any update: 0 when engine and learner agree. Prints the markdown table
(and, with ``--readme docs/families.md``, replaces the table between that page's ``families`` markers); the
last stdout line is one JSON document with every record, as the benchmarks do.

``--set real`` runs the published geometries of :mod:`refit.learner.builtin.published` instead (real widths, head dims,
vocabularies; 2 layers), one process each (:mod:`refit.bench.real`), and adds a weight-push check and the
export's seconds and peak RSS; its table goes between docs/families.md's ``real-geometry`` markers.
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import time
from pathlib import Path

from refit.bench.export_families import FAMILIES, export_family
from refit.bench.real import run_real
from refit.bench.smokes import _quiet, _run, distill_smoke, ppo_smoke
from refit.learner.builtin.models import build_tokenizer
from refit.learner.builtin.published import PUBLISHED

MARK_START, MARK_END = "<!-- families:start -->", "<!-- families:end -->"
REAL_MARKS = ("<!-- real-geometry:start -->", "<!-- real-geometry:end -->")
def family_record(name: str, geometry: str, root: Path, tokenizer, log=print) -> dict:
    t0 = time.perf_counter()
    rec = {"family": name, **export_family(geometry, root, tokenizer, log=_quiet)}
    if rec["export"] == "ok":
        rec["ppo"] = _run(ppo_smoke, rec, root / "runs" / geometry)
        rec["distill"] = _run(distill_smoke, rec, root / "runs" / geometry)
    rec["seconds"] = round(time.perf_counter() - t0, 1)
    log(f"{name}: export {rec['export']}, {rec['seconds']} s")
    return rec


def _features(c: dict) -> str:
    """What the probe found, in a few words (refit.export.capabilities)."""
    pos = c["positions"] + (f" from {c['position_offset']}" if c["position_offset"] else "")
    if c["rotary_fraction"] not in (None, 1.0):
        pos = f"{c['rotary_fraction']:g} rotary"
    out = [pos]
    if c["n_kv_heads"] < c["n_heads"]:
        out.append(f"GQA {c['n_heads']}/{c['n_kv_heads']}")
    if c["sliding_window"]:
        out.append(f"window {c['sliding_window']}")
    if c["embed_scale"] != 1.0:
        out.append(f"embed x{c['embed_scale']:.2f}")
    out.append("tied head" if c["tied_head"] else "untied head")
    if c["final_logits_bias"]:
        out.append("final_logits_bias")
    if c["decoder_start_id"] is not None:
        out.append(f"{c['padding_side']}-padded encoder, start id {c['decoder_start_id']}")
    return ", ".join(out)


def _cell(res, fmt) -> str:
    return res if isinstance(res, str) else fmt(res)


def _ppo_cell(r: dict) -> str:
    ok = r["min_exact_kl"] >= 0 and abs(r["kl0"]) <= 1e-6
    return f"{'ok' if ok else 'FAIL'}: KL(0) {r['kl0']:.1e}, step-2 exact KL {r['last_exact_kl']:.1e} (>= 0)"


def _distill_cell(r: dict) -> str:
    ok = abs(r["kl0"]) <= 1e-6 and abs(r["step1_loss"]) <= 1e-6
    return f"{'ok' if ok else 'FAIL'}: KL(0) {r['kl0']:.1e}, step-1 loss {r['step1_loss']:.1e}"


def markdown(records: list[dict]) -> str:
    lines = ["| family | what the probe found | export | parity max abs dlogprob | TensorRT CPU checks "
             "| PPO (2 steps, top-k 20, top-p 0.9) | distill (2 steps, self-teacher) |",
             "|---|---|---|---|---|---|---|"]
    for r in records:
        if r["export"] != "ok":
            lines.append(f"| {r['family']} | | {r['export']} | | | | |")
            continue
        lines.append(f"| {r['family']} | {_features(r['capabilities'])} | ok, {r['attention']} attention "
                     f"| {r['parity']:.1e} | {r['trt_check']} "
                     f"| {_cell(r['ppo'], _ppo_cell)} | {_cell(r['distill'], _distill_cell)} |")
    return "\n".join(lines)


def _push_cell(r: dict) -> str:
    ok = r["changed_by"] > 1e-2 and r["vs_torch"] <= 1e-4 and r["restored"] <= 1e-5
    at = f" x N(0, {r['scale']:g})" if "scale" in r else ""
    return (f"{'ok' if ok else 'FAIL'}: {r['pushed']} tensors{at}, moved {r['changed_by']:.2g}, "
            f"vs PyTorch {r['vs_torch']:.1e}")


def _stages_cell(r: dict) -> str:
    """Each stage's seconds, peak RSS and peak anonymous memory (its own process: refit.bench.real)."""
    def one(k: str) -> str:
        if f"{k}_rss_gb" not in r:
            return "-"
        anon = f" (anon {r[f'{k}_anon_gb']})" if f"{k}_anon_gb" in r else ""
        return f"{r[f'{k}_s']} s, {r[f'{k}_rss_gb']} GB{anon}"

    return "; ".join(one(k) for k in ("push", "ppo", "distill"))


def markdown_real(records: list[dict]) -> str:
    """The real-geometry table (refit.bench.real records)."""
    lines = ["| model (2 layers) | what it exercises | params | export | parity max abs dlogprob "
             "| weight push (perturbed, vs PyTorch) | PPO (2 steps, top-k 20, top-p 0.9) "
             "| distill (2 steps, self-teacher) | export s, peak RSS | push; PPO; distill: s, peak RSS (anon GB) "
             "| whole row s, peak RSS |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        where = f"{r.get('seconds', '')} s, {r.get('peak_rss_gb', '')} GB"
        if r["export"] != "ok":
            spent = f"{r['export_s']} s, {r['export_rss_gb']} GB" if "export_s" in r else ""
            lines.append(f"| {r['family']} | {PUBLISHED[r['family']].features} | {r.get('params_m', '')}M "
                         f"| {r['export']} | | | | | {spent} | | {where} |")
            continue
        push, ppo, distill = (r.get(k, "not reached") for k in ("push", "ppo", "distill"))
        cut = f" (vocabulary cut to {r['vocab_cut']})" if r.get("vocab_cut") else ""
        cut += " (push_via file)" if r.get("push_via") == "file" else ""
        lines.append(f"| {r['family']}{cut} | {PUBLISHED[r['family']].features} | {r['params_m']}M "
                     f"| ok, {r['attention']} attention | {r['parity']:.1e} "
                     f"| {_cell(push, _push_cell)} | {_cell(ppo, _ppo_cell)} | {_cell(distill, _distill_cell)} "
                     f"| {r['export_s']} s, {r['export_rss_gb']} GB | {_stages_cell(r)} | {where} |")
    return "\n".join(lines)


def update_readme(readme: Path, table: str, marks: tuple[str, str] = (MARK_START, MARK_END)) -> None:
    start, end = marks
    text = readme.read_text()
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise SystemExit(f"{readme} has no {start} ... {end} markers")
    readme.write_text(pattern.sub(lambda _: f"{start}\n{table}\n{end}", text))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m refit.bench.families", description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="*", default=None, help=f"families to run (default all: {', '.join(FAMILIES)})")
    p.add_argument("--work-dir", default="", help="where checkpoints, engines and runs go (default: a temp folder)")
    p.add_argument("--readme", default="", help="replace the table between the family markers of this file")
    p.add_argument("--set", choices=("tiny", "real"), default="tiny",
                   help="tiny: one 2-layer, 32-64-wide checkpoint per family; real: the published geometries of "
                        "refit.learner.builtin.published (real widths and vocabularies, 2 layers), one process each")
    p.add_argument("--push-via", choices=("memory", "file"), default="memory",
                   help="--set real: the jobs' weight-push route (rollout.push_via; file: what a 7B-wide row needs)")
    p.add_argument("--vocab", type=int, default=None,
                   help="--set real: cut each geometry's vocabulary to this many rows (the row says so)")
    p.add_argument("--rss-cap-gb", type=float, default=16.0, help="--set real: stop a geometry whose anonymous memory passes this (file pages, which the kernel can reclaim, left out)")
    a = p.parse_args(argv)
    if a.set == "real":
        return _main_real(p, a)
    chosen = {n: g for n, g in FAMILIES.items() if a.only is None or n in a.only or g in a.only}
    if not chosen:
        p.error(f"no family matches {a.only}; known: {', '.join(FAMILIES)}")
    tok = build_tokenizer()
    with tempfile.TemporaryDirectory(prefix="refit-families-") as tmp:
        root = Path(a.work_dir) if a.work_dir else Path(tmp)
        records = [family_record(n, g, root, tok) for n, g in chosen.items()]
    table = markdown(records)
    print(table)
    if a.readme:
        update_readme(Path(a.readme), table)
    print(json.dumps([{k: v for k, v in r.items() if k not in ("model_dir", "engine_dir")} for r in records]))
    return 0


def _main_real(p, a) -> int:
    names = [n for n in PUBLISHED if a.only is None or n in a.only]
    if not names:
        p.error(f"no published geometry matches {a.only}; known: {', '.join(PUBLISHED)}")
    with tempfile.TemporaryDirectory(prefix="refit-real-") as tmp:
        root = Path(a.work_dir) if a.work_dir else Path(tmp)
        records = run_real(names, root, a.rss_cap_gb, vocab=a.vocab, push_via=a.push_via)
    table = markdown_real(records)
    print(table)
    if a.readme:
        update_readme(Path(a.readme), table, REAL_MARKS)
    print(json.dumps([{k: v for k, v in r.items() if k not in ("model_dir", "engine_dir")} for r in records]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
