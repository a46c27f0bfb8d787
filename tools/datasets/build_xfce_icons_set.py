"""Build a real captioned image set from Debian's elementary-xfce icon theme.

    python tools/datasets/build_xfce_icons_set.py OUT_DIR

Writes OUT_DIR/manifest.jsonl ({"image", "text", "label"}) and OUT_DIR/img/<category>/<name>.png: ~620 icons of
the package elementary-xfce-icon-theme (GPL-2+, some CC-BY-SA-2.0 and LGPL-2+: see the package's copyright
file), each at the largest size the theme draws it (48 to 128 px, RGBA). The caption is the icon's name in words
("document-import" -> "document import"), the label its category (10: actions, apps, categories, devices,
emblems, mimes, notifications, panel, places, status). Aliases (symlinks) and the animations' sprite sheets are
left out. Another artist's icons than the Oxygen set's, under freedesktop names, many the same. Needs
`apt-get download` (runs `apt-get update` if needed). For development and benchmarks; tests do not depend on it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

PACKAGE = "elementary-xfce-icon-theme"
THEME = "usr/share/icons/elementary-xfce"
SIZES = ("128", "96", "64", "48")  # the largest one an icon has is kept
LEFT_OUT = ("animations",)  # sprite sheets of spinners, not pictures


def _download(tmp: Path) -> Path:
    if subprocess.run(["apt-get", "download", PACKAGE], cwd=tmp).returncode != 0:
        subprocess.run(["apt-get", "update", "-qq"], check=True)  # a fresh machine may lack the lists
        subprocess.run(["apt-get", "download", PACKAGE], cwd=tmp, check=True)
    root = tmp / "x"
    subprocess.run(["dpkg-deb", "-x", str(next(tmp.glob("*.deb"))), str(root)], check=True)
    return root / THEME


def _icons(theme: Path) -> dict[tuple[str, str], Path]:
    """(category, name) -> the largest drawn (not aliased) PNG of that icon."""
    found: dict[tuple[str, str], Path] = {}
    for size in reversed(SIZES):  # larger sizes overwrite smaller ones
        for png in sorted(theme.glob(f"*/{size}/*.png")):
            category = png.parent.parent.name
            if not png.is_symlink() and category not in LEFT_OUT:
                found[(category, png.stem)] = png
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    a = p.parse_args(argv)
    out = Path(a.out)
    if (out / "manifest.jsonl").exists():
        print(f"{out}/manifest.jsonl exists")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        icons = _icons(_download(Path(tmp)))
        rows = []
        for (category, name), png in sorted(icons.items()):
            target = out / "img" / category / f"{name}.png"
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(png, target)
            caption = " ".join(name.replace("-", " ").replace("_", " ").split())
            rows.append({"image": f"img/{category}/{name}.png", "text": caption, "label": category})
    tmp_manifest = out / "manifest.jsonl.tmp"
    tmp_manifest.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    tmp_manifest.replace(out / "manifest.jsonl")  # last: a stopped build leaves no manifest
    counts = Counter(r["label"] for r in rows)
    by_label = dict(sorted(counts.items()))
    print(f"{len(rows)} icons in {len(counts)} categories -> {out}/manifest.jsonl ({by_label})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
