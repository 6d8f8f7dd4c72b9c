"""The wheel built from this tree: one name per module, integrations mapped in, no symlink, no fixtures."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(REPO)],
        check=True,
        timeout=240,
    )
    (whl,) = out.glob("ncclguard-*.whl")
    return whl


def test_wheel_holds_the_package_and_the_integrations_once(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    # The start-up hook of ncclguard run / NCCLGUARD_AUTO: its .pth at the top of site-packages.
    assert "ncclguard-autostart.pth" in names and "ncclguard_autostart.py" in names
    pth = zipfile.ZipFile(wheel).read("ncclguard-autostart.pth").decode()
    assert pth == (REPO / "autostart" / "ncclguard-autostart.pth").read_text()
    assert "ncclguard/integrations/deepspeed/__init__.py" in names
    assert "ncclguard/integrations/__init__.py" in names
    # Every package of the tree is in the wheel (pyproject.toml lists them one by one).
    packages = [
        str(
            Path("ncclguard", *p.relative_to(REPO / top).parts)
            if top == "ncclguard"
            else Path("ncclguard", top, *p.relative_to(REPO / top).parts)
        )
        for top in ("ncclguard", "integrations")
        for p in sorted((REPO / top).rglob("__init__.py"))
    ]
    assert [p for p in packages if p not in names] == []
    assert "ncclguard/py.typed" in names
    assert "ncclguard/_torch_compat.py" in names
    assert not [n for n in names if n.startswith("integrations/")], (
        "integrations/ must install only as ncclguard.integrations"
    )
    assert not [n for n in names if "reference_trainer" in n or "qwen2_5_vl_synthetic" in n], (
        "test fixtures stay in tests/"
    )
    # Every subpackage of the tree is in the wheel (pyproject.toml lists them by hand).
    subs = sorted(p.parent.name for p in (REPO / "ncclguard").glob("*/__init__.py"))
    assert len(subs) >= 9, subs
    for sub in subs:
        assert f"ncclguard/{sub}/__init__.py" in names


def test_no_symlink_in_the_package() -> None:
    assert not [p for p in (REPO / "ncclguard").rglob("*") if p.is_symlink()]


def test_installed_wheel_imports_the_integrations_under_one_name(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-compile",
            "--target",
            str(target),
            str(wheel),
        ],
        check=True,
        timeout=120,
    )
    # Dependencies come from this environment's site-packages, read as a plain path entry: its
    # .pth files (the editable install's finder among them) are not processed, so ncclguard can
    # only come from the installed wheel.
    deps = ":".join(p for p in sys.path if p.endswith("site-packages"))
    code = (
        "import sys, ncclguard, ncclguard.integrations.deepspeed as d\n"
        "print(ncclguard.__file__); print(d.__file__)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[-1] == 'deepspeed' and 'ncclguard' in m or m.startswith('integrations')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-S", "-c", code],
        env={"PYTHONPATH": f"{target}:{deps}", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    pkg, mod, loaded = out.stdout.strip().splitlines()[-3:]
    assert pkg == str(target / "ncclguard" / "__init__.py")
    assert mod == str(target / "ncclguard" / "integrations" / "deepspeed" / "__init__.py")
    assert loaded == "['ncclguard.integrations.deepspeed']"
