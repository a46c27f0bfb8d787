"""Every ```bash and ```python block of README.md and docs/guides/*.md runs (tests/docs_harness.py).

A page's blocks run in order in a fresh directory holding the fixture data that docs/contributing.md names
(captions.jsonl + images/, pairs.jsonl, photos/, shards/, query.jpg). ``<!-- skip: next "reason" -->``
skips the next block. Pages that train run in the slow lane. The tests below the page test run small pages
written here, to show the harness runs, fails and skips as it should."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from docs_harness import ROOT, page_env, run_page, trains
from sybil.example import SybilFailure

from tools.datasets.docs_examples import build_examples

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs" / "guides").glob("*.md"))]


@pytest.fixture(scope="session")
def docs_data(tmp_path_factory) -> Path:
    return build_examples(tmp_path_factory.mktemp("docs-data") / "data")


@pytest.fixture(scope="session")
def docs_env(tmp_path_factory) -> dict[str, str]:
    return page_env(tmp_path_factory.mktemp("docs-cache"))


def _page_param(path: Path):
    marks = [pytest.mark.slow] if trains(path) else []
    return pytest.param(path, id=path.relative_to(ROOT).as_posix(), marks=marks)


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("page", [_page_param(p) for p in PAGES])
def test_the_code_blocks_of_the_page_run(page, tmp_path, docs_data, docs_env):
    run = run_page(page, tmp_path / "work", docs_data, docs_env)
    print(f"{page.name}: seconds by block line {run.seconds}; skipped {run.skipped}")


def _write(tmp_path: Path, text: str, name: str = "page.md") -> Path:
    page = tmp_path / name
    page.write_text(textwrap.dedent(text).lstrip())
    return page


SAMPLE = """
# A sample page

```bash
test -f captions.jsonl && test -f pairs.jsonl && test -f query.jpg && test -f shards/00003.tar
ls photos | grep -q .
command -v mmfast-prepare
python -c "import mmfast, sys; print(mmfast.__file__)" > where.txt
echo made > made.txt
```

```python
import json
rows = [json.loads(line) for line in open("captions.jsonl")]
```

<!-- skip: next "needs a GPU" -->
```bash
exit 3
```

```text
not code: never run
```

```python
assert open("made.txt").read() == "made\\n"
assert len(rows) == 200 and set(rows[0]) == {"image", "text", "label"}
```
"""


def test_the_blocks_run_in_order_in_one_directory_and_a_skipped_one_does_not_run(tmp_path, docs_data, docs_env):
    page = _write(tmp_path, SAMPLE)
    run = run_page(page, tmp_path / "work", docs_data, docs_env)
    assert run.ran == [3, 11, 25]
    assert run.skipped == [(17, "needs a GPU")]
    assert (tmp_path / "work" / "where.txt").read_text().strip() == str(ROOT / "mmfast" / "__init__.py")


@pytest.mark.parametrize(
    "block",
    ["```bash\nfalse\necho never\n```", '```bash\necho "$NOT_SET"\n```', "```bash\nfalse | cat\n```"],
    ids=["exit-status", "unset-variable", "pipefail"],
)
def test_a_failing_bash_block_fails_the_page_naming_its_line(tmp_path, docs_data, docs_env, block):
    page = _write(tmp_path, f"# Page\n\n```bash\ntouch first\n```\n\n{block}\n\n```bash\ntouch after\n```\n")
    with pytest.raises(SybilFailure, match=r"line 7.*\n.*bash exited 1") as failure:
        run_page(page, tmp_path / "work", docs_data, docs_env)
    assert "page.md" in str(failure.value)
    assert (tmp_path / "work" / "first").exists() and not (tmp_path / "work" / "after").exists()


def test_a_failing_python_block_fails_with_its_traceback_at_the_page_line(tmp_path, docs_data, docs_env):
    page = _write(tmp_path, "# Page\n\n```python\nx = 1\n```\n\n```python\ny = x + 1\nraise ValueError(y)\n```\n")
    with pytest.raises(SybilFailure) as failure:
        run_page(page, tmp_path / "work", docs_data, docs_env)
    message = str(failure.value)
    assert "line 7" in message and "ValueError: 2" in message
    assert f'File "{page}", line 9' in message  # the raise, at its line in the page


@pytest.mark.parametrize("lang,source", [("bash", "sleep 60"), ("python", "import time\ntime.sleep(60)")])
def test_a_block_past_its_time_is_killed_and_fails(tmp_path, docs_data, docs_env, lang, source):
    page = _write(tmp_path, f"# Page\n\n```{lang}\nprint_me=1\n```\n\n```{lang}\n{source}\n```\n")
    with pytest.raises(SybilFailure, match="ran past 2 s"):
        run_page(page, tmp_path / "work", docs_data, docs_env, timeout_s=2)


def test_each_page_starts_from_fresh_fixture_data(tmp_path, docs_data, docs_env):
    first = _write(tmp_path, "# One\n\n```bash\nrm captions.jsonl\necho x > extra.txt\n```\n", "one.md")
    second = _write(tmp_path, "# Two\n\n```bash\ntest -f captions.jsonl\ntest ! -e extra.txt\n```\n", "two.md")
    run_page(first, tmp_path / "one", docs_data, docs_env)
    run_page(second, tmp_path / "two", docs_data, docs_env)
    assert (docs_data / "captions.jsonl").exists()


def test_a_page_that_trains_belongs_to_the_slow_lane(tmp_path):
    assert trains(_write(tmp_path, "# T\n\n```bash\nmmfast-train --data d --epochs 2\n```\n", "t.md"))
    assert not trains(_write(tmp_path, "# P\n\n```bash\nmmfast-prepare captions.jsonl --out d\n```\n", "p.md"))
