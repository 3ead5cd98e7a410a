"""Prompt dataset files (rollout_hpc.envs.datafile): real files in every format, written in tmp_path."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollout_hpc.config import UserError
from rollout_hpc.envs.base import Prompt
from rollout_hpc.envs.datafile import (
    DatasetError,
    EpochShuffled,
    PromptRows,
    check_table,
    open_arrow,
    read_table,
    split_rows,
    write_arrow,
)

N = 6


def records(prompt_kind: str, answer_kind: str) -> list[dict]:
    out = []
    for i in range(N):
        q = f"What is {i} + {i}?"
        if prompt_kind == "chat":
            prompt = [{"role": "user", "content": q}]
            if i % 2:  # some rows carry a system message, some several turns
                prompt = [
                    {"role": "system", "content": f"sys {i}"},
                    {"role": "user", "content": "warm-up"},
                    {"role": "assistant", "content": "ok"},
                    {"role": "user", "content": q},
                ]
        else:
            prompt = q
        answer = 2 * i if answer_kind == "int" else f"{2 * i}"
        out.append({"prompt": prompt, "answer": answer, "source": f"src{i % 3}", "level": i})
    return out


def write_format(fmt: str, recs: list[dict], tmp_path) -> str:
    if fmt == "jsonl":
        p = tmp_path / "data.jsonl"
        p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    elif fmt == "json_array":
        p = tmp_path / "data.json"
        p.write_text(json.dumps(recs, indent=1))
    elif fmt == "json_lines_named_json":
        p = tmp_path / "data.json"
        p.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    elif fmt == "parquet":
        p = tmp_path / "data.parquet"
        pq.write_table(pa.Table.from_pylist(recs), p)
    elif fmt == "save_to_disk":
        datasets = pytest.importorskip("datasets")
        p = tmp_path / "hf"
        datasets.Dataset.from_list(recs).save_to_disk(str(p), num_shards=2)
    elif fmt == "parquet_shards":
        p = tmp_path / "shards"
        p.mkdir()
        for k, lo in enumerate(range(0, N, 4)):  # shard names sort in row order
            pq.write_table(pa.Table.from_pylist(recs[lo : lo + 4]), p / f"part-{k:03d}.parquet")
    elif fmt == "jsonl_shards":
        p = tmp_path / "jshards"
        p.mkdir()
        for k, lo in enumerate(range(0, N, 4)):
            (p / f"part-{k:03d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs[lo : lo + 4]))
    else:
        raise AssertionError(fmt)
    return str(p)


FORMATS = ["jsonl", "json_array", "json_lines_named_json", "parquet", "save_to_disk", "parquet_shards", "jsonl_shards"]


@pytest.mark.parametrize("answer_kind", ["int", "str"])
@pytest.mark.parametrize("prompt_kind", ["str", "chat"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_read_every_format(fmt, prompt_kind, answer_kind, tmp_path):
    recs = records(prompt_kind, answer_kind)
    path = write_format(fmt, recs, tmp_path)
    table = read_table(path)
    assert table.num_rows == N
    check_table(table, path)
    rows = PromptRows(table)
    assert len(rows) == N
    for i, rec in enumerate(recs):
        p = rows[i]
        assert isinstance(p, Prompt)
        if prompt_kind == "str":
            assert p.text == rec["prompt"]
            assert p.messages == ({"role": "user", "content": rec["prompt"]},)
        else:
            assert p.messages == tuple(rec["prompt"])
            assert p.text == rec["prompt"][-1]["content"]  # the last user message
        assert p.answer == rec["answer"] and type(p.answer) is type(rec["answer"])
        assert p.meta == {"source": rec["source"], "level": rec["level"], "row": i}


def test_system_prompt_and_indices(tmp_path):
    recs = records("chat", "str")
    path = write_format("jsonl", recs, tmp_path)
    table = read_table(path)
    rows = PromptRows(table, system_prompt="Think step by step.", indices=[5, 0, 2])
    assert len(rows) == 3
    p5, p0 = rows[0], rows[1]
    assert p5.meta["row"] == 5 and p0.meta["row"] == 0 and rows[-1].meta["row"] == 2
    assert p5.messages[0] == {"role": "system", "content": "sys 5"}  # has its own: not replaced
    assert sum(m["role"] == "system" for m in p5.messages) == 1
    assert p0.messages == (
        {"role": "system", "content": "Think step by step."},
        {"role": "user", "content": recs[0]["prompt"][0]["content"]},
    )
    assert p0.text == recs[0]["prompt"][0]["content"]
    with pytest.raises(IndexError):
        rows[3]
    plain = PromptRows(pa.table({"q": ["a", "b"]}), prompt_key="q", system_prompt="S")
    assert plain[1].messages == ({"role": "system", "content": "S"}, {"role": "user", "content": "b"})
    assert plain[1].answer is None and plain[1].meta == {"row": 1}


def test_chat_extra_message_fields_kept(tmp_path):
    path = tmp_path / "tool.jsonl"
    path.write_text(
        json.dumps({"prompt": [{"role": "user", "content": "q"}], "answer": "a"})
        + "\n"
        + json.dumps(
            {
                "prompt": [{"role": "user", "content": "q2"}, {"role": "tool", "content": "42", "name": "calc"}],
                "answer": "b",
            }
        )
        + "\n"
    )
    table = read_table(path)
    check_table(table, path)
    rows = PromptRows(table)
    assert rows[0].messages == ({"role": "user", "content": "q"},)  # no 'name': None padding
    assert rows[1].messages[1] == {"role": "tool", "content": "42", "name": "calc"}
    assert rows[1].text == "q2"


def test_write_open_round_trip(tmp_path):
    recs = records("chat", "int")
    table = read_table(write_format("jsonl", recs, tmp_path))
    out = tmp_path / "prep" / "prompts.arrow"
    write_arrow(table, out)
    write_arrow(table.slice(0, 2), out)  # replaced atomically
    assert open_arrow(out).num_rows == 2
    write_arrow(table, out, max_chunk_rows=4)
    assert sorted(os.listdir(out.parent)) == ["prompts.arrow"]  # no temporary files left
    back = open_arrow(out)
    assert back.equals(table)
    assert back.to_batches()[0].num_rows == 4
    a, b = PromptRows(table), PromptRows(back)
    assert [a[i] for i in range(N)] == [b[i] for i in range(N)]
    check_table(back, out)


def test_open_arrow_damaged_file(tmp_path):
    out = tmp_path / "prompts.arrow"
    write_arrow(pa.table({"prompt": ["x"] * 1000}), out)
    data = out.read_bytes()
    out.write_bytes(data[: len(data) // 2])  # truncated copy
    with pytest.raises(DatasetError, match="prompts.arrow") as ei:
        open_arrow(out)
    assert "prepare it again" in str(ei.value)
    with pytest.raises(DatasetError, match="nothing.arrow"):
        open_arrow(tmp_path / "nothing.arrow")


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(field)


def _mapping_of(path: str) -> list[tuple[int, int]]:
    spans = []
    with open("/proc/self/maps") as fh:
        for line in fh:
            if line.rstrip().endswith(path):
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                spans.append((lo, hi))
    return spans


def test_open_arrow_is_memory_mapped(tmp_path):
    n = 200_000
    rng = np.random.default_rng(0)
    body = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. " * 2
    prompts = pa.array([f"{i}: {body}" for i in range(n)])
    answers = pa.array(rng.integers(0, 1000, n))
    path = tmp_path / "big.arrow"
    write_arrow(pa.table({"prompt": prompts, "answer": answers}), path)
    del prompts, answers
    size = path.stat().st_size
    assert size > 40e6

    rss0 = _status_kb("VmRSS") * 1024
    table = open_arrow(path)
    rss_open = _status_kb("VmRSS") * 1024 - rss0
    # The strings' data buffer lies inside this process's mapping of the file: zero copy.
    spans = _mapping_of(str(path.resolve()))
    assert spans, "the file is not mapped"
    addr = table.column("prompt").chunk(0).buffers()[2].address
    assert any(lo <= addr < hi for lo, hi in spans)
    assert rss_open < size / 10, (rss_open, size)

    anon0 = _status_kb("RssAnon") * 1024
    rows = PromptRows(table)
    picks = rng.integers(0, n, 1000)
    got = [rows[int(i)] for i in picks]
    assert all(p.text.startswith(f"{i}: ") for p, i in zip(got, picks))
    anon = _status_kb("RssAnon") * 1024 - anon0
    assert anon < size / 5, (anon, size)  # private memory: the rows read, not the file


def test_epoch_shuffled(tmp_path):
    n = 50
    table = pa.table({"prompt": [f"p{i}" for i in range(n)], "answer": list(range(n))})
    rows = PromptRows(table)
    s = EpochShuffled(rows, seed=7)
    assert s.n == n and not hasattr(s, "__len__")
    ep0 = [s[i].meta["row"] for i in range(n)]
    ep1 = [s[i].meta["row"] for i in range(n, 2 * n)]
    assert sorted(ep0) == list(range(n)) and sorted(ep1) == list(range(n))  # each row once per epoch
    assert ep0 != ep1 and ep0 != list(range(n))
    assert s[n + 3].meta["epoch"] == 1 and s[3].meta["epoch"] == 0
    assert s[5].answer == int(s[5].text[1:])
    same = EpochShuffled(PromptRows(table), seed=7)
    assert [same[i].meta["row"] for i in reversed(range(2 * n))] == list(reversed(ep0 + ep1))  # any access order
    other = EpochShuffled(rows, seed=8)
    assert [other[i].meta["row"] for i in range(n)] != ep0
    assert s.cursor(0) == (0, 0) and s.cursor(n - 1) == (0, n - 1) and s.cursor(2 * n + 5) == (2, 5)
    with pytest.raises(IndexError):
        s[-1]
    plain = EpochShuffled(rows, seed=7, shuffle=False)
    assert [plain[i].meta["row"] for i in range(n, n + 5)] == [0, 1, 2, 3, 4]
    # over a split: positions index the subset, meta["row"] the table
    train, val = split_rows(n, 0.2, seed=1)
    t = EpochShuffled(PromptRows(table, indices=train), seed=3)
    assert t.n == len(train) and sorted(t[i].meta["row"] for i in range(t.n)) == train.tolist()


def test_split_rows():
    train, val = split_rows(1000, 0.1, seed=5)
    assert len(val) == 100 and len(train) == 900
    assert not set(train.tolist()) & set(val.tolist())
    assert np.array_equal(np.sort(np.concatenate([train, val])), np.arange(1000))
    assert np.all(np.diff(train) > 0) and np.all(np.diff(val) > 0)
    again = split_rows(1000, 0.1, seed=5)
    assert np.array_equal(again[0], train) and np.array_equal(again[1], val)
    assert not np.array_equal(split_rows(1000, 0.1, seed=6)[1], val)
    assert len(split_rows(10, 0.0, seed=0)[1]) == 0
    assert [len(x) for x in split_rows(10, 0.01, seed=0)] == [9, 1]  # at least one validation row
    assert [len(x) for x in split_rows(2, 0.9, seed=0)] == [1, 1]  # at least one training row
    with pytest.raises(UserError):
        split_rows(10, 1.0, seed=0)


# ---------------------------------------------------------------------------------------------------------------
# Errors: each names the file


def _error(path, fn=None) -> str:
    with pytest.raises(DatasetError) as ei:
        if fn is None:
            check_table(read_table(path), path)
        else:
            fn()
    msg = str(ei.value)
    assert str(path) in msg, msg
    assert isinstance(ei.value, UserError)
    return msg


def test_error_missing_file(tmp_path):
    msg = _error(tmp_path / "nope.jsonl")
    assert "does not exist" in msg


def test_error_unknown_extension(tmp_path):
    p = tmp_path / "data.csv"
    p.write_text("prompt,answer\n1+1,2\n")
    msg = _error(p)
    assert ".csv" in msg and ".parquet" in msg


def test_error_missing_prompt_key(tmp_path):
    p = tmp_path / "gsm.jsonl"
    p.write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    msg = _error(p)
    assert "'prompt'" in msg and "question, answer" in msg and "prompt_key" in msg
    check_table(read_table(p), p, prompt_key="question")
    msg = _error(p, lambda: check_table(read_table(p), p, prompt_key="question", answer_key="solution"))
    assert "'solution'" in msg and "question, answer" in msg
    check_table(read_table(p), p, prompt_key="question", answer_key="solution", require_answer=False)


@pytest.mark.parametrize("content", ["", "\n\n", "[]"])
def test_error_empty_file(tmp_path, content):
    p = tmp_path / ("empty.json" if content == "[]" else "empty.jsonl")
    p.write_text(content)
    assert "no rows" in _error(p)


def test_error_empty_parquet(tmp_path):
    p = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), p)
    assert "no rows" in _error(p)


@pytest.mark.parametrize("fmt", ["jsonl", "json_array"])
def test_error_number_prompt_in_row_3(tmp_path, fmt):
    recs = records("str", "str")
    recs[3]["prompt"] = 17
    msg = _error(write_format(fmt, recs, tmp_path))
    assert "row 3" in msg and "'prompt'" in msg and "17" in msg


def test_error_prompt_column_of_numbers_and_nulls(tmp_path):
    p = tmp_path / "nums.parquet"
    pq.write_table(pa.table({"prompt": [None, 5, 6], "answer": ["a", "b", "c"]}), p)
    msg = _error(p)
    assert "row 1" in msg and "5" in msg and "int64" in msg
    p = tmp_path / "nulls.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b", "c", None], "answer": ["a", "b", "c", "d"]}), p)
    assert "row 3" in _error(p)


def test_error_chat_message_without_content(tmp_path):
    recs = records("chat", "str")
    recs[2]["prompt"] = [{"role": "system", "content": "s"}, {"role": "user"}]
    for fmt in ("jsonl", "parquet"):
        msg = _error(write_format(fmt, recs, tmp_path))
        assert "row 2 message 1" in msg and "'content'" in msg


def test_error_chat_structure(tmp_path):
    def chat_file(name, prompt_of_row_1):
        recs = records("chat", "str")
        recs[1]["prompt"] = prompt_of_row_1
        p = tmp_path / name
        p.write_text("".join(json.dumps(r) + "\n" for r in recs))
        return p

    msg = _error(chat_file("role.jsonl", [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]))
    assert "row 1 message 1" in msg and "'robot'" in msg
    msg = _error(chat_file("nouser.jsonl", [{"role": "system", "content": "a"}]))
    assert "row 1" in msg and "no user message" in msg
    msg = _error(chat_file("emptylist.jsonl", []))
    assert "row 1" in msg and "empty message list" in msg
    p = tmp_path / "norole.jsonl"
    p.write_text(json.dumps({"prompt": [{"content": "x"}], "answer": "1"}) + "\n")
    assert "'role'" in _error(p)


def test_error_answer_of_dicts(tmp_path):
    recs = records("str", "str")
    for r in recs:
        r["answer"] = {"value": r["answer"], "unit": "apples"}
    msg = _error(write_format("jsonl", recs, tmp_path))
    assert "row 0" in msg and "'answer'" in msg and "apples" in msg


def test_answers_lists_numbers_and_nulls(tmp_path):
    p = tmp_path / "lists.jsonl"
    p.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": [str(i), f"{i}.0"]}) + "\n" for i in range(3)))
    check_table(read_table(p), p)
    assert PromptRows(read_table(p))[2].answer == ["2", "2.0"]
    p = tmp_path / "floats.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": [1.5, 2.0]}), p)
    check_table(read_table(p), p)
    p = tmp_path / "null.jsonl"
    p.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": None if i == 2 else "x"}) + "\n" for i in range(4)))
    msg = _error(p)
    assert "row 2" in msg and "no answer" in msg
    check_table(read_table(p), p, require_answer=False)
    assert PromptRows(read_table(p))[2].answer is None


def test_error_bad_json_line_and_mixed_answers(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": \n')
    assert "line 2" in _error(p)
    p = tmp_path / "mixed.jsonl"
    p.write_text('{"prompt": "a", "answer": "x"}\n{"prompt": "b", "answer": 7}\n')
    msg = _error(p)
    assert "row 1" in msg and "'answer'" in msg and "as strings" in msg
    p = tmp_path / "notobj.json"
    p.write_text('["just a string"]')
    assert "row 0" in _error(p)


def test_error_dataset_dict_directory(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list(records("str", "int"))
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(tmp_path / "dd"))
    msg = _error(tmp_path / "dd")
    assert "DatasetDict" in msg and str(tmp_path / "dd" / "train") in msg
    table = read_table(tmp_path / "dd" / "test")
    assert table.num_rows == N


def test_error_directory_without_data(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "README.md").write_text("hi")
    assert "no state.json" in _error(tmp_path / "d")


def test_epoch_permutation_is_the_documented_one():
    rows = PromptRows(pa.table({"prompt": [str(i) for i in range(97)]}))
    s = EpochShuffled(rows, seed=11)
    for epoch in (0, 1, 5):
        want = np.random.default_rng([11, epoch]).permutation(97)
        assert [s[epoch * 97 + k].meta["row"] for k in range(97)] == want.tolist()


def test_date_like_strings_stay_strings(tmp_path):
    p = tmp_path / "dates.jsonl"
    p.write_text(
        json.dumps({"prompt": "2021-01-01", "answer": "2021-01-01 10:00:00", "when": "1999-12-31"})
        + "\n"
        + json.dumps({"prompt": "b", "answer": "1999-12-31", "when": "2000-01-01"})
        + "\n"
    )
    table = read_table(p)
    check_table(table, p)
    first = PromptRows(table)[0]
    assert first.text == "2021-01-01" and first.answer == "2021-01-01 10:00:00" and first.meta["when"] == "1999-12-31"
