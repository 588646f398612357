"""Static checks of the Dockerfiles (Docker cannot build or run on the CI machines): what they copy exists, the
versions they pin agree with the Makefile and pyproject.toml, they install the project and its entrypoint, run as
a non-root user, and the cluster settings' default images are the ones the README says to build."""
import re
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement

from rlaif.orchestration.cluster import ClusterSpec

REPO = Path(__file__).resolve().parents[2]
IMAGES = {"cpu": REPO / "images/cpu/Dockerfile", "cuda": REPO / "images/cuda/Dockerfile"}


def instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())  # join continuation lines
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def args(path: Path) -> dict[str, str]:
    return dict(re.match(r"(\w+)=\"?([^\"]*)\"?", rest).groups() for op, rest in instructions(path) if op == "ARG")


@pytest.mark.parametrize("name", IMAGES)
def test_copied_files_exist(name):
    for op, rest in instructions(IMAGES[name]):
        if op == "COPY":
            *sources, _dest = rest.split()
            for src in sources:
                assert (REPO / src).exists(), f"{name}: COPY {src} does not exist"
                assert not any(src.startswith(i) for i in (REPO / ".dockerignore").read_text().split()), src


@pytest.mark.parametrize("name", IMAGES)
def test_every_package_source_is_copied_before_the_install(name):
    """pip builds the project from what was copied so far: every folder a package is installed from must be there."""
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    sources = {"rlaif", "pyproject.toml", "README.md", *tool.get("package-dir", {}).values()}
    copied = set()
    for op, rest in instructions(IMAGES[name]):
        if op == "COPY":
            copied |= set(rest.split()[:-1])
        if op == "RUN" and 'pip install ".' in rest:  # the project's own install
            break
    assert sources <= copied, f"{name}: copy {sorted(sources - copied)} before installing the project"


@pytest.mark.parametrize("name", IMAGES)
def test_versions_agree_with_the_project(name):
    pinned = args(IMAGES[name])
    torch_spec = re.search(r"^TORCH_SPEC \?= (\S+)", (REPO / "Makefile").read_text(), re.M).group(1)
    assert f"torch=={pinned['TORCH_VERSION']}" == torch_spec
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    deepspeed = Requirement(project["optional-dependencies"]["deepspeed"][0])
    assert deepspeed.specifier.contains(pinned["DEEPSPEED_VERSION"]), (deepspeed, pinned["DEEPSPEED_VERSION"])
    python = re.search(r"^FROM python:(\d+\.\d+)", IMAGES["cpu"].read_text(), re.M).group(1)
    assert Requirement(f"python{project['requires-python']}").specifier.contains(python + ".0")


@pytest.mark.parametrize("name", IMAGES)
def test_installs_the_project_and_runs_as_non_root(name):
    steps = instructions(IMAGES[name])
    runs = " ".join(rest for op, rest in steps if op == "RUN")
    # the project, its console script, the KFP executor, and parquet / Hugging Face dataset prompts
    assert 'pip install ".[kfp,datasets,tracking,serve]"' in runs
    assert "torch==${TORCH_VERSION}" in runs and "deepspeed==${DEEPSPEED_VERSION}" in runs
    users = [rest for op, rest in steps if op == "USER"]
    assert users and users[-1] not in ("0", "root")
    assert users[-1] == str(ClusterSpec().run_as_user)
    froms = [rest for op, rest in steps if op == "FROM"]
    assert all(":" in f and not f.endswith(":latest") for f in froms), froms
    env = " ".join(rest for op, rest in steps if op == "ENV")
    # Hub model ids work on clusters that reach a hub; offline mode is the deployer's choice (cluster.yaml env).
    assert "HF_HUB_OFFLINE" not in env
    workdir = [rest for op, rest in steps if op == "WORKDIR"][-1]
    assert workdir == "/opt/rlaif"  # configs/ and data/ resolve here, as the pipeline's default config expects
    assert "rlaif" in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]


def test_gpu_image_builds_deepspeed_ops_and_readme_builds_the_default_tags():
    runs = " ".join(rest for op, rest in instructions(IMAGES["cuda"]) if op == "RUN")
    assert "DS_BUILD_FUSED_ADAM=1" in runs
    assert '".[bnb]"' in runs  # the 8-bit AdamW's bitsandbytes, where it has CUDA kernels
    readme = (REPO / "README.md").read_text()
    spec = ClusterSpec()
    assert f"docker build -f images/cpu/Dockerfile -t {spec.image} ." in readme
    assert f"docker build -f images/cuda/Dockerfile -t {spec.gpu_image} ." in readme
