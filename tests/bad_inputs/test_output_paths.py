"""Output files the user names (compile -o, report --output, launch --manifest-out), checked before any work by one
helper (output_files.check_output_file) and written by one (output_files.write_output_file): a parent that is
missing, a file, not writable or /proc, and the path a directory, each one line; and path or URL options given an
empty value, or a config file that holds no settings, refused instead of running the defaults."""
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlaif.errors import UserError
from rlaif.io import output_files, storage

TINY = str(Path(__file__).resolve().parents[2] / "configs/tiny.yaml")


@pytest.fixture
def unwritable_dir(tmp_path):
    """A directory this user cannot create files in: a 0o500 one, or /sys where root writes past permission bits."""
    if os.geteuid() == 0:
        yield Path("/sys")
        return
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    yield locked
    locked.chmod(0o700)


def output_commands(tmp_path, path: str) -> list[tuple[str, ...]]:
    """Every subcommand's output-file option, naming `path` with the suffix the option asks for."""
    return [("compile", "kfp", "--output", f"{path}.yaml"),
            ("report", str(tmp_path / "a"), str(tmp_path / "b"), "--output", f"{path}.html"),
            ("launch", "generate", "--config", TINY, "--storage-root", str(tmp_path / "root"),
             "--manifest-out", f"{path}.json")]


def test_an_output_in_a_directory_that_cannot_be_written(cli, tmp_path, unwritable_dir):
    for args in output_commands(tmp_path, str(unwritable_dir / "out")):
        line = cli(*args, needle=f"{args[-2]} {args[-1]}: ")
        assert "no permission to write in" in line or "read-only filesystem" in line, line
    assert not (tmp_path / "root").exists()  # launch checked it before any stage work


def test_compile_never_writes_over_a_file_it_reads(cli, tmp_path, monkeypatch):
    """`compile kfp -o my.yaml --config my.yaml` replaced the user's config with the pipeline, silently."""
    config, cluster_file = tmp_path / "my.yaml", tmp_path / "cluster.yaml"
    shutil.copy(TINY, config)
    cluster_file.write_text("retries: 1\n")
    monkeypatch.chdir(tmp_path)
    cli("compile", "kfp", "-o", str(config), "--config", str(config),
        needle=f"-o {config} is the --config file this reads: write the pipeline to another file")
    cli("compile", "kfp", "-o", str(config), "--config", config.as_uri(), needle=f"-o {config} is the --config file")
    cli("compile", "kfp", "-o", "./cluster.yaml", "--cluster", str(cluster_file), "--config", str(config),
        needle="-o ./cluster.yaml is the --cluster file this reads")
    assert config.read_bytes() == Path(TINY).read_bytes() and cluster_file.read_text() == "retries: 1\n"


def test_an_output_under_proc(cli, tmp_path):
    for args in output_commands(tmp_path, "/proc/out"):
        cli(*args, needle=f"{args[-2]} {args[-1]}: cannot write files in /proc")
    assert not (tmp_path / "root").exists()


def test_an_output_whose_parent_is_a_file(cli, tmp_path):
    (tmp_path / "afile").write_text("")
    for args in output_commands(tmp_path, str(tmp_path / "afile/out")):
        cli(*args, needle=f"{tmp_path / 'afile'} is a file, not a directory")
    assert not (tmp_path / "root").exists()


def test_an_output_that_is_a_directory_or_a_missing_one(cli, tmp_path):
    for suffix in (".yaml", ".html", ".json"):
        (tmp_path / f"out{suffix}").mkdir()
    for args in output_commands(tmp_path, str(tmp_path / "out")):
        cli(*args, needle=f"{args[-1]} is a directory: name the")
    for args in output_commands(tmp_path, str(tmp_path / "missing/out")):
        cli(*args, needle=f"directory {tmp_path / 'missing'} does not exist: create it first")
    assert not (tmp_path / "root").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes past a file's permission bits")
def test_an_existing_read_only_output_is_refused_and_kept(cli, tmp_path):
    existing = tmp_path / "p.yaml"
    existing.write_text("old")
    existing.chmod(0o444)
    cli("compile", "kfp", "--output", str(existing), needle=f"--output {existing}: no permission to write it")
    assert existing.read_text() == "old"


def unprivileged(argv: list[str]) -> list[str]:
    """`argv` as a user whom file modes bind (root without the capabilities that bypass them)."""
    if os.geteuid() != 0:
        return argv
    if not shutil.which("capsh"):
        pytest.skip("root without capsh: file modes do not bind here")
    return ["capsh", "--drop=cap_dac_override,cap_dac_read_search", "--", "-c", shlex.join(argv)]


def test_paths_this_user_may_not_use_are_one_line(tmp_path):
    """A storage root under a directory the user may not search, a colleague's run directory, an output there: a
    PermissionError traceback (exit 1) from the first stat or write."""
    closed, theirs = tmp_path / "closed", tmp_path / "runs/theirs"
    closed.mkdir(mode=0o000)
    theirs.mkdir(parents=True, mode=0o555)
    try:
        for args, where in ((["run", "--config", TINY, "--storage-root", f"file://{closed}/sub"], f"{closed}/sub"),
                            (["run", "--config", TINY, "--storage-root", f"file://{tmp_path}/runs", "--run-id",
                              "theirs"], str(theirs)),
                            (["compile", "kfp", "--output", f"{closed}/p.yaml"], f"{closed}/p.yaml")):
            proc = subprocess.run(unprivileged([sys.executable, "-m", "rlaif", *args]), capture_output=True,
                                  text=True, timeout=300)
            assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
            assert proc.stderr.startswith(f"error: cannot use {where}") and "Permission denied: give this user " \
                "access to it, or point storage.root" in proc.stderr, proc.stderr
        assert os.listdir(theirs) == []
    finally:
        closed.chmod(0o700)


@pytest.fixture
def no_aws_credentials(monkeypatch, tmp_path):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                 "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    for name in ("AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"):
        monkeypatch.setenv(name, str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    storage.configure(None)
    s3fs = pytest.importorskip("s3fs")
    s3fs.S3FileSystem.clear_instance_cache()  # cached filesystems keep the credentials they found
    yield
    s3fs.S3FileSystem.clear_instance_cache()


def test_an_s3_report_output_without_credentials(cli, tmp_path, no_aws_credentials):
    line = cli("report", str(tmp_path / "a"), str(tmp_path / "b"), "--output", "s3://no-bucket/x.html",
               needle="--output s3://no-bucket/x.html cannot be written (Unable to locate credentials): check the")
    assert "run again" not in line  # the wording for a run's stages, not for a report


def test_the_check_changes_nothing_and_a_late_failure_is_one_line(tmp_path, unwritable_dir):
    existing = tmp_path / "out/compare.html"
    existing.parent.mkdir()
    existing.write_text("old")
    url = output_files.check_output_file(str(existing), "--output", "the comparison HTML file", "compare.html")
    assert existing.read_text() == "old" and os.listdir(existing.parent) == ["compare.html"]  # no probe file left
    output_files.write_output_file(url, b"new", "--output")
    assert existing.read_text() == "new"
    late = storage.normalize(str(unwritable_dir / "m.json"))  # checked fine, then the directory became unwritable
    with pytest.raises(UserError, match=r"^--manifest-out .*m\.json: (no permission to write in|.*read-only)"):
        output_files.write_output_file(late, b"{}", "--manifest-out")


@pytest.mark.parametrize("args, needle", [
    (("run", "--config", ""), "--config is empty: name a YAML config file, or leave --config out to run the defaults"),
    (("run", "--config", "  "), "--config is empty"),
    (("launch", "generate", "--config", ""), "--config is empty"),
    (("stage", "generate", "--config", ""), "--config is empty"),
    (("serve", "--config", "", "--manifest", "deployment"), "--config is empty"),
    (("submit", "kfp", "--endpoint", "http://127.0.0.1:9", "--config", ""), "--config is empty"),
    (("compile", "kfp", "-o", ""), "--output is empty: name the pipeline YAML file"),
    (("compile", "kfp", "-o", "p.yaml", "--config", ""), "--config is empty"),
    (("compile", "kfp", "-o", "p.yaml", "--cluster", ""), "--cluster is empty"),
    (("compile", "kfp", "-o", "p.yaml", "--components-dir", ""), "--components-dir is empty"),
    (("submit", "kfp", "--endpoint", "http://127.0.0.1:9", "--config", TINY, "--cluster", ""), "--cluster is empty"),
    (("serve", "--config", TINY, "--manifest", "deployment", "--cluster", ""), "--cluster is empty"),
    (("launch", "generate", "--config", TINY, "--manifest-out", ""), "--manifest-out is empty"),
    (("report", ""), "RUN_DIR is empty"),
    (("report", "a", "b", "--output", ""), "--output is empty"),
    (("run", "--config", TINY, "--storage-root", ""), "--storage-root is empty"),
])
def test_an_empty_path_or_url_value(cli, tmp_path, monkeypatch, args, needle):
    monkeypatch.chdir(tmp_path)  # the defaults' storage root is runs/ here: nothing may appear
    cli(*args, needle=needle)
    assert os.listdir(tmp_path) == []


def test_empty_run_id_and_root_still_mean_the_default_for_launch(cli):
    # what the DAGs pass when their params are empty: refused further on, by the next check, not as empty
    cli("launch", "generate", "--config", TINY, "--run-id", "", "--storage-root", "", "--set-json", "[1]",
        needle="--set-json must be a JSON list")


@pytest.mark.parametrize("content", [b"", b"# only a comment\n", b"null\n", b"---\n", b"\n\n"])
def test_a_config_file_that_holds_no_settings(cli, tmp_path, content):
    config = tmp_path / "c.yaml"
    config.write_bytes(content)
    for command in (("run",), ("launch", "generate"), ("stage", "generate")):
        cli(*command, "--config", str(config), "--set", f"storage.root={tmp_path / 'root'}",
            needle=f"config file {config} holds no settings: add some, or leave --config out to run the defaults")
    assert not (tmp_path / "root").exists()


def test_an_inline_config_that_holds_no_settings(cli, tmp_path):
    """A multi-line --config is the YAML itself (how KFP and Airflow users paste one): comments only say nothing."""
    cli("launch", "generate", "--config", "# the config\n# pasted here\n", "--storage-root", str(tmp_path / "root"),
        needle="inline config holds no settings: add some, or leave --config out to run the defaults")
    assert not (tmp_path / "root").exists()


def test_outputs_to_standard_output_or_a_pipe(tmp_path):
    """`-o -` and `-o /dev/stdout` (a pipe, or a file a shell redirect opened) write the YAML alone on standard
    output, the status line on stderr; /dev/null takes it; a socket is still refused."""
    import socket
    import subprocess
    import sys

    import yaml

    def compile_to(target: str, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "rlaif", "compile", "kfp", "-o", target], text=True,
                              stderr=subprocess.PIPE, timeout=300, **kwargs)

    for target in ("-", "/dev/stdout"):
        piped = compile_to(target, stdout=subprocess.PIPE)
        assert piped.returncode == 0 and piped.stderr.strip() == f"pipeline: {target}", piped.stderr
        documents = list(yaml.safe_load_all(piped.stdout))
        assert documents[0]["pipelineInfo"]["name"] == "rlaif", piped.stdout[:200]
    redirected = tmp_path / "redirected.yaml"
    with open(redirected, "w") as out:
        assert compile_to("/dev/stdout", stdout=out).returncode == 0
    assert redirected.read_text().startswith("# PIPELINE DEFINITION")
    assert compile_to("/dev/null", stdout=subprocess.DEVNULL).returncode == 0
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(tmp_path / "sock.yaml"))
        refused = compile_to(str(tmp_path / "sock.yaml"), stdout=subprocess.PIPE)
    assert refused.returncode == 2 and "is not a regular file" in refused.stderr, refused.stderr
