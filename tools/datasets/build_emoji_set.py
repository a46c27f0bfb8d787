"""Build a real captioned image set from Debian's Noto Color Emoji font and the Unicode emoji list.

    python tools/datasets/build_emoji_set.py OUT_DIR [--size 96]

Writes OUT_DIR/manifest.jsonl ({"image", "text", "label", "subgroup"}) and OUT_DIR/img/<group>/<code>.png:
~1,870 emoji (skin-tone variants left out) rendered by Noto Color Emoji (Apache-2.0 images, OFL font) on a
white background; the caption is the emoji's official Unicode name ("grinning face", "mantelpiece clock";
flags by their country alone: "Spain", so the caption does not give the label away), the label its Unicode
group (9: Smileys & Emotion, People & Body, Animals & Nature, Food & Drink, Travel & Places, Activities,
Objects, Symbols, Flags). Neither modality alone decides every label: names of unseen countries say
nothing, many objects and symbols look alike. Needs `apt-get download` (runs `apt-get update` if needed).
For development and benchmarks; tests do not depend on it.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

PACKAGES = ("fonts-noto-color-emoji", "unicode-data")
FONT = "usr/share/fonts/truetype/noto/NotoColorEmoji.ttf"
EMOJI_TEST = "usr/share/unicode/emoji/emoji-test.txt"
ENTRY = re.compile(r"^([0-9A-F ]+);\s*fully-qualified\s*#\s*(\S+)\s+E([\d.]+)\s+(.*)$")
FONT_PX = 109  # the one size the font's colour bitmaps come in


def _download(tmp: Path) -> Path:
    for pkg in PACKAGES:
        if subprocess.run(["apt-get", "download", pkg], cwd=tmp).returncode != 0:
            subprocess.run(["apt-get", "update", "-qq"], check=True)  # a fresh machine may lack the lists
            subprocess.run(["apt-get", "download", pkg], cwd=tmp, check=True)
    root = tmp / "x"
    for deb in tmp.glob("*.deb"):
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    return root


def _entries(emoji_test: Path) -> list[dict]:
    rows, group, sub = [], None, None
    for line in emoji_test.read_text(encoding="utf-8").splitlines():
        if line.startswith("# group:"):
            group = line.split(":", 1)[1].strip()
        elif line.startswith("# subgroup:"):
            sub = line.split(":", 1)[1].strip()
        elif m := ENTRY.match(line):
            name = m.group(4)
            if "skin tone" in name or group == "Component":
                continue
            rows.append(
                {
                    "code": m.group(1).strip().replace(" ", "-"),
                    "char": m.group(2),
                    "name": name,
                    "group": group,
                    "subgroup": sub,
                }
            )
    return rows


def _caption(name: str) -> str:
    name = re.sub(r"^flag:\s*", "", name)  # "flag: Spain" -> "Spain"
    return " ".join(name.replace(":", " ").replace("\u201c", "").replace("\u201d", "").split())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--size", type=int, default=96, help="side of the square PNGs")
    a = p.parse_args(argv)
    from PIL import Image, ImageDraw, ImageFont

    out = Path(a.out)
    if (out / "manifest.jsonl").exists():
        print(f"{out}/manifest.jsonl exists")
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = _download(Path(tmp))
        font = ImageFont.truetype(str(root / FONT), FONT_PX)
        for e in _entries(root / EMOJI_TEST):
            canvas = Image.new("RGBA", (6 * FONT_PX, 160), (0, 0, 0, 0))
            ImageDraw.Draw(canvas).text((0, 0), e["char"], font=font, embedded_color=True)
            box = canvas.getbbox()
            if box is None or box[2] - box[0] > 140:  # not in this font: blank, or drawn as several glyphs
                continue
            glyph = canvas.crop(box)
            tile = Image.new("RGB", (128, 128), "white")
            tile.paste(glyph, ((128 - glyph.width) // 2, (128 - glyph.height) // 2), glyph)
            slug = re.sub(r"[^a-z0-9]+", "-", e["group"].lower()).strip("-")
            dst = out / "img" / slug / f"{e['code']}.png"
            dst.parent.mkdir(parents=True, exist_ok=True)
            tile.resize((a.size, a.size), Image.LANCZOS).save(dst)
            rows.append(
                {
                    "image": f"img/{slug}/{e['code']}.png",
                    "text": _caption(e["name"]),
                    "label": e["group"],
                    "subgroup": e["subgroup"],
                }
            )
    with open(out / "manifest.jsonl", "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    counts = Counter(r["label"] for r in rows)
    print(f"{len(rows)} emoji in {len(counts)} groups -> {out}/manifest.jsonl")
    for label, n in counts.most_common():
        print(f"  {label:<20}{n:>5}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
