"""The connector installed as vLLM users install connectors, found by vLLM's own plugin loader.

The wheel is built from ``connectors/vllm`` (pyproject.toml, setuptools, no
package index), installed into a virtual environment over this interpreter
(Debian's ``/usr/bin/python3``: ``--system-site-packages``, so torch, numpy
and confluent-kafka come from Debian) with ``--no-index --no-deps``, and then,
in the venv's python:

- without vLLM: importing the entry point's module imports nothing heavy,
  the wheel states its dependencies (and not vLLM's or torch's), and the
  plugin does not raise where vLLM is missing;
- with vLLM's source tree (``VLLM_SRC``, from ``../shared/vllm/setup.sh``):
  ``vllm.plugins.load_general_plugins()`` finds the ``vllm.general_plugins``
  entry point ``kvmesh`` and ``KVConnectorFactory.get_connector_class`` then
  resolves ``{"kv_connector": "KVMeshConnector"}`` (no
  ``kv_connector_module_path``), alone and as a MultiConnector child, to
  ``kvmesh_vllm.connector.KVMeshConnector`` from the venv's site-packages,
  never from the checkout; loading the plugins again does not raise.

Without ``VLLM_SRC`` the vLLM part skips with one line, or fails under
``KVMESH_REQUIRE_VLLM=1``. Run, from the repository root::

    eval "$(../shared/vllm/setup.sh vllm-2026-08-22-7f4a1b7 2>/dev/null)"
    PYTHONDONTWRITEBYTECODE=1 /usr/bin/python3 -m pytest -q -p no:cacheprovider \\
        connectors/vllm/tests/vllm/test_plugin.py
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# connectors/vllm: the package's source, which the venv's python must not see.
PACKAGE_ROOT = Path(__file__).resolve().parents[2]
# The Debian packages the build needs (pip wheel with setuptools' backend).
BUILD_PACKAGES = {"pip": "python3-pip", "setuptools": "python3-setuptools", "wheel": "python3-wheel"}
ENTRY_POINT = ("kvmesh", "kvmesh_vllm.plugin:register")
TIMEOUT_S = 120


def _run(cmd: list, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, **kw)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def _facts(proc: subprocess.CompletedProcess) -> dict:
    """The JSON object a check script prints as its last line."""
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        pytest.fail(f"no JSON from the check script:\n{proc.stdout}\n{proc.stderr}")


def _under(path: str, root: Path) -> bool:
    return Path(path).resolve().is_relative_to(root.resolve())


def _vllm_src() -> Path:
    """vLLM's source tree (VLLM_SRC); skip without it, or fail under KVMESH_REQUIRE_VLLM=1."""
    src = os.environ.get("VLLM_SRC", "")
    if not src or not Path(src, "vllm", "plugins", "__init__.py").is_file():
        why = "VLLM_SRC is not set" if not src else f"VLLM_SRC={src} holds no vllm/plugins"
        msg = f'{why}: eval "$(../shared/vllm/setup.sh TREE)" to run vLLM\'s plugin loader over the wheel'
        if os.environ.get("KVMESH_REQUIRE_VLLM") == "1":
            pytest.fail(msg + " (KVMESH_REQUIRE_VLLM=1)")
        pytest.skip(msg)
    return Path(src).resolve()


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> dict:
    """The wheel built from connectors/vllm, installed into a fresh venv over this python."""
    missing = [pkg for mod, pkg in BUILD_PACKAGES.items() if importlib.util.find_spec(mod) is None]
    if missing:
        pytest.fail(f"{sys.executable} cannot build the wheel; install: apt-get install {' '.join(missing)}")
    tmp = tmp_path_factory.mktemp("kvmesh-wheel")
    # A copy of the sources, so that setuptools' build/ and *.egg-info stay out of the checkout.
    src = tmp / "src"
    src.mkdir()
    shutil.copy2(PACKAGE_ROOT / "pyproject.toml", src)
    shutil.copy2(PACKAGE_ROOT / "README.md", src)
    shutil.copytree(PACKAGE_ROOT / "kvmesh_vllm", src / "kvmesh_vllm",
                    ignore=shutil.ignore_patterns("__pycache__", "*.py[cod]"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL")}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PYTHONDONTWRITEBYTECODE="1")
    dist = tmp / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--no-index",
          "-q", "-w", str(dist), str(src)], env=env, cwd=tmp)
    wheels = sorted(dist.glob("kvmesh_vllm-*-py3-none-any.whl"))
    assert len(wheels) == 1, f"expected one pure-Python wheel, got {sorted(p.name for p in dist.iterdir())}"
    # --without-pip: the venv sees Debian's pip through the system site-packages.
    root = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(root)], env=env, cwd=tmp)
    python = root / "bin" / "python"
    _run([str(python), "-m", "pip", "install", "-q", "--no-index", "--no-deps", str(wheels[0])], env=env, cwd=tmp)
    site = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                env=env, cwd=tmp).stdout.strip()
    return {"python": python, "site": Path(site), "wheel": wheels[0], "tmp": tmp}


def _venv_env(pythonpath: list) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VLLM_PLUGINS")}
    env.update(PYTHONNOUSERSITE="1", PYTHONDONTWRITEBYTECODE="1")
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(pythonpath)
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    return env


def _run_script(venv: dict, name: str, script: str, pythonpath: list) -> dict:
    """Run a check script with the venv's python: from a temp dir, with -P (no
    script or working directory on sys.path), so only PYTHONPATH and the
    venv's site-packages can provide kvmesh_vllm."""
    path = venv["tmp"] / name
    path.write_text(script, encoding="utf-8")
    proc = _run([str(venv["python"]), "-P", str(path), str(PACKAGE_ROOT)],
                env=_venv_env(pythonpath), cwd=venv["tmp"])
    return _facts(proc)


LIGHT_CHECK = r"""
import importlib.metadata as md
import json
import sys

import kvmesh_vllm.plugin as plugin

heavy = sorted(m for m in ("vllm", "torch", "numpy", "confluent_kafka", "kvmesh_vllm.connector") if m in sys.modules)
dist = md.distribution("kvmesh-vllm")
eps = [(ep.name, ep.value) for ep in md.entry_points(group="vllm.general_plugins") if ep.dist.name == dist.name]
try:
    import vllm  # noqa: F401
    have_vllm = True
except ImportError:
    have_vllm = False
plugin.register()  # no vLLM: logs a warning, must not raise
print(json.dumps({"file": plugin.__file__, "heavy": heavy, "requires": dist.requires or [], "version": dist.version,
                  "entry_points": eps, "have_vllm": have_vllm}))
"""


def test_wheel_installs_and_plugin_module_is_light(venv):
    """The installed wheel: its entry point, its stated dependencies, and a
    plugin module that imports nothing heavy and does not raise without vLLM."""
    facts = _run_script(venv, "light_check.py", LIGHT_CHECK, [])
    assert _under(facts["file"], venv["site"]), f"kvmesh_vllm.plugin from {facts['file']}, not the venv"
    assert facts["entry_points"] == [list(ENTRY_POINT)]
    assert facts["heavy"] == [], f"importing kvmesh_vllm.plugin imported {facts['heavy']}"
    names = sorted(re.match(r"[A-Za-z0-9._-]+", r).group(0).lower() for r in facts["requires"])
    assert names == ["confluent-kafka", "numpy"], facts["requires"]
    assert not facts["have_vllm"], "vLLM is importable without VLLM_SRC: the check above proved nothing"


VLLM_CHECK = r"""
import vllm_cpu_shim  # noqa: F401  (before anything imports torch or vllm)

import importlib.metadata as md
import inspect
import json
import os
import sys

import vllm
import vllm.plugins as plugins
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm.utils.func_utils import supports_kw

checkout = os.path.realpath(sys.argv[1])
facts = {"vllm": vllm.__file__, "path_has_checkout": any(
    os.path.realpath(p or os.getcwd()) == checkout for p in sys.path)}

def resolve(cfg):
    try:
        return KVConnectorFactory.get_connector_class(cfg), None
    except Exception as e:  # noqa: BLE001
        return None, f"{type(e).__name__}: {e}"

alone = KVTransferConfig(kv_connector="KVMeshConnector", kv_role="kv_both")
facts["before"] = resolve(alone)[1]

# VLLM_PLUGINS, vLLM's allow-list of plugin names: the entry point is "kvmesh".
os.environ["VLLM_PLUGINS"] = "another-plugin"
facts["filtered_out"] = "kvmesh" not in plugins.load_plugins_by_group(plugins.DEFAULT_PLUGINS_GROUP)
os.environ["VLLM_PLUGINS"] = "kvmesh"
facts["allowed"] = "kvmesh" in plugins.load_plugins_by_group(plugins.DEFAULT_PLUGINS_GROUP)
del os.environ["VLLM_PLUGINS"]
eps = [ep for ep in md.entry_points(group=plugins.DEFAULT_PLUGINS_GROUP) if ep.name == "kvmesh"]
facts["entry_points"] = [(ep.name, ep.value, str(ep.dist.locate_file(""))) for ep in eps]

plugins.load_general_plugins()
facts["lazy"] = "kvmesh_vllm.connector" not in sys.modules
cls, err = resolve(alone)
facts["error"] = err
if cls is not None:
    import kvmesh_vllm
    from kvmesh_vllm import _vllm
    facts.update(
        cls=f"{cls.__module__}.{cls.__qualname__}",
        cls_file=inspect.getfile(cls),
        package_file=kvmesh_vllm.__file__,
        have_vllm=_vllm.HAVE_VLLM,
        subclass=issubclass(cls, KVConnectorBase_V1),
        kv_cache_config_kw=supports_kw(cls, "kv_cache_config"),
        by_name=KVConnectorFactory.get_connector_class_by_name("KVMeshConnector") is cls,
        hma=KVConnectorFactory.supports_hma_config(alone),
    )
    # As a MultiConnector child without kv_connector_module_path (vLLM builds
    # each child's KVTransferConfig and resolves it through the factory).
    multi = KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_both", kv_connector_extra_config={
        "connectors": [{"kv_connector": "KVMeshConnector", "kv_role": "kv_both"}]})
    facts["multi_hma"] = KVConnectorFactory.supports_hma_config(multi)

# Loaded again (vLLM loads general plugins in each process, and may call them more than once).
from kvmesh_vllm import plugin
plugin.register()
plugins.plugins_loaded = False
plugins.load_general_plugins()
facts["again"] = resolve(alone)[0] is cls
print(json.dumps(facts))
"""


def _vllm_pythonpath(src: Path) -> list:
    """PYTHONPATH for the venv's python: this one's (setup.sh's pydantic site,
    shim and tree), less anything holding kvmesh_vllm (the checkout) or
    another vLLM tree, plus VLLM_SRC and the pack's shim when missing."""
    keep = []
    for p in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        if not p or Path(p, "kvmesh_vllm").exists():
            continue
        if Path(p, "vllm").is_dir() and Path(p).resolve() != src:
            continue
        keep.append(str(Path(p).resolve()))  # the script runs from a temp dir
    shim = src.parent / "shim"
    if not any(Path(p, "vllm_cpu_shim.py").is_file() for p in keep) and (shim / "vllm_cpu_shim.py").is_file():
        keep.append(str(shim))
    if not any(Path(p).resolve() == src for p in keep):
        keep.append(str(src))
    return keep


def test_vllm_plugin_loader_registers_connector(request):
    """vLLM's plugin loader, over the installed wheel, makes "KVMeshConnector"
    a connector name its factory resolves (to the venv's copy)."""
    vllm_src = _vllm_src()  # before the venv fixture: a skip builds nothing
    venv = request.getfixturevalue("venv")
    facts = _run_script(venv, "vllm_check.py", VLLM_CHECK, _vllm_pythonpath(vllm_src))
    assert _under(facts["vllm"], vllm_src), f"vllm from {facts['vllm']}, not VLLM_SRC={vllm_src}"
    assert not facts["path_has_checkout"], "connectors/vllm is on the venv python's sys.path"
    assert facts["before"] and "KVMeshConnector" in facts["before"], \
        f"KVMeshConnector resolved before the plugins were loaded: {facts['before']}"
    assert facts["filtered_out"] and facts["allowed"], "VLLM_PLUGINS does not select the plugin by the name kvmesh"
    assert [e[:2] for e in facts["entry_points"]] == [list(ENTRY_POINT)], facts["entry_points"]
    assert _under(facts["entry_points"][0][2], venv["site"]), facts["entry_points"]
    assert facts["error"] is None, facts["error"]
    assert facts["lazy"], "load_general_plugins imported kvmesh_vllm.connector before vLLM asked for it"
    assert facts["cls"] == "kvmesh_vllm.connector.KVMeshConnector"
    assert _under(facts["cls_file"], venv["site"]), f"KVMeshConnector from {facts['cls_file']}, not the wheel"
    assert _under(facts["package_file"], venv["site"]) and not _under(facts["package_file"], PACKAGE_ROOT)
    assert facts["have_vllm"] and facts["subclass"], "KVMeshConnector is not vLLM's KVConnectorBase_V1"
    assert facts["kv_cache_config_kw"] and facts["by_name"]
    assert facts["hma"] and facts["multi_hma"], "vLLM does not see KVMeshConnector as SupportsHMA"
    assert facts["again"], "loading the plugins again changed or lost the registration"
