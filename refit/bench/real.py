"""The family table at real geometry: ``python -m refit.bench.families --set real``.

Each geometry of :data:`refit.learner.builtin.published.PUBLISHED` (published widths, head dims, vocabulary, rope
settings; depth cut to 2 layers) runs in its own process (:func:`measured`, peak RSS from ``wait4`` and
a cap that stops it before it takes the machine): build the random-weight checkpoint, export it in a
further process (its seconds and peak RSS are the export's own), read the parity figure and the graph
the export chose, then each stage in a process of its own, so that its peak RSS is its own (not what
an earlier stage left in the allocator): push perturbed weights into the engine and compare with PyTorch
holding the same weights (:func:`push_check`), then the two-step PPO and distillation smokes of
:mod:`refit.bench.families`. The child prints its record as one JSON line; the parent adds the process's
peak RSS and seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from refit.bench.smokes import _run, distill_smoke, ppo_smoke
from refit.core.manifest import Manifest
from refit.export.weight_map import canonical_params
from refit.learner.builtin.models import build_tokenizer
from refit.learner.builtin.published import PUBLISHED, build_published, n_params
from refit.rollout.ort_backend import OrtEngine
from refit.rollout.torch_backend import TorchEngine
from refit.rollout.types import SamplingParams

EXPORT_ARGS = ["--max-batch", "16", "--max-len", "128"]  # as refit.bench.export_families.export_family


@dataclass(frozen=True)
class Measured:
    """One child process: exit status, wall seconds, peak RSS (GB, the child and the children it waited for),
    whether the RSS cap (or the time limit) stopped it, its stdout and the last line of its stderr."""

    rc: int
    seconds: float
    peak_rss_gb: float
    capped: bool
    stdout: str
    last_error: str
    peak_rss_kb: int = 0  # the same peak, as wait4 gives it (KB, what /usr/bin/time -v reports)
    peak_anon_gb: float = 0.0  # the largest anonymous + shared-memory resident size seen by the 0.2 s poll


def _tree_rss_kb(pgid: int) -> int:
    """Anonymous (and shared-memory) resident KB of every process in process group ``pgid`` (the child and what it
    started): the memory the machine cannot take back. File pages (a checkpoint's safetensors mapped by PyTorch,
    an engine's ``.onnx.data`` mapped by ONNX Runtime) count in RSS too, but the kernel drops them under pressure
    and reads them again, so the cap, which is there to keep the box alive, leaves them out."""
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read().rsplit(")", 1)[1].split()
            if int(stat[2]) != pgid:  # field 5, pgrp (after the ")" of comm: state, ppid, pgrp)
                continue
            with open(f"/proc/{pid}/status") as f:
                kb = {k: int(v.split()[0]) for k, v in (ln.split(":", 1) for ln in f) if k in ("RssAnon", "RssShmem")}
            total += sum(kb.values())
        except (OSError, IndexError, ValueError):
            continue  # the process ended while being read
    return total


def measured(cmd: list[str], rss_cap_gb: float | None = None, timeout_s: float | None = None) -> Measured:
    """Run ``cmd`` in its own process group; peak RSS from ``wait4`` (Linux: the largest of the child and its
    reaped descendants, file pages included). The group's anonymous memory is polled every 0.2 s (its peak:
    ``peak_anon_gb``); with ``rss_cap_gb`` the group is killed when that passes the cap (:func:`_tree_rss_kb`)."""
    import signal

    t0 = time.perf_counter()
    out_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"refit-measured-{os.getpid()}-{time.time_ns()}.out"
    err_path = out_path.with_suffix(".err")
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, start_new_session=True)
        capped, anon_kb = False, 0
        while True:  # wait4, not Popen.poll: the rusage of this child alone (and what it reaped)
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            over_time = timeout_s is not None and time.perf_counter() - t0 > timeout_s
            now_kb = _tree_rss_kb(proc.pid)
            anon_kb = max(anon_kb, now_kb)
            if over_time or (rss_cap_gb is not None and now_kb > rss_cap_gb * 2 ** 20):
                capped = True
                os.killpg(proc.pid, signal.SIGKILL)
                _, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.2)
    proc.returncode = rc = os.waitstatus_to_exitcode(status)  # reaped here; Popen must not wait again
    maxrss_kb = usage.ru_maxrss
    stdout, errs = out_path.read_text(), [ln for ln in err_path.read_text().splitlines() if ln.strip()]
    out_path.unlink()
    err_path.unlink()
    return Measured(rc, round(time.perf_counter() - t0, 1), round(maxrss_kb / 2 ** 20, 2), capped, stdout,
                    errs[-1][:200] if errs else "", int(maxrss_kb), round(anon_kb / 2 ** 20, 2))


def push_check(model_dir: str, engine_dir: str, prompts: list[list[int]], scales: tuple[float, ...] = (0.05, 1.0),
               moved_at_least: float = 1e-2) -> dict:
    """Perturb the input embedding and every weight of the first layer(s) (``.0.``: attention, MLP, norms;
    encoder and decoder), push into the ONNX Runtime engine and into the PyTorch reference, and compare:
    how far the push moved the engine's log-probs of a fixed sampled batch, how far the engine then is from
    PyTorch, and how far the restored weights are from the original output.

    The perturbation is N(0, 1) times the first of ``scales`` that moves the log-probs by ``moved_at_least``: a
    random model can put nearly all mass on one token (Gemma 2's soft-capped head at vocabulary 512: 0.05 moved
    the sampled tokens' log-probs by 3e-5), where a small push would check nothing. The scale used is recorded."""
    import torch

    ort, ref = OrtEngine(engine_dir), TorchEngine(model_dir)
    try:
        params, _ = canonical_params(ref.model)
        emb = ref.model.get_input_embeddings().weight
        names = [n for n, t in params.items() if ".0." in n or t is emb]
        batch = ref.generate(prompts, SamplingParams(max_new_tokens=8, seed=0))

        def score(eng):
            return eng.score(batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask).logprobs

        before = score(ort)
        for scale in scales:
            g = torch.Generator().manual_seed(0)
            new = {n: params[n].detach() + scale * torch.randn(params[n].shape, generator=g) for n in names}
            ort.update_weights(new)
            after = score(ort)
            ort.update_weights({n: params[n].detach() for n in names})  # PyTorch still holds the originals: no clone
            if float((after - before).abs().max()) >= moved_at_least:
                break
        restored = score(ort)
        ort.update_weights(new)
        ref.update_weights(new)
        after, want = score(ort), score(ref)
        return {"pushed": len(names), "scale": scale, "changed_by": float((after - before).abs().max()),
                "vs_torch": float((after - want).abs().max()), "restored": float((restored - before).abs().max())}
    finally:
        ort.close()
        ref.close()


def _export_child(model_dir: Path, engine_dir: Path, rss_cap_gb: float | None) -> dict:
    cmd = [sys.executable, "-c", "import sys; from refit.rollout.build import main; sys.exit(main(sys.argv[1:]))",
           str(model_dir), "-o", str(engine_dir), *EXPORT_ARGS]
    m = measured(cmd, rss_cap_gb)
    if m.capped:
        return {"export": f"stopped at the {rss_cap_gb:g} GB RSS cap", "export_s": m.seconds,
                "export_rss_gb": m.peak_rss_gb}
    if m.rc < 0:  # no Python error to report: a signal (9 with no cap of ours: the kernel's OOM killer)
        return {"export": f"killed by signal {-m.rc} at {m.peak_rss_gb} GB RSS", "export_s": m.seconds,
                "export_rss_gb": m.peak_rss_gb}
    if m.rc != 0:
        return {"export": f"failed: {m.last_error}", "export_s": m.seconds, "export_rss_gb": m.peak_rss_gb}
    return {"export": "ok", "export_s": m.seconds, "export_rss_gb": m.peak_rss_gb}


def _emit(rec: dict, stage: str) -> None:
    """Print the record so far as one JSON line (the parent keeps the last one, also when it stops this process
    at its RSS cap): the stage about to run and this process's peak RSS (GB) until now."""
    import resource

    rec.update(stage=stage, rss_so_far_gb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20, 2))
    print(json.dumps(rec), flush=True)


STAGES = ("push", "ppo", "distill")
PROMPTS = ["12+34=", "sort 9172 = ", "Refit trains language models with", "7"]


def _slug(name: str) -> str:
    return name.lower().replace(" ", "-").replace(".", "")


def run_stage(stage: str, name: str, root: Path, push_via: str = "memory") -> dict | str:
    """One stage of a geometry's row, on the checkpoint and engine :func:`geometry_record` made under ``root``."""
    rec = {"model_dir": str(root / "models" / _slug(name)), "engine_dir": str(root / "engines" / _slug(name))}
    # no re-export of the final model (the export is measured once, before); the jobs' weight-push route
    quick = dict(export_final=False, push_via=push_via)
    if stage == "push":
        tok = build_tokenizer()
        fn = lambda r, _: push_check(r["model_dir"], r["engine_dir"], [tok(t).input_ids for t in PROMPTS])  # noqa: E731
    else:
        fn = lambda r, d: (ppo_smoke if stage == "ppo" else distill_smoke)(r, d, **quick)  # noqa: E731
    return _run(fn, rec, root / "runs" / _slug(name))


def _stage_child(stage: str, name: str, root: Path, rss_cap_gb: float | None,
                 push_via: str = "memory") -> tuple[dict | str, Measured]:
    cmd = [sys.executable, "-m", "refit.bench.real", name, "--work-dir", str(root), "--stage", stage,
           "--push-via", push_via]
    m = measured(cmd, rss_cap_gb)
    lines = [ln for ln in m.stdout.splitlines() if ln.startswith("{")]
    if m.capped:
        return f"stopped at the {rss_cap_gb:g} GB RSS cap", m
    if m.rc < 0:
        return f"killed by signal {-m.rc} at {m.peak_rss_gb} GB RSS", m
    if m.rc != 0 or not lines:
        return f"failed: {m.last_error}", m
    return json.loads(lines[-1])["result"], m


def geometry_record(name: str, root: Path, rss_cap_gb: float | None = None, vocab: int | None = None,
                    push_via: str = "memory") -> dict:
    """Everything the table reports for one published geometry (2 layers): the checkpoint built here, the export
    and each stage in a child process. ``root`` holds the checkpoint, the engine and the runs. Prints the record
    after each stage. ``vocab``: the vocabulary cut to that many rows (recorded), for a geometry whose published
    vocabulary does not fit the machine; every other field as published."""
    from dataclasses import asdict

    slug = _slug(name)
    tok = build_tokenizer()
    t0 = time.perf_counter()
    model_dir = build_published(name, root / "models" / slug, tokenizer=tok, vocab_size=vocab)
    params = sum(p.numel() for p in _meta_model(model_dir).parameters()) if vocab else n_params(name)
    rec = {"family": name, "source": PUBLISHED[name].source, "params_m": round(params / 1e6, 1), "vocab_cut": vocab,
           "push_via": push_via,
           "build_s": round(time.perf_counter() - t0, 1), "model_dir": str(model_dir),
           "engine_dir": str(root / "engines" / slug)}
    _emit(rec, "export")
    rec.update(_export_child(model_dir, Path(rec["engine_dir"]), rss_cap_gb))
    if rec["export"] != "ok":
        _emit(rec, "done")
        return rec
    m = Manifest.read(rec["engine_dir"])
    rec.update(parity=m.parity.max_abs_logprob_diff, attention=m.attention or "plain",
               capabilities=asdict(m.capabilities))
    for stage in STAGES:
        _emit(rec, stage)
        rec[stage], m = _stage_child(stage, name, root, rss_cap_gb, push_via)
        rec[f"{stage}_s"], rec[f"{stage}_rss_gb"], rec[f"{stage}_anon_gb"] = m.seconds, m.peak_rss_gb, m.peak_anon_gb
    _emit(rec, "done")
    return rec


def _meta_model(model_dir: Path):
    """The checkpoint's model on the meta device (its parameter count, no memory); tied weights counted once."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    cfg = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        return (AutoModelForSeq2SeqLM if cfg.is_encoder_decoder else AutoModelForCausalLM).from_config(cfg)


def run_real(names: list[str], root: Path, rss_cap_gb: float | None, log=print, vocab: int | None = None,
             push_via: str = "memory") -> list[dict]:
    """One child process per geometry (:func:`geometry_record`), its peak RSS and seconds added."""
    records = []
    for name in names:
        cmd = [sys.executable, "-m", "refit.bench.real", name, "--work-dir", str(root)]
        if rss_cap_gb is not None:
            cmd += ["--rss-cap-gb", str(rss_cap_gb)]
        if vocab is not None:
            cmd += ["--vocab", str(vocab)]
        cmd += ["--push-via", push_via]
        m = measured(cmd, rss_cap_gb)
        lines = [ln for ln in m.stdout.splitlines() if ln.startswith("{")]
        rec = json.loads(lines[-1]) if lines else {"family": name, "stage": "build", "export": "not reached"}
        if rec["stage"] != "done":  # stopped (cap) or crashed in that stage; its cell says so
            why = f"stopped at the {rss_cap_gb:g} GB RSS cap" if m.capped else f"failed: {m.last_error}"
            rec[rec["stage"]] = f"{why} (this stage)"
        rec.update(seconds=m.seconds, peak_rss_gb=m.peak_rss_gb)
        log(f"{name}: export {rec['export']}, {m.seconds} s, peak RSS {m.peak_rss_gb} GB")
        records.append(rec)
    return records


def main(argv: list[str] | None = None) -> int:
    """The child: ``python -m refit.bench.real NAME --work-dir DIR``; prints the record as one JSON line."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m refit.bench.real", description=geometry_record.__doc__.split("\n")[0])
    p.add_argument("name", help="a geometry of refit.learner.builtin.published.PUBLISHED")
    p.add_argument("--work-dir", required=True, help="where the checkpoint, engine and runs go")
    p.add_argument("--rss-cap-gb", type=float, default=None, help="stop the export or a stage whose anonymous memory passes this (GB)")
    p.add_argument("--vocab", type=int, default=None, help="cut the vocabulary to this many rows (recorded)")
    p.add_argument("--push-via", choices=("memory", "file"), default="memory",
                   help="the PPO and distillation jobs' weight-push route (rollout.push_via)")
    p.add_argument("--stage", choices=STAGES, default=None,
                   help="run only this stage on the checkpoint and engine already under --work-dir (one JSON line)")
    a = p.parse_args(argv)
    if a.stage:
        result = run_stage(a.stage, a.name, Path(a.work_dir), a.push_via)
        print(json.dumps({"stage": a.stage, "result": result}), flush=True)
        return 0
    geometry_record(a.name, Path(a.work_dir), a.rss_cap_gb, a.vocab, a.push_via)  # prints its record after each stage
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
