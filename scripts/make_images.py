"""Generate the shipped image set (calibration/images/): simple scenes drawn with PIL, each with its caption.

Vision-language calibration, image-prompt evaluation and the image smoke test need images that can be shipped
and reproduced: no photograph's licence to track, nothing downloaded. Each scene is a few coloured shapes on a
plain or gradient background, with a caption saying what is drawn (the question and answer the prompts use).
Run from the project root: ``python scripts/make_images.py``; the same script writes the same bytes (no
randomness outside the fixed seed; PNG without timestamps).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from PIL import Image, ImageDraw

OUT = Path(__file__).resolve().parents[1] / "calibration" / "images"
SIZE = 224
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (235, 200, 30),
           "purple": (140, 60, 180), "orange": (240, 130, 30), "black": (20, 20, 20), "white": (245, 245, 245)}
SHAPES = ("circle", "square", "triangle")
COUNT = 8


def _draw(draw: ImageDraw.ImageDraw, shape: str, box: tuple[int, int, int, int], colour: tuple[int, int, int]) -> None:
    x0, y0, x1, y1 = box
    if shape == "circle":
        draw.ellipse(box, fill=colour)
    elif shape == "square":
        draw.rectangle(box, fill=colour)
    else:
        draw.polygon([((x0 + x1) // 2, y0), (x1, y1), (x0, y1)], fill=colour)


def scene(index: int) -> tuple[Image.Image, str]:
    """Scene ``index``: its image and caption."""
    rng = random.Random(index)
    background = rng.choice(["white", "black", "blue", "yellow"])
    img = Image.new("RGB", (SIZE, SIZE), COLOURS[background])
    draw = ImageDraw.Draw(img)
    things = []
    for _ in range(1 + index % 3):
        shape = rng.choice(SHAPES)
        colour = rng.choice([c for c in COLOURS if c != background])
        size = rng.randint(50, 100)
        x, y = rng.randint(0, SIZE - size), rng.randint(0, SIZE - size)
        _draw(draw, shape, (x, y, x + size, y + size), COLOURS[colour])
        things.append(f"{'an' if colour[0] in 'aeiou' else 'a'} {colour} {shape}")
    listed = things[0] if len(things) == 1 else ", ".join(things[:-1]) + " and " + things[-1]
    return img, f"{listed.capitalize()} on a {background} background."


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    captions = {}
    for i in range(COUNT):
        img, caption = scene(i)
        name = f"scene-{i:02d}.png"
        img.save(OUT / name, optimize=True)
        captions[name] = caption
    (OUT / "captions.json").write_text(json.dumps(captions, indent=2) + "\n")


if __name__ == "__main__":
    main()
