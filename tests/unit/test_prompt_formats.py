"""Prompts in every format data.format reads (JSONL under any name, CSV/TSV, text, parquet, a directory saved with
`datasets`, parquet/JSONL data files through `datasets`), locally and on s3:// (moto), become the same rows;
data.columns renames a dataset's columns; every bad case is one line naming the source, the row and the fix; the
cache key follows an s3:// prompts object's content. Constitutions and few-shot files are read from s3:// too.
Offline: the hub is never asked."""
import json
import sys

import pytest

from rlaif.config import DataConfig, PromptColumns, load_config, parse_config, stage_config_hash
from rlaif.errors import UserError
from rlaif.graph import STAGE_BY_NAME
from rlaif.io import storage
from rlaif.io.prompts import load_prompts, source_digest
from rlaif.stages.common import file_digests

datasets = pytest.importorskip("datasets")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

FIELDS = ("id", "prompt", "key_points", "reference")
ROWS = [
    {"id": "bread", "prompt": "How do I bake bread?", "key_points": ["mix flour and water", "let it rise"]},
    {"id": "rice", "prompt": " How do I cook rice? ", "reference": "Rinse it. Simmer it covered."},
    {"id": 7, "prompt": "Name a good houseplant."},
]
EXPECTED = [
    {"id": "bread", "prompt": "How do I bake bread?", "key_points": ["mix flour and water", "let it rise"]},
    {"id": "rice", "prompt": "How do I cook rice?", "reference": "Rinse it. Simmer it covered."},
    {"id": "7", "prompt": "Name a good houseplant."},
]
RENAMED = {"id": "qid", "prompt": "question", "key_points": "points", "reference": "answer"}


def columns_of(rows: list[dict], names: dict | None = None, like: list[dict] | None = None) -> dict[str, list]:
    """Every row under every column that `like` (default: rows) has, None where a row has no value: no writer
    guesses the schema from row one."""
    names = {**{f: f for f in FIELDS}, **(names or {})}
    return {names[f]: [row.get(f) for row in rows] for f in FIELDS if any(f in row for row in like or rows)}


def table(rows: list[dict], names: dict | None = None, like: list[dict] | None = None):
    """Typed columns (a column of nulls would otherwise be typed null and clash with its twin in another file)."""
    types = {"id": pa.string(), "prompt": pa.string(), "key_points": pa.list_(pa.string()), "reference": pa.string()}
    names = {**{f: f for f in FIELDS}, **(names or {})}
    cols = columns_of(rows, names, like)
    return pa.table({names[f]: pa.array([None if v is None else (str(v) if f == "id" else v) for v in cols[names[f]]],
                                        types[f]) for f in FIELDS if names[f] in cols})


def write_jsonl(path, rows, names=None):
    names = {**{f: f for f in FIELDS}, **(names or {})}
    path.write_text("".join(json.dumps({names[k]: v for k, v in row.items()}) + "\n" for row in rows))


def write_parquet(path, rows, names=None, like=None):
    pq.write_table(table(rows, names, like), path)


def save_dataset(path, rows, names=None, splits=None):
    dataset = datasets.Dataset(table(rows, names))
    (datasets.DatasetDict({s: dataset for s in splits}) if splits else dataset).save_to_disk(str(path))


# Each: where to write the prompts and how, and the DataConfig that reads them back.
def as_jsonl(d):
    write_jsonl(d / "p.jsonl", ROWS)
    return DataConfig(prompts=str(d / "p.jsonl"))


def as_json_array(d):
    (d / "p.json").write_text(json.dumps(ROWS))
    return DataConfig(prompts=f"file://{d}/p.json")


def write_csv(path, rows, delimiter=","):
    """A header row, then each row with its key points as a JSON list and an empty cell for a field it lacks; TSV
    unquoted, as TSV is written."""
    import csv

    cells = [[json.dumps(row[k]) if k == "key_points" and k in row else str(row.get(k, "")) for k in FIELDS]
             for row in rows]
    with open(path, "w", newline="", encoding="utf-8") as f:
        if delimiter == "\t":
            f.write("".join("\t".join(line) + "\n" for line in [list(FIELDS), *cells]))
            return
        csv.writer(f).writerows([FIELDS, *cells])


def as_csv(d):
    write_csv(d / "p.csv", ROWS)
    return DataConfig(prompts=str(d / "p.csv"))


def as_tsv(d):
    write_csv(d / "p.tsv", ROWS, delimiter="\t")
    return DataConfig(prompts=str(d / "p.tsv"))


def as_ndjson(d):
    write_jsonl(d / "p.ndjson", ROWS)
    return DataConfig(prompts=str(d / "p.ndjson"))


def as_jsonl_by_another_name(d):  # no known suffix: its first line, a JSON object, says JSONL
    write_jsonl(d / "prompts", ROWS)
    return DataConfig(prompts=str(d / "prompts"))


def as_parquet(d):
    write_parquet(d / "p.parquet", ROWS)
    return DataConfig(prompts=str(d / "p.parquet"))


def as_saved_dataset(d):
    save_dataset(d / "saved", ROWS)
    return DataConfig(prompts=str(d / "saved"))


def as_saved_dataset_dict(d):
    save_dataset(d / "saved", ROWS, splits=("train", "test"))
    return DataConfig(prompts=str(d / "saved"), split="test")


def as_hf_parquet_files(d):
    write_parquet(d / "part-0.parquet", ROWS[:2], like=ROWS)
    write_parquet(d / "part-1.parquet", ROWS[2:], like=ROWS)
    return DataConfig(prompts=str(d / "part-*.parquet"), format="hf")


def as_hf_jsonl_file(d):
    write_jsonl(d / "p.jsonl", ROWS)
    return DataConfig(prompts=str(d / "p.jsonl"), format="hf")


@pytest.mark.parametrize("write", [as_jsonl, as_json_array, as_csv, as_tsv, as_ndjson, as_jsonl_by_another_name,
                                   as_parquet, as_saved_dataset, as_saved_dataset_dict, as_hf_parquet_files,
                                   as_hf_jsonl_file])
def test_every_format_gives_the_same_rows(tmp_path, write):
    assert load_prompts(write(tmp_path)) == EXPECTED


def test_rows_without_ids_are_numbered_alike_in_text_jsonl_and_parquet(tmp_path):
    """The held-out split hashes the id: a file converted to another format keeps its split."""
    prompts = ["first prompt", "second prompt", "third prompt"]
    (tmp_path / "p.txt").write_text("\n".join(prompts) + "\n")
    write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in prompts])
    write_parquet(tmp_path / "p.parquet", [{"prompt": p} for p in prompts])
    save_dataset(tmp_path / "saved", [{"prompt": p} for p in prompts])
    (tmp_path / "p.csv").write_text("prompt\n" + "\n".join(prompts) + "\n")
    names = ("p.txt", "p.jsonl", "p.parquet", "saved", "p.csv")
    rows = [load_prompts(DataConfig(prompts=str(tmp_path / name))) for name in names]
    assert rows[0] == rows[1] == rows[2] == rows[3] == rows[4]
    assert [r["id"] for r in rows[0]] == ["line0000001", "line0000002", "line0000003"]
    unknown_suffix = tmp_path / "prompts.lst"  # as before formats: any other file is one prompt per line
    unknown_suffix.write_text("\n".join(prompts))
    assert load_prompts(DataConfig(prompts=str(unknown_suffix))) == rows[0]
    markdown = tmp_path / "prompts.md"  # but a document format (headings, bullets) only when data.format says text
    markdown.write_text("\n".join(prompts))
    assert load_prompts(DataConfig(prompts=str(markdown), format="text")) == rows[0]


def test_column_mapping(tmp_path):
    columns = PromptColumns(**RENAMED)
    write_jsonl(tmp_path / "p.jsonl", ROWS, RENAMED)
    write_parquet(tmp_path / "p.parquet", ROWS, RENAMED)
    save_dataset(tmp_path / "saved", ROWS, RENAMED)
    for name in ("p.jsonl", "p.parquet", "saved"):
        assert load_prompts(DataConfig(prompts=str(tmp_path / name), columns=columns)) == EXPECTED, name
    cfg = parse_config("data: {columns: {prompt: question, id: qid, key_points: points, reference: answer}}", "test",
                       [f"data.prompts={tmp_path / 'p.parquet'}"])
    assert load_prompts(cfg.data) == EXPECTED
    # only the prompt column is required; the optional ones under their own names may be absent
    write_parquet(tmp_path / "only.parquet", [{"prompt": "just a prompt"}], {"prompt": "question"})
    assert load_prompts(DataConfig(prompts=str(tmp_path / "only.parquet"), columns={"prompt": "question"})) == [
        {"id": "line0000001", "prompt": "just a prompt"}]


def one_line_error(data: DataConfig, needle: str) -> str:
    with pytest.raises(UserError) as info:
        load_prompts(data)
    message = str(info.value)
    assert needle in message and "\n" not in message, message
    return message


def test_missing_columns_name_the_column_and_the_fix(tmp_path):
    write_parquet(tmp_path / "p.parquet", ROWS, RENAMED)
    message = one_line_error(DataConfig(prompts=str(tmp_path / "p.parquet")), "has no column 'prompt'")
    assert "set data.columns.prompt" in message and "p.parquet" in message and "'question'" in message
    write_parquet(tmp_path / "q.parquet", ROWS)
    one_line_error(DataConfig(prompts=str(tmp_path / "q.parquet"), columns={"id": "qid"}),
                   "has no column 'qid'")  # a column named explicitly must exist
    save_dataset(tmp_path / "saved", ROWS, RENAMED)
    one_line_error(DataConfig(prompts=str(tmp_path / "saved")), "set data.columns.prompt")
    write_jsonl(tmp_path / "p.jsonl", ROWS, RENAMED)
    one_line_error(DataConfig(prompts=str(tmp_path / "p.jsonl")), "line 1 has no string field 'prompt' "
                   "(data.columns.prompt names")


@pytest.mark.parametrize("columns, needle", [
    ({"prompt": pa.array([1, 2])}, "row 1: 'prompt' must be a string, not int"),
    ({"prompt": pa.array(["a", None])}, "row 2 has no string field 'prompt'"),
    ({"prompt": pa.array(["a", " "])}, "row 2 has an empty prompt"),
    ({"prompt": pa.array(["a"]), "key_points": pa.array(["one"])}, "'key_points' must be a non-empty list"),
    ({"prompt": pa.array(["a"]), "reference": pa.array([3])}, "'reference' must be a non-empty string"),
    ({"prompt": pa.array(["a"]), "id": pa.array(["a.b"])}, "row 1: id 'a.b' is not usable"),
    ({"prompt": pa.array(["a", "b"]), "id": pa.array(["x", "x"])}, "row 2 has the prompt id 'x' of"),
    ({"prompt": pa.array([], pa.string())}, "holds no prompts"),
    ({"prompt": pa.array(["x" * 30])}, "exceeds data.max_prompt_chars=20"),
])
def test_bad_parquet_rows(tmp_path, columns, needle):
    pq.write_table(pa.table(columns), tmp_path / "p.parquet")
    message = one_line_error(DataConfig(prompts=str(tmp_path / "p.parquet"), max_prompt_chars=20), needle)
    assert "p.parquet" in message


def test_a_split_of_a_source_without_splits_is_refused(tmp_path):
    # data.split was ignored for them: every row was read as the split asked for
    write_jsonl(tmp_path / "p.jsonl", ROWS)
    write_parquet(tmp_path / "p.parquet", ROWS)
    save_dataset(tmp_path / "one", ROWS)
    for name in ("p.jsonl", "p.parquet"):
        one_line_error(DataConfig(prompts=str(tmp_path / name), split="validation"), "with no splits: unset data.split")
    one_line_error(DataConfig(prompts=str(tmp_path / "one"), split="validation"), "a single Dataset with no splits")
    assert len(load_prompts(DataConfig(prompts=str(tmp_path / "one")))) == len(ROWS)


def test_bad_sources(tmp_path):
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    one_line_error(DataConfig(prompts=str(tmp_path / "bad.parquet")), "is not a parquet file")
    (tmp_path / "plain").mkdir()
    one_line_error(DataConfig(prompts=str(tmp_path / "plain")), "nor a dataset saved with datasets' save_to_disk")
    one_line_error(DataConfig(prompts=str(tmp_path / "absent"), format="hf"), "prompts not found")
    one_line_error(DataConfig(prompts=str(tmp_path / "none-*.parquet"), format="hf"), "no file matches")
    save_dataset(tmp_path / "saved", ROWS, splits=("train", "test"))
    one_line_error(DataConfig(prompts=str(tmp_path / "saved"), split="validation"),
                   "has splits ['test', 'train'], not 'validation': set data.split")
    empty = datasets.Dataset(table(ROWS[:0]))  # saved with no data files, which load_from_disk cannot read
    datasets.DatasetDict({"train": empty, "test": datasets.Dataset(table(ROWS))}).save_to_disk(str(tmp_path / "dd"))
    one_line_error(DataConfig(prompts=str(tmp_path / "dd")), "(split train) holds no prompts")
    assert load_prompts(DataConfig(prompts=str(tmp_path / "dd"), split="test"))  # the split with rows still reads
    empty.save_to_disk(str(tmp_path / "empty"))
    one_line_error(DataConfig(prompts=str(tmp_path / "empty")), "holds no prompts (saved with no rows)")
    datasets.DatasetDict({}).save_to_disk(str(tmp_path / "no-splits"))
    one_line_error(DataConfig(prompts=str(tmp_path / "no-splits")), "a DatasetDict with no splits")
    (tmp_path / "p.jsonl.gz").write_bytes(b"\x1f\x8b\x08\x00")
    one_line_error(DataConfig(prompts=str(tmp_path / "p.jsonl.gz")), "is compressed (.gz): decompress it first")
    (tmp_path / "ragged.csv").write_text("id,prompt\na,first prompt\nb,a prompt, with a comma\n")
    one_line_error(DataConfig(prompts=str(tmp_path / "ragged.csv")), "row 2 has 3 cells and the header 2")
    (tmp_path / "no-prompt.csv").write_text("id,question\na,first prompt\n")
    one_line_error(DataConfig(prompts=str(tmp_path / "no-prompt.csv")), "has no column 'prompt'")
    (tmp_path / "headless.csv").write_text("How do I bake bread?\nWhy is the sky blue?\n")
    one_line_error(DataConfig(prompts=str(tmp_path / "headless.csv")), "or set data.format=text to read one prompt")
    assert len(load_prompts(DataConfig(prompts=str(tmp_path / "headless.csv"), format="text"))) == 2
    (tmp_path / "notes").write_text('{"prompt": "a"}\nthen a plain line\n')
    one_line_error(DataConfig(prompts=str(tmp_path / "notes")), "line 2 is not valid JSON (Expecting value, column "
                   "1) (read as JSON Lines because its first line is a JSON object: set data.format=text")
    (tmp_path / "quoted.tsv").write_text('prompt\n"Quoted," she said\n')  # TSV has no quoting
    assert load_prompts(DataConfig(prompts=str(tmp_path / "quoted.tsv")))[0]["prompt"] == '"Quoted," she said'
    (tmp_path / "exported.tsv").write_text('"id"\t"prompt"\n"a"\t"Say ""hi"", twice"\n')  # a quoting export
    assert load_prompts(DataConfig(prompts=str(tmp_path / "exported.tsv")))[0]["prompt"] == 'Say "hi", twice'
    (tmp_path / "points.csv").write_text("prompt,key_points\nfirst prompt,not a list\n")
    one_line_error(DataConfig(prompts=str(tmp_path / "points.csv")), "row 1 column 'key_points' is not valid JSON")
    (tmp_path / "p.txt").write_text("a prompt\n")
    one_line_error(DataConfig(prompts=str(tmp_path / "p.txt"), columns={"prompt": "question"}),
                   "is read as plain text")
    one_line_error(DataConfig(prompts=str(tmp_path / "saved"), revision="v1"), "apply to Hugging Face Hub datasets")
    write_parquet(tmp_path / "part-0.parquet", ROWS[:1])
    write_parquet(tmp_path / "part-1.parquet", ROWS[1:])  # other columns: datasets cannot put the two together
    one_line_error(DataConfig(prompts=str(tmp_path / "part-*.parquet"), format="hf"), "column names don't match")
    (tmp_path / "array.json").write_text('[{"prompt": "a"}, ')
    one_line_error(DataConfig(prompts=str(tmp_path / "array.json")), "is not valid JSON")


def test_near_misses_of_the_formats_are_named(tmp_path):
    """Files of one format under another's name or shape: refused with the format to name, not read as prompts of
    raw JSON or CSV, or refused with another format's parse error."""
    rows = "".join(json.dumps({"id": f"p{i}", "prompt": f"question {i}?"}) + "\n" for i in range(5))
    (tmp_path / "rows.txt").write_text(rows)
    one_line_error(DataConfig(prompts=str(tmp_path / "rows.txt")), "holds JSON Lines (each line a JSON object), "
                   "which plain text would read as raw prompts: rename it .jsonl or set data.format=jsonl")
    assert len(load_prompts(DataConfig(prompts=str(tmp_path / "rows.txt"), format="text"))) == 5  # as asked
    (tmp_path / "table.txt").write_text("id,prompt\na,first prompt\nb,second prompt\n")
    one_line_error(DataConfig(prompts=str(tmp_path / "table.txt")), "holds a CSV (its first line is a header naming "
                   "the prompt column)")
    (tmp_path / "plain.txt").write_text("How do I bake bread?\n{not json}\nprompt, then a comma\n")
    assert len(load_prompts(DataConfig(prompts=str(tmp_path / "plain.txt")))) == 3
    (tmp_path / "unclosed.csv").write_text('id,prompt\na,"an open quote\nb,second\nc,third\n')
    one_line_error(DataConfig(prompts=str(tmp_path / "unclosed.csv")), "is not valid CSV (unexpected end of data): "
                   "close each quoted cell")
    (tmp_path / "semi.csv").write_text("id;prompt\na;first prompt\n")
    one_line_error(DataConfig(prompts=str(tmp_path / "semi.csv")), "header 'id;prompt' is separated by ';': CSV here "
                   "is comma-separated")
    (tmp_path / "parts").mkdir()
    (tmp_path / "parts/a.jsonl").write_text(rows)
    one_line_error(DataConfig(prompts=str(tmp_path / "parts/*.jsonl")), "is a glob, which data.format=hf reads")
    one_line_error(DataConfig(prompts=str(tmp_path / "parts")), f"is a directory of .jsonl files, not a dataset saved "
                   f"with save_to_disk: read them all with data.prompts={tmp_path / 'parts'}/*.jsonl and "
                   "data.format=hf")
    (tmp_path / "wrapped.json").write_text(json.dumps({"data": [{"prompt": "a"}], "version": 1}, indent=2))
    one_line_error(DataConfig(prompts=str(tmp_path / "wrapped.json")), "is one JSON object (keys 'data', 'version'): "
                   "its 'data' holds a list, not a row per line")


@pytest.mark.parametrize("override, needle", [
    ("data.columns.promt=question", "unknown config key 'data.columns.promt' (did you mean 'data.columns.prompt'?)"),
    ("data.columns={prompt: text, reference: text}", "two of our fields read the same column"),
    ("data.columns.prompt=", "bad value for config key 'data.columns.prompt'"),
    ("data.format=xlsx", "bad value for config key 'data.format'"),
    ("data.split=", "bad value for config key 'data.split'"),
    ("data.prompts=s3://user:secret@bucket/p.jsonl", "must not contain a user name or password"),
])
def test_data_settings_are_validated(override, needle):
    with pytest.raises(UserError) as info:
        parse_config("", "test", [override])
    assert needle in str(info.value)


def test_hub_settings_need_a_hub_format():
    with pytest.raises(UserError, match="apply to Hugging Face Hub datasets, not data.format jsonl"):
        parse_config("data: {format: jsonl, revision: main}", "test")
    assert parse_config("data: {format: hf, prompts: someone/prompts, revision: main}", "test").data.revision == "main"


def test_a_missing_extra_is_one_line_naming_it(tmp_path, monkeypatch):
    write_parquet(tmp_path / "p.parquet", ROWS)
    save_dataset(tmp_path / "saved", ROWS)
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    monkeypatch.setitem(sys.modules, "datasets", None)
    one_line_error(DataConfig(prompts=str(tmp_path / "p.parquet")), 'needs the pyarrow package: pip install '
                   '"rlaif[datasets]"')
    one_line_error(DataConfig(prompts=str(tmp_path / "saved")), 'needs the datasets package: pip install '
                   '"rlaif[datasets]"')


@pytest.mark.parametrize("prompts, fmt", [("hf://datasets/someone/prompts", "auto"), ("someone/prompts", "hf")])
def test_hub_datasets_say_when_the_hub_is_off(monkeypatch, prompts, fmt):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = DataConfig(prompts=prompts, format=fmt, revision="v1")
    one_line_error(data, "is on the Hugging Face Hub, which is off here (HF_HUB_OFFLINE)")
    assert source_digest(data) == f"hf-hub:{prompts}@v1"  # no network asked for the cache key either
    one_line_error(DataConfig(prompts="hf://datasets/a/b/c"), "is not a Hugging Face Hub dataset name")


@pytest.fixture
def s3(s3_endpoint, tmp_path, monkeypatch):
    """A fresh prefix in the moto bucket, and a local directory to build files in."""
    endpoint, bucket = s3_endpoint
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)  # configure() exports it; restored after the test
    storage.configure(endpoint)
    return f"s3://{bucket}/prompts-{tmp_path.name}", tmp_path


def test_s3_prompts_in_every_format(s3):
    url, local = s3
    write_jsonl(local / "p.jsonl", ROWS)
    write_parquet(local / "p.parquet", ROWS, RENAMED)
    save_dataset(local / "saved", ROWS, splits=("train",))
    write_parquet(local / "part-0.parquet", ROWS[:1], like=ROWS)
    write_parquet(local / "part-1.parquet", ROWS[1:], like=ROWS)
    for name in ("p.jsonl", "p.parquet", "part-0.parquet", "part-1.parquet"):
        storage.upload_file(local / name, f"{url}/{name}")
    storage.upload_dir(local / "saved", f"{url}/saved")
    assert load_prompts(DataConfig(prompts=f"{url}/p.jsonl")) == EXPECTED
    assert load_prompts(DataConfig(prompts=f"{url}/p.parquet", columns=RENAMED)) == EXPECTED
    assert load_prompts(DataConfig(prompts=f"{url}/saved")) == EXPECTED
    assert load_prompts(DataConfig(prompts=f"{url}/part-*.parquet", format="hf")) == EXPECTED
    one_line_error(DataConfig(prompts=f"{url}/absent.parquet"), "prompts file not found")
    one_line_error(DataConfig(prompts=f"{url}/absent", format="hf"), "prompts not found")


def test_constitution_and_few_shot_from_s3(s3):
    from rlaif.judges.constitution import load_constitution
    from rlaif.judges.prompting import load_few_shot

    url, _ = s3
    storage.write_bytes_atomic(f"{url}/constitution.yaml", b"- {name: kind, text: Be kind., contrast: Be rude.}\n")
    storage.write_bytes_atomic(f"{url}/shots.jsonl",
                               b'{"prompt": "q", "response_1": "a", "response_2": "b", "preferred": 2}\n')
    assert load_constitution(f"{url}/constitution.yaml") == [
        {"name": "kind", "text": "Be kind.", "contrast": "Be rude."}]
    assert load_few_shot(f"{url}/shots.jsonl")[0]["preferred"] == 2
    with pytest.raises(UserError, match="constitution file not found: s3://"):
        load_constitution(f"{url}/absent.yaml")
    with pytest.raises(UserError, match="few-shot file not found: s3://"):
        load_few_shot(f"{url}/absent.jsonl")


def generate_key(cfg) -> str:
    stage = STAGE_BY_NAME["generate"]
    return stage_config_hash(cfg, stage.config_sections, file_digests(cfg, "generate"))


def test_cache_key_follows_s3_and_directory_prompts(s3):
    """An s3:// prompts object, an s3:// saved dataset and an s3:// few-shot file, each rewritten in place under the
    same URL: the keys of the stages that read them change."""
    url, local = s3
    write_parquet(local / "p.parquet", ROWS)
    storage.upload_file(local / "p.parquet", f"{url}/p.parquet")
    cfg = load_config("configs/demo.yaml", [f"data.prompts={url}/p.parquet"])
    before = generate_key(cfg)
    assert generate_key(cfg) == before  # stable when nothing changed
    write_parquet(local / "p.parquet", ROWS[:2])
    storage.upload_file(local / "p.parquet", f"{url}/p.parquet")
    assert generate_key(cfg) != before

    save_dataset(local / "saved", ROWS)
    storage.upload_dir(local / "saved", f"{url}/saved")
    data = DataConfig(prompts=f"{url}/saved")
    before = source_digest(data)
    save_dataset(local / "saved2", ROWS[::-1])
    storage.upload_dir(local / "saved2", f"{url}/saved")
    assert source_digest(data) != before

    storage.write_bytes_atomic(f"{url}/shots.jsonl", b'{"prompt": "q", "response_1": "a", "response_2": "b", '
                                                     b'"preferred": 1}\n')
    cfg = load_config("configs/demo.yaml", ["label.judge=hf", f"label.few_shot={url}/shots.jsonl"])
    before = file_digests(cfg, "label")["file:label.few_shot"]
    storage.write_bytes_atomic(f"{url}/shots.jsonl", b'{"prompt": "q", "response_1": "a", "response_2": "b", '
                                                     b'"preferred": 2}\n')
    assert file_digests(cfg, "label")["file:label.few_shot"] != before


def test_cache_key_follows_local_globs_and_saved_directories(tmp_path):
    write_parquet(tmp_path / "part-0.parquet", ROWS)
    globbed = DataConfig(prompts=str(tmp_path / "part-*.parquet"), format="hf")
    before = source_digest(globbed)
    write_parquet(tmp_path / "part-1.parquet", ROWS[:1])  # a new file the glob now matches
    assert source_digest(globbed) != before
    save_dataset(tmp_path / "saved", ROWS)
    saved = DataConfig(prompts=str(tmp_path / "saved"))
    before = source_digest(saved)
    save_dataset(tmp_path / "saved", ROWS[:2])
    assert source_digest(saved) != before


def test_an_id_a_row_was_given_that_another_row_names_is_explained(tmp_path):
    write_jsonl(tmp_path / "p.jsonl", [{"prompt": "first"}, {"id": "line0000001", "prompt": "second"}])
    one_line_error(DataConfig(prompts=str(tmp_path / "p.jsonl")), "line 2 has the prompt id 'line0000001' of "
                   f"prompts file {tmp_path / 'p.jsonl'} line 1 (a row without an id is given one by its position)")


def test_the_cache_key_of_a_file_of_unknown_suffix_does_not_read_its_first_line(tmp_path, monkeypatch):
    """Every stage context digests the prompts: a file's digest is its bytes' (one stat or HEAD for an s3:// object),
    so the first-line sniff that picks JSONL or text is left to the reader."""
    from rlaif.io import prompt_sources

    (tmp_path / "notes").write_text('{"prompt": "a"}\n')
    monkeypatch.setattr(prompt_sources, "_starts_with_a_json_object", lambda url: pytest.fail("sniffed"))
    assert prompt_sources.source_digest(DataConfig(prompts=str(tmp_path / "notes")))
