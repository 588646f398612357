"""Which of a run's input files the stage pods read as this machine does. The pods run the project image, whose
working directory (IMAGE_WORKDIR) carries the repository's configs/ and data/ as committed and nothing else of this
machine's: `rlaif submit kfp` warns of the others before the run starts there."""
import glob
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
IMAGE_WORKDIR = "/opt/rlaif"  # images/*/Dockerfile: WORKDIR, and what they COPY there besides the code
SHIPPED_DIRS = ("configs", "data")


def input_files(cfg) -> dict[str, str]:
    """config field -> the path or URL it names, for every file or model directory a stage of the run reads."""
    from rlaif.graph import STAGES
    from rlaif.stages import common

    named = {"data.prompts": cfg.data.prompts}
    for stage in STAGES:
        named.update({field: spec for field, spec in common.named_files(cfg, stage.name).values() if field})
    return named


def only_on_this_machine(spec: str) -> str | None:
    """Why the pods would not read the file or directory `spec` names as this machine does, or None: a URL, a hub id,
    a path this machine lacks (the image's or a volume's, as far as it can tell), or one of the repository's own
    files the image carries. Relative paths are read from the working directory here, from the image's there."""
    from rlaif.io import storage

    if spec.startswith("builtin:") or ("://" in spec and not spec.lower().startswith("file://")):
        return None
    url = "file://" + spec.split("://", 1)[1] if "://" in spec else spec  # file://localhost/, FILE:// as stages read
    path = os.path.expanduser(str(storage.local_path(url)))  # ~ as the stages expand it
    # `**` as fsspec globs it; the first match answers (a glob over a large local dataset is not walked to its end)
    if not (os.path.exists(path) or next(glob.iglob(path, recursive=True), None) is not None):
        return None
    normal = os.path.normpath(path)
    if os.path.isabs(normal):
        in_image = any(Path(normal).is_relative_to(Path(IMAGE_WORKDIR, d)) for d in SHIPPED_DIRS)  # as in a pod
        return None if in_image else "an absolute path: the pods find it only where every pod mounts it"
    parts = Path(normal).parts  # '.' has none; ../x starts with '..'
    if not parts or parts[0] not in SHIPPED_DIRS:
        return f"outside {' and '.join(SHIPPED_DIRS)}, all the image carries in {IMAGE_WORKDIR}"
    here = Path.cwd().resolve()
    if here == Path(IMAGE_WORKDIR):
        return None  # submitted from the image itself
    if here == REPO.resolve() and (REPO / "configs").is_dir():
        return "not as committed here: the image has it only if it was built from this working tree" \
            if differs_from_commit(normal) else None  # the repository's own file, at the same path in the image
    return f"read here from {here}: the pods read {IMAGE_WORKDIR}/{normal} in the image instead"


def differs_from_commit(path: str) -> bool:
    """Is `path` (relative to the checkout) untracked or changed since the checkout's commit? False where this is no
    git checkout or git is missing: nothing to compare with."""
    import subprocess

    def says_yes(*args) -> bool:  # exit code 1: not listed / differs; 128 (a repository git refuses) tells nothing
        try:
            return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, timeout=30).returncode == 1
        except (OSError, subprocess.TimeoutExpired):
            return False

    if not (REPO / ".git").exists():
        return False
    return says_yes("ls-files", "--error-unmatch", "--", path) or says_yes("diff", "--quiet", "HEAD", "--", path)
