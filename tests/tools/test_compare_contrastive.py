"""tools/experiments/compare_contrastive.py end to end (--quick) on a small real set, QUICK_ROWS Oxygen icons:
the two frozen-tower baselines and both dual-encoder recipes land in one table, their figures are percentages,
and the ridge map finds the right caption far more often than chance (ids and features kept in step)."""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from tools.experiments import compare_contrastive, compare_report

PRESET = "clip-lite0-minilm"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_compare_contrastive_quick_table_json_and_chart(tmp_path, capsys):
    builder = compare_contrastive.BUILDERS["icons"]
    if not builder.is_file():
        pytest.skip(f"the Oxygen icon builder {builder} is not here")
    build = subprocess.run([sys.executable, str(builder), str(tmp_path / "sets" / "icons")], capture_output=True)
    if build.returncode != 0:
        pytest.skip(f"cannot build the Oxygen icons (apt-get download): {build.stderr.decode()[-300:]}")
    out = tmp_path / "cmp"
    argv = [
        "--sets",
        "icons",
        "--quick",
        "--seeds",
        "3",
        "4",
        "--out",
        str(out),
        "--cache",
        str(tmp_path / "sets"),
        "--fuse-ridge",
        "0",
        "1",
    ]
    assert compare_contrastive.main(argv) == 0

    report = json.loads((out / "compare.json").read_text())
    assert report["limit"] == compare_contrastive.QUICK_ROWS and report["seeds"] == [3] and report["epochs"] == 1
    assert sum(report["sets"]["icons"]["counts"][s] for s in ("train", "val")) == compare_contrastive.QUICK_ROWS
    rows = {r["method"]: r for r in report["rows"]}
    fused = {f"{loss}+ridge{w}" for loss in ("clip", "siglip") for w in (0, 1)}
    assert set(rows) == set(compare_contrastive.METHODS) | fused
    runs = report["runs"]["icons"]
    for method in compare_contrastive.METHODS:
        assert len(runs[method]) == 1 and rows[method]["runs"] == 1
        for k in compare_report.FIGURES:
            assert 0.0 <= runs[method][0][k] <= 100.0, (method, k, runs[method][0][k])
            assert rows[method][k] == pytest.approx(runs[method][0][k])
    for loss in ("clip", "siglip"):
        run = out / "runs" / f"icons-{loss}-seed3"
        assert runs[loss][0]["seed"] == 3 and (run / "summary.json").is_file()
        assert not [p for p in ("checkpoints", "model", "model-last") if (run / p).exists()]  # no --keep-runs

    # every method is scored on the same val images; chance recall@k is k / images
    images = runs["ridge"][0]["images"]
    assert {runs[m][0]["images"] for m in compare_contrastive.METHODS} == {images}
    assert images >= 15
    ridge = runs["ridge"][0]
    for way in ("i2t", "t2i"):
        assert ridge[f"{way}_r10"] > 100.0 * 10 / images, (way, ridge)
        assert ridge[f"{way}_r1"] >= 3 * 100.0 / images, (way, ridge)
    # --fuse-ridge: weight 0 is the ridge map alone, to the figure; weight 1 the run's last model, as its own
    # evaluation scored it (fp32 here, the run's precision there: a caption or two may move)
    for loss in ("clip", "siglip"):
        alone, with_ridge = runs[f"{loss}+ridge0"][0], runs[f"{loss}+ridge1"][0]
        assert alone["images"] == with_ridge["images"] == images
        for k in compare_report.FIGURES:
            assert alone[k] == pytest.approx(ridge[k]), (loss, k)
            assert abs(with_ridge[k] - runs[loss][0][k]) <= 2 * 100.0 / images + 1e-6, (loss, k)
    assert (out / "compare.png").stat().st_size > 1000
    printed = capsys.readouterr().out
    assert all(f"icons     {m}" in printed for m in compare_contrastive.METHODS)


def test_the_inner_split_divides_the_train_split_and_never_holds_a_val_image(tmp_path, demo_manifest):
    """--inner: recipes are chosen on a fifth of the train split's images; val stays unseen."""
    cache = tmp_path / "sets"
    inner = compare_contrastive.prepared_set(str(demo_manifest), cache, PRESET, None, inner=True)
    outer = cache / "prepared" / f"{demo_manifest.parent.name}-minilm"
    assert inner != outer and (outer / "prepare.json").is_file()

    def images(folder, split):
        return {str((folder / r["image"]).resolve()) for r in compare_contrastive._read_jsonl(folder / split)}

    def captions(folder, split):
        names = {v: k for k, v in json.loads((folder / "labels.json").read_text()).items()}
        return sorted((r["text"], names[r["label"]]) for r in compare_contrastive._read_jsonl(folder / split))

    inner_train, inner_val = images(inner, "train.jsonl"), images(inner, "val.jsonl")
    assert inner_train | inner_val == images(outer, "train.jsonl")
    assert not inner_train & inner_val and not (inner_train | inner_val) & images(outer, "val.jsonl")
    assert 0.1 < len(inner_val) / len(inner_train | inner_val) < 0.3
    # every train row reaches the inner split with its caption and its label's name
    assert sorted(captions(inner, "train.jsonl") + captions(inner, "val.jsonl")) == captions(outer, "train.jsonl")
    # a second call reuses both preparations
    mtime = (inner / "prepare.json").stat().st_mtime_ns
    assert compare_contrastive.prepared_set(str(demo_manifest), cache, PRESET, None, inner=True) == inner
    assert (inner / "prepare.json").stat().st_mtime_ns == mtime

    # a set moved with its cache draws the same inner val (images keyed within the set, not by where it lies)
    drawn = []
    for where in ("a", "b/c"):
        shutil.copytree(demo_manifest.parent, tmp_path / where / "mine")
        manifest = tmp_path / where / "mine" / demo_manifest.name
        moved = compare_contrastive.prepared_set(str(manifest), tmp_path / where, PRESET, None, inner=True)
        drawn.append(sorted(Path(p).name for p in images(moved, "val.jsonl")))
    assert drawn[0] == drawn[1] and drawn[0]
    # a set prepared anew gets an inner split of its own, never the old one
    manifest, cache2 = tmp_path / "a" / "mine" / demo_manifest.name, tmp_path / "a"
    first = compare_contrastive.prepared_set(str(manifest), cache2, PRESET, None, inner=True)
    manifest.write_text("".join(line + "\n" for line in manifest.read_text().splitlines()[::2]))
    shutil.rmtree(cache2 / "prepared" / "mine-minilm")
    second = compare_contrastive.prepared_set(str(manifest), cache2, PRESET, None, inner=True)
    assert second != first and (first / "prepare.json").is_file()
    both = images(second, "train.jsonl") | images(second, "val.jsonl")
    assert both == images(cache2 / "prepared" / "mine-minilm", "train.jsonl") and len(both) < len(inner_train)
    # another --inner-seed draws another fifth of the same train split; seed 0 (the outer draw) is refused
    other = compare_contrastive.prepared_set(str(demo_manifest), cache, PRESET, None, inner=True, inner_seed=2)
    other_val = images(other, "val.jsonl")
    assert other_val != inner_val and other_val | images(other, "train.jsonl") == images(outer, "train.jsonl")
    with pytest.raises(ValueError, match="--inner-seed 0"):
        compare_contrastive.prepared_set(str(demo_manifest), cache, PRESET, None, inner=True, inner_seed=0)
    # --limit cannot shrink a set given prepared
    with pytest.raises(ValueError, match="--limit"):
        compare_contrastive.prepared_set(str(outer), cache, PRESET, 10, inner=True)


def test_a_comparison_on_an_inner_draw_names_its_seed(tmp_path, demo_manifest):
    """compare.json records the draw, and its set's label names it: runs of two draws never share a folder."""
    out = tmp_path / "cmp"
    argv = ["--sets", str(demo_manifest), "--inner", "--inner-seed", "2", "--methods", "ridge", "--quick"]
    assert compare_contrastive.main([*argv, "--out", str(out), "--cache", str(tmp_path / "sets")]) == 0
    report = json.loads((out / "compare.json").read_text())
    assert report["inner"] is True and report["inner_seed"] == [2]
    label = f"{demo_manifest.parent.name}-inner2"
    assert list(report["sets"]) == [label] and "-inner2-" in report["sets"][label]["prepared"]
    assert [r["method"] for r in report["rows"]] == ["ridge"]
    assert "across_draws" not in report  # one draw: nothing to average


def test_several_inner_draws_are_averaged_and_compared_draw_by_draw(tmp_path, demo_manifest, capsys):
    """--inner-seed 2 3 runs every method on both draws; the table across them averages each draw's figure, and
    a method's difference to --against is taken draw by draw (the unit test below tells pairings apart)."""
    out = tmp_path / "cmp"
    argv = ["--sets", str(demo_manifest), "--inner", "--inner-seed", "2", "3", "--methods", "ridge", "probe"]
    argv += ["--against", "ridge", "--quick", "--seeds", "0", "--out", str(out), "--cache", str(tmp_path / "sets")]
    assert compare_contrastive.main(argv) == 0
    report = json.loads((out / "compare.json").read_text())
    name = demo_manifest.parent.name
    assert report["inner_seed"] == [2, 3] and list(report["sets"]) == [f"{name}-inner2", f"{name}-inner3"]
    assert report["sets"][f"{name}-inner2"]["prepared"] != report["sets"][f"{name}-inner3"]["prepared"]
    rows = {(r["set"], r["method"]): r for r in report["rows"]}
    across = {r["method"]: r for r in report["across_draws"]}
    assert set(across) == {"ridge", "probe"} and all(r["set"] == name for r in across.values())
    for k in compare_report.ACROSS:
        per_draw = {
            d: rows[(f"{name}-inner{d}", "probe")][k] - rows[(f"{name}-inner{d}", "ridge")][k] for d in (2, 3)
        }
        assert across["probe"][k] == pytest.approx(
            (rows[(f"{name}-inner2", "probe")][k] + rows[(f"{name}-inner3", "probe")][k]) / 2
        )
        assert across["probe"][f"vs_{k}"] == pytest.approx(sum(per_draw.values()) / 2)
        assert across["probe"][f"vs_{k}_worst"] == pytest.approx(min(per_draw.values()))
    assert "vs_i2t_r1" not in across["ridge"]  # the reference is not compared with itself
    assert "across the inner draws" in capsys.readouterr().out


def _draw_row(label: str, method: str, i2t: float, t2i: float, zs: float) -> dict:
    return {"set": label, "method": method, "i2t_r1": i2t, "t2i_r1": t2i, "zero_shot_acc": zs}


def test_the_table_across_draws_pairs_each_draw_with_itself():
    """Made-up per-draw rows: the mean is over draws, the std across them; a method's difference to the reference
    is taken on each draw both ran (a method missing a draw is compared on the others only, not with the
    reference's mean over all of them); a set whose own name holds "-inner" keeps it; a row that is no draw
    (no -innerN) is left out."""
    rows = [
        _draw_row("a-inner-x-inner1", "clip", 30.0, 20.0, 50.0),
        _draw_row("a-inner-x-inner2", "clip", 10.0, 40.0, 20.0),
        _draw_row("a-inner-x-inner3", "clip", 40.0, 30.0, 40.0),
        _draw_row("a-inner-x-inner1", "new", 33.0, 18.0, 52.0),
        _draw_row("a-inner-x-inner2", "new", 14.0, 41.0, 21.0),  # no draw 3: it stopped early
        _draw_row("a-inner-x", "new", 99.0, 99.0, 99.0),  # val, not a draw
        _draw_row("b-inner2", "new", 1.0, 2.0, 3.0),  # a set without the reference
    ]
    across = {(r["set"], r["method"]): r for r in compare_report.across_draws(rows, "clip")}
    assert set(across) == {("a-inner-x", "clip"), ("a-inner-x", "new"), ("b", "new")}
    clip, new = across[("a-inner-x", "clip")], across[("a-inner-x", "new")]
    assert clip["draws"] == [1, 2, 3] and clip["i2t_r1"] == pytest.approx(80 / 3)
    assert clip["i2t_r1_std"] == pytest.approx(statistics.stdev([30.0, 10.0, 40.0]))
    assert "vs_i2t_r1" not in clip and "vs_i2t_r1" not in across[("b", "new")]
    assert new["draws"] == [1, 2] and new["vs_draws"] == [1, 2] and new["i2t_r1"] == pytest.approx(23.5)
    # paired: (33 - 30, 14 - 10) = (3, 4); against clip's mean over its 3 draws: 23.5 - 26.7 = -3.2
    assert new["vs_i2t_r1"] == pytest.approx(3.5) and new["vs_i2t_r1_worst"] == pytest.approx(3.0)
    assert new["vs_t2i_r1"] == pytest.approx(-0.5) and new["vs_t2i_r1_worst"] == pytest.approx(-2.0)
    assert new["vs_zero_shot_acc"] == pytest.approx(1.5) and new["vs_zero_shot_acc_worst"] == pytest.approx(1.0)
    # a pairing of draw 1 with draw 2 (and 2 with 1) would give (33 - 10, 14 - 30): worst -16, not 3
    assert new["vs_i2t_r1_worst"] > 0


def test_several_draws_need_inner_and_distinct_seeds(capsys):
    for argv, says in (
        (["--inner-seed", "1", "2"], "add --inner"),
        (["--inner", "--inner-seed", "2", "2"], "a draw named twice"),
        (["--inner", "--inner-seed", "0", "2"], "1 or more"),
        (["--inner", "--inner-seed", "1", "2", "--methods", "ridge"], "--against clip: not among --methods"),
        (["--fuse-ridge", "0.5", "1.5"], "--fuse-ridge: a weight lies in [0, 1]"),
    ):
        with pytest.raises(SystemExit):
            compare_contrastive.parse_args(argv)
        assert says in capsys.readouterr().err
