"""The install: one top-level name (``refit``), importable from a folder whose own ``export.py`` would shadow
a top-level ``export`` package, with the public names the README promises."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                        str(ROOT)], capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and "No module named" in r.stderr:
        pytest.skip(f"cannot build a wheel here: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stderr
    (whl,) = out.glob("refit_rl-*.whl")
    return whl


def test_wheel_installs_only_refit(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"refit"}, top
    top_level = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
    assert zipfile.ZipFile(wheel).read(top_level).decode().split() == ["refit"]
    for room in ("core", "export", "rollout", "learner", "learner/ppo", "learner/losses", "bench"):
        assert f"refit/{room}/__init__.py" in names, room


def test_import_from_a_folder_with_its_own_export_py(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    work = tmp_path / "work"
    work.mkdir()
    (work / "export.py").write_text("raise SystemExit('the user export.py was imported')\n")
    (work / "learner").mkdir()  # a user's own package named like a room
    (work / "learner" / "__init__.py").write_text("raise SystemExit('the user learner/ was imported')\n")
    # -S: no site-packages (no editable install of this checkout): only the extracted wheel and the cwd
    code = ("import sys; sys.path[:0] = ['', %r]; import refit; print(refit.__file__); print(refit.__all__); "
            "import refit.core.errors, refit.core.manifest; print(refit.RefitError.__module__)" % str(site))
    r = subprocess.run([sys.executable, "-S", "-c", code], cwd=work, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith(str(site)) and "build_engine" in lines[1] and lines[2] == "refit.core.errors"


def test_public_face_is_lazy_and_complete():
    code = ("import sys, refit; assert 'torch' not in sys.modules, 'import refit loaded torch'; "
            "missing = [n for n in refit.__all__ if getattr(refit, n, None) is None]; assert not missing, missing; "
            "print(len(refit.__all__))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout.strip()) >= 12


def test_gpu_extras_install_one_onnxruntime_and_a_capped_tensorrt_per_cuda_major():
    """onnxruntime-gpu beside the base onnxruntime leaves CUDA out of the providers (both are the module
    `onnxruntime`), so no extra adds it; TensorRT is named per CUDA major (the `tensorrt` metapackage picks one of its
    own) and capped below the major read against; nothing required is imported nowhere (cuda-python)."""
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = {Requirement(r).name for r in project["dependencies"]}
    extras = project["optional-dependencies"]
    assert {"gpu", "gpu-cu12"} <= set(extras)
    for name in ("gpu", "gpu-cu12"):
        reqs = [Requirement(r) for r in extras[name]]
        names = base | {r.name for r in reqs}
        assert not {"onnxruntime", "onnxruntime-gpu"} <= names, (name, names)
        assert "cuda-python" not in names and "tensorrt" not in names, names
        trt = [r for r in reqs if r.name.startswith("tensorrt-cu")]
        assert len(trt) == 1, reqs
        assert any(s.operator == "<" for s in trt[0].specifier), f"{trt[0]} has no upper bound"
        assert not trt[0].specifier.contains("11.0.0.114") and trt[0].specifier.contains("10.16.1.11"), trt[0]
    assert [r.split(">")[0] for r in extras["gpu"]] == ["tensorrt-cu13"]
