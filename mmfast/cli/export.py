"""Export a trained model directory to ONNX, a torch.export program, an open_clip model directory or Hugging
Face model directories, and check the ONNX file in onnxruntime (fp32 logits within --atol of PyTorch's).

    mmfast-export --model runs/latest/model --out runs/latest/export --format all

Writes OUT/model.onnx and OUT/model.pt2 (inputs: image (B, 3, S, S) float32 normalized as the model's
config.json says, input_ids and attention_mask (B, L) int64; output: logits (B, C)) and OUT/export.json.
A dual encoder (--model clip) is written as its two towers: OUT/image.onnx (image -> embedding (B, D)) and
OUT/text.onnx (input_ids, attention_mask -> embedding (B, D)), normalized; OUT/image.pt2 and OUT/text.pt2.
--format open_clip writes OUT/open_clip (``open_clip.create_model_and_transforms("local-dir:OUT/open_clip")``),
--format hf writes OUT/hf/image and OUT/hf/text (transformers, timm, sentence-transformers); a tower the
library cannot build is refused before anything is written, naming it and the formats that hold it (--format
all leaves that format out, naming it and why). Exporting again into OUT replaces the formats it writes; the
same model's others stay, and another model's are removed, so no other model's files stay beside these.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from mmfast.cli import Parser, summary_of, write_failure
from mmfast.util.fsutil import (
    MARKER,
    OutputError,
    atomic_write_json,
    claim_output_dir,
    file_sha256,
    is_replaceable,
    read_json_object,
    remove_ours,
    write_marker,
)
from mmfast.util.locks import file_lock
from mmfast.util.voice import command_line

FORMATS = ("onnx", "torch", "open_clip", "hf")
PEERS = ("open_clip", "hf")
FORMAT_KEYS = ("onnx", "torch_export", *PEERS)  # export.json's entries naming what an export wrote
# what an export writes in OUT beside export.json: the only names a later export removes
OUTPUTS = frozenset({"model.onnx", "model.pt2", "image.onnx", "text.onnx", "image.pt2", "text.pt2", *PEERS})
_ALIASES = {"both": ("onnx", "torch"), "all": FORMATS}


def formats(value: str) -> tuple[str, ...]:
    """--format's names, in FORMATS order."""
    names = set()
    for name in (n.strip() for n in value.split(",") if n.strip()):
        if name not in (*FORMATS, *_ALIASES):
            known = ", ".join((*FORMATS, *_ALIASES))
            raise argparse.ArgumentTypeError(f"unknown format '{name}'; choose from {known}")
        names.update(_ALIASES.get(name, (name,)))
    if not names:
        raise argparse.ArgumentTypeError("name at least one format")
    return tuple(f for f in FORMATS if f in names)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = Parser(description=summary_of(__doc__))
    p.add_argument("--model", required=True, help="a model directory written by mmfast-train (RUN/model)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument(
        "--format",
        default="both",
        help=f"comma-separated: {', '.join(FORMATS)}; both: onnx,torch; all: every one that can hold the model, "
        "the others named and left out (default: both)",
    )
    p.add_argument("--opset", type=int, default=17, help="the ONNX opset (default: 17)")
    p.add_argument(
        "--atol", type=float, default=1e-4, help="largest allowed |onnxruntime - PyTorch| output (default: 1e-4)"
    )
    p.add_argument("--no-check", action="store_true", help="skip the onnxruntime parity check")
    args = p.parse_args(argv)
    args.every = "all" in (n.strip() for n in args.format.split(","))  # a refused format is left out, not fatal
    try:
        args.format = formats(args.format)
    except argparse.ArgumentTypeError as e:
        p.error(f"argument --format: {e}")
    return args


@command_line
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from mmfast.infer.model_dir import load_model  # torch: imported when the command runs, so --help stays light

    try:
        model = load_model(args.model)
    except (ValueError, FileNotFoundError) as e:  # a model directory that cannot be used (ModelDirError)
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:  # a refused tower: before anything is written
        peers, left_out = peer_writers(model, args.format, Path(args.out), every=args.every)
    except ValueError as e:  # FormatRefusal
        print(f"error: {e}", file=sys.stderr)
        return 2
    for name, why in left_out.items():
        print(f"note: --format all leaves out {name}: {why}")
    if "zero_shot_map" in model.config:  # mmfast's own (models/prompt_map.py): no exported format holds it
        print(
            "note: the model's zero-shot map (--zero-shot-map) is not exported: zero-shot with the exported "
            "model scores its own embeddings alone; mmfast-predict --classes on the model directory uses both"
        )
    with _removed_unless_written(Path(args.out)):
        return _claim_and_export(model, args, peers, left_out)


@contextlib.contextmanager
def _removed_unless_written(out: Path) -> Iterator[None]:
    """A new --out that a failed export left holding only mmfast's marker is removed: no empty folder stays."""
    new = not os.path.lexists(out)
    try:
        yield
    finally:
        if new and out.is_dir() and [p.name for p in out.iterdir()] == [MARKER]:
            (out / MARKER).unlink()
            out.rmdir()


def _claim_and_export(model, args: argparse.Namespace, peers: dict, left_out: dict) -> int:
    try:
        claim_output_dir(args.out, "export")  # a folder of the user's is refused, never written into
        return export(model, args, peers, left_out)
    except OutputError as e:
        print(f"error: {e}", file=sys.stderr)
    except ImportError as e:  # onnx / onnxruntime: the export extra
        print(
            f"error: {e.name or e} is not installed: pip install 'mmfast[export]', or --format torch",
            file=sys.stderr,
        )
    except OSError as e:
        print(f"error: {write_failure(args.out, e)}", file=sys.stderr)
    return 2


def peer_writers(model, names: tuple[str, ...], out: Path, every: bool = False) -> tuple[dict, dict]:
    """({format: a function writing it}, {format: why it was left out}) for the peer libraries' formats asked
    for, each checked first. ``every`` (--format all): a format that cannot hold the model is left out.

    Raises:
        FormatRefusal: the model, or a tower of it, is not one the format's library builds (not ``every``).
    """
    from mmfast.infer.peer_towers import FormatRefusal  # torch: imported when the command runs

    writers, left_out = {}, {}
    for name in (n for n in names if n in ("open_clip", "hf")):
        try:
            writers[name] = _checked_writer(model, name, out)
        except FormatRefusal as e:
            if not every:
                raise
            left_out[name] = str(e)
    return writers, left_out


def _checked_writer(model, name: str, out: Path):
    """The writer of a peer format (open_clip, hf), once the model is checked to fit it (FormatRefusal)."""
    if name == "open_clip":
        # torch: imported when the command runs, and each library's code only when its format is asked for
        from mmfast.infer.export_open_clip import open_clip_config, write_open_clip

        open_clip_config(model, out / "open_clip")
        return lambda m, dest, home: write_open_clip(m, dest, home=home)
    # torch: imported when the command runs, and each library's code only when its format is asked for
    from mmfast.infer.export_hf import hf_towers, write_hf

    hf_towers(model)
    return lambda m, dest, home: write_hf(m, dest)


def export(model, args: argparse.Namespace, peers: dict | None = None, left_out: dict | None = None) -> int:
    """Write the formats asked for and export.json (``left_out``: {format: why --format all left it out}); 1
    when the ONNX file's logits are off by more than --atol, and OUT as it was."""
    # torch: imported when the command runs, so --help stays light
    from mmfast.infer.export import export_onnx, export_program, onnx_parity

    out = Path(args.out)
    report: dict = {"model": str(Path(args.model).resolve()), "config": model.config}
    weights = _weights_sha256(Path(args.model))  # what tells a later export into OUT whether it is the same model
    if weights:
        report["weights_sha256"] = weights
    if left_out:
        report["left_out"] = left_out
    with staged_files(out) as stage:
        if model.embeds:
            if not export_towers(model, args, report, stage):
                return 1
        else:
            if "onnx" in args.format:
                report["onnx"] = str(
                    out.resolve() / export_onnx(model, stage / "model.onnx", opset=args.opset).name
                )
                if not args.no_check:
                    diff = onnx_parity(model, stage / "model.onnx")
                    report["onnx_max_abs_diff"] = diff
                    print(f"onnxruntime vs PyTorch: max |logit difference| {diff:.2e} (allowed {args.atol:.0e})")
                    if not diff <= args.atol:
                        print(
                            f"error: the ONNX model's logits differ by {diff:.2e} > {args.atol:.0e}",
                            file=sys.stderr,
                        )
                        return 1
            if "torch" in args.format:
                report["torch_export"] = str(out.resolve() / export_program(model, stage / "model.pt2").name)
        for name, write in (peers or {}).items():  # open_clip's config names the folder it will live in
            write(model, stage / name, out / name)
            report[name] = str(out.resolve() / name)
        move_into(out, stage, report)
    print(f"exported to {out}")
    return 0


def export_towers(model, args: argparse.Namespace, report: dict, stage: Path) -> bool:
    """A dual encoder's towers in the formats asked for, written into ``stage``; False when an ONNX tower's
    embeddings are off by more than --atol."""
    # torch: imported when the command runs, so --help stays light
    from mmfast.infer.export import export_towers_onnx, export_towers_program, towers_parity

    out = Path(args.out)
    if "onnx" in args.format:
        paths = export_towers_onnx(model, stage, opset=args.opset)
        report["onnx"] = {name: str(out.resolve() / p.name) for name, p in paths.items()}
        if not args.no_check:
            diffs = towers_parity(model, paths)
            report["onnx_max_abs_diff"] = diffs
            for name, diff in diffs.items():
                print(
                    f"{name} tower, onnxruntime vs PyTorch: max |difference| {diff:.2e} (allowed {args.atol:.0e})"
                )
            worst = max(diffs, key=diffs.get)
            if not diffs[worst] <= args.atol:
                print(
                    f"error: the ONNX {worst} tower differs by {diffs[worst]:.2e} > {args.atol:.0e}",
                    file=sys.stderr,
                )
                return False
    if "torch" in args.format:
        programs = export_towers_program(model, stage)
        report["torch_export"] = {name: str(out.resolve() / p.name) for name, p in programs.items()}
    return True


@contextlib.contextmanager
def staged_files(out: Path) -> Iterator[Path]:
    """A hidden folder in OUT, marked as mmfast's, that every format is written into (``move_into`` puts them
    in place), under OUT's export lock. It is removed at the end: a failed or killed
    export leaves OUT's earlier files as they were, never a half-written one, and the next export removes
    what a kill left."""
    with file_lock(out / ".export.lock"):
        for left in out.glob(".export-*.tmp"):
            if left.is_dir() and not left.is_symlink() and is_replaceable(left):
                remove_ours(left)
        stage = Path(tempfile.mkdtemp(prefix=".export-", suffix=".tmp", dir=out))
        try:
            write_marker(stage, "export")
            yield stage
        finally:
            remove_ours(stage)


def move_into(out: Path, stage: Path, report: dict) -> None:
    """Put the staged files and folders in place and write export.json. What the earlier export.json lists and
    this export did not write stays, and stays listed, when it is of the same weights and config; of another
    model, it is removed (its folders would be taken for this model's)."""
    earlier = read_json_object(out / "export.json")
    staged = [f for f in stage.iterdir() if f.name != MARKER]
    for f in staged:  # before anything moves
        if f.is_dir() and os.path.lexists(out / f.name) and not is_replaceable(out / f.name):
            raise OutputError(
                f"--out {out}: its {f.name} was not written by mmfast; move it away, or pass another --out"
            )
    (out / "export.json").unlink(missing_ok=True)  # a kill among the moves leaves no report of either export
    for f in staged:
        if f.is_dir() and (out / f.name).is_dir() and not (out / f.name).is_symlink():
            os.replace(out / f.name, stage / f".{f.name}.old")  # the earlier folder goes with the stage
        os.replace(f, out / f.name)
    plain = json.loads(json.dumps(report, default=str))
    same = "weights_sha256" in earlier and all(
        earlier.get(k) == plain.get(k) for k in ("weights_sha256", "config")
    )
    others = sorted(_written(earlier) - _written(report))
    if same:  # the same model's other formats stay, and stay listed
        carried = {k: earlier[k] for k in FORMAT_KEYS if k in earlier and k not in report}
        if "onnx" in carried and "onnx_max_abs_diff" in earlier:
            carried["onnx_max_abs_diff"] = earlier["onnx_max_abs_diff"]
        report.update(carried)
    else:
        removed = [n for n in others if _remove_output(out / n)]
        if removed:
            print(
                f"removed the earlier export's {', '.join(removed)}: another model's, which this export did not "
                "write"
            )
        if left := [n for n in others if n not in removed]:
            print(
                f"note: left {', '.join(left)} in {out}: listed by the earlier export.json, but not mmfast's "
                "files now"
            )
    atomic_write_json(out / "export.json", report)


def _remove_output(path: Path) -> bool:
    """Remove an earlier export's file or marked folder; False for anything else (left as it is)."""
    if path.is_file() and not path.is_symlink():
        path.unlink()
        return True
    if is_replaceable(path):
        remove_ours(path)
        return True
    return False


def _weights_sha256(model_dir: Path) -> str | None:
    """The weights' SHA-256: checksums.json's, which load_model has just checked against the file, else the
    file's own (a directory written before checksums); None without a weights file."""
    from mmfast.infer.model_dir import CHECKSUMS_FILE, WEIGHTS_FILE  # torch: imported when the command runs

    listed = read_json_object(model_dir / CHECKSUMS_FILE).get(WEIGHTS_FILE)
    if isinstance(listed, str):
        return listed
    weights = model_dir / WEIGHTS_FILE
    return file_sha256(weights) if weights.is_file() else None


def _written(report: dict) -> set[str]:
    """The names of the files and folders an export report (or export.json) lists as written."""
    names = set()
    for key in FORMAT_KEYS:
        value = report.get(key)
        paths = value.values() if isinstance(value, dict) else [value]
        names |= {Path(p).name for p in paths if isinstance(p, str)}
    return names & OUTPUTS


if __name__ == "__main__":
    sys.exit(main())
