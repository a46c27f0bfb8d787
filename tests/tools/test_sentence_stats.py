"""tools/docs/sentence_stats.py on a fixed text whose sentences were counted by hand."""

from __future__ import annotations

import json

from tools.docs import sentence_stats

LONG = " ".join(["word"] * 61) + "."  # one sentence of 61 words

TEXT = f"""# A heading of five words

The first sentence has six words. The second one; with a semicolon, has eight.
See [the training guide](docs/guides/training.md) for more, e.g. the flags.

```bash
mmfast-train --data a very long command line that would be many words if it counted. Two. Three.
```

| a table | of words that never count |
| --- | --- |
| cell one. cell two. | cell three; four |

- `mmfast-train --epochs 2; echo done.` trains it
- A list item without a full stop

Back at the margin.

    an indented code block. with. full. stops.

<!-- skip: next "a comment of many words. with stops." -->
![an image's alt text. with a stop.](docs/img/x.png)

{LONG}
"""
# the sentences, by hand (words):
#   "The first sentence has six words."                                        6
#   "The second one; with a semicolon, has eight."                             8
#   "See the training guide for more, e.g. the flags."                         9
#   "CODE trains it" (the inline code is one word)                             3
#   "A list item without a full stop"                                          7
#   "Back at the margin." (it ends the list: the indented block after it is code)   4
#   the long one                                                              61
WORDS = [6, 8, 9, 3, 7, 4, 61]


def test_only_prose_is_counted_and_each_sentence_has_its_words():
    found = sentence_stats.sentences(TEXT, "t.md")
    assert [s.words for s in found] == WORDS
    assert found[0].text == "The first sentence has six words."
    assert found[2].text == "See the training guide for more, e.g. the flags."
    assert [s.line for s in found[:4]] == [3, 3, 4, 14]


def test_the_figures_of_the_fixed_text():
    figures = sentence_stats.stats(sentence_stats.sentences(TEXT))
    assert figures == {
        "sentences": 7,
        "words": 98,
        "mean_words": 14.0,  # 98 / 7
        "over_60": 1,
        "semicolons_per_100_words": 1.02,  # the one in prose (code and tables excluded): 100 / 98
    }


def test_main_prints_the_table_writes_json_and_checks_the_targets(tmp_path, capsys):
    page = tmp_path / "guides" / "page.md"
    page.parent.mkdir()
    page.write_text(TEXT)
    out = tmp_path / "stats.json"
    assert sentence_stats.main([str(tmp_path / "guides"), "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "page.md" in table and table.splitlines()[-1].split()[:3] == ["total", "7", "98"]
    assert json.loads(out.read_text())["total"]["over_60"] == 1
    assert sentence_stats.main([str(page), "--check", "--show-long"]) == 1  # a sentence over 60 words
    assert "page.md:24: 61 words" in capsys.readouterr().out
    page.write_text(TEXT.replace(LONG, "A short end."))
    assert sentence_stats.main([str(page), "--check"]) == 0
