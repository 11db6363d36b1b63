"""Synthetic captioned scenes: the embedded default dataset (no download, renders in seconds).

1-4 coloured shapes per image on a 3x3 layout, five template captions each that are true of their image by
construction (attributes, counts, positions, relations), deterministic by seed. What the scenes hold and why
they are built that way: docs/data.md, 'The embedded synthetic scenes'.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw
from tqdm import tqdm

from itmatch.errors import ConfigError, DataError, refuse_overwrite
from itmatch.io import write_text_atomic

SYNTH_JSON = "dataset_synth.json"
IMAGES_SUBDIR = "images"
# Karpathy split names, as written in the JSON and in the file names; read back as train/dev/test.
SPLIT_CODES = {"train": 0, "val": 1, "test": 2}

SHAPES = ("circle", "square", "triangle", "star", "diamond")
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (215, 35, 35), "green": (35, 165, 60), "blue": (40, 80, 225), "yellow": (240, 215, 35),
    "purple": (135, 55, 190), "orange": (245, 135, 25), "white": (245, 245, 245), "black": (20, 20, 20),
}
SIZES = ("small", "large")
BACKGROUNDS = ("dark", "light")
TEXTURES = ("plain", "stripes", "mottled")
# Radius (fraction of the image side) of each size; a 3x3 cell has half-width 1/6 ~ 0.167.
RADIUS = {"small": (0.060, 0.075), "large": (0.120, 0.140)}
SUPERSAMPLE = 2  # shapes are drawn at 2x and box-filtered down: anti-aliased edges, exact interiors

NUMBERS = {1: "one", 2: "two", 3: "three", 4: "four"}
CELL_PHRASES = {
    (0, 0): "in the top left corner", (0, 1): "at the top", (0, 2): "in the top right corner",
    (1, 0): "on the left", (1, 1): "in the center", (1, 2): "on the right",
    (2, 0): "in the bottom left corner", (2, 1): "at the bottom", (2, 2): "in the bottom right corner",
}


@dataclass(frozen=True)
class SceneObject:
    """One shape. Geometry is in fractions of the image side so a scene renders at any size."""

    shape: str
    colour: str
    size: str
    row: int  # 0 top .. 2 bottom
    col: int  # 0 left .. 2 right
    cx: float
    cy: float
    radius: float
    rgb: tuple[int, int, int]


@dataclass(frozen=True)
class Scene:
    objects: tuple[SceneObject, ...]
    background: str  # "dark" or "light" (mentioned in captions)
    texture: str  # "plain", "stripes" or "mottled" (nuisance: never mentioned)
    bg_rgb: tuple[int, int, int]


def _rng(seed: int, split: str, index: int, stream: int) -> np.random.Generator:
    """Independent stream per (seed, split, image, purpose): scene 0, captions 1, pixels 2."""
    return np.random.default_rng([seed, SPLIT_CODES[split], index, stream])


def _pick(rng: np.random.Generator, seq: tuple | list):
    return seq[int(rng.integers(len(seq)))]


def sample_scene(rng: np.random.Generator) -> Scene:
    """Draw a random scene: 1-4 objects in distinct cells. About a third of the objects repeat the
    colour and shape of an earlier one, so that counted phrases ("two red circles") are common."""
    n = int(rng.integers(1, 5))
    cells = rng.choice(9, size=n, replace=False)
    kinds: list[tuple[str, str]] = []
    objects = []
    for cell in cells:
        if kinds and rng.random() < 0.35:
            colour, shape = _pick(rng, kinds)
        else:
            colour, shape = _pick(rng, tuple(COLOURS)), _pick(rng, SHAPES)
        kinds.append((colour, shape))
        size = _pick(rng, SIZES)
        row, col = divmod(int(cell), 3)
        radius = float(rng.uniform(*RADIUS[size]))
        slack = 1 / 6 - radius - 0.012  # keep the shape inside its cell
        cx = (col + 0.5) / 3 + float(rng.uniform(-slack, slack))
        cy = (row + 0.5) / 3 + float(rng.uniform(-slack, slack))
        rgb = tuple(int(np.clip(v + rng.integers(-10, 11), 0, 255)) for v in COLOURS[colour])
        objects.append(SceneObject(shape, colour, size, row, col, cx, cy, radius, rgb))  # type: ignore[arg-type]
    objects.sort(key=lambda o: (o.row, o.col))  # reading order: captions list things as people would
    background = _pick(rng, BACKGROUNDS)
    level = int(rng.integers(60, 91)) if background == "dark" else int(rng.integers(165, 196))
    bg_rgb = tuple(int(np.clip(level + rng.integers(-8, 9), 0, 255)) for _ in range(3))
    return Scene(tuple(objects), background, _pick(rng, TEXTURES), bg_rgb)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------- captions

def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _thing(o: SceneObject, size: bool) -> str:
    words = ([o.size] if size else []) + [o.colour, o.shape]
    return f"{_article(words[0])} {' '.join(words)}"


def _counted(count: int, words: list[str], noun: str) -> str:
    """'a small red circle' / 'two red circles' / 'an object'."""
    if count == 1:
        first = (words + [noun])[0]
        return " ".join([_article(first), *words, noun])
    return " ".join([NUMBERS[count], *words, noun + "s"])


def _join(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _groups(objects: tuple[SceneObject, ...], key) -> list[list[SceneObject]]:
    out: dict = {}
    for o in objects:
        out.setdefault(key(o), []).append(o)
    return list(out.values())


def _inventory(scene: Scene, rng: np.random.Generator) -> list[str]:
    """Counted (colour, shape) groups; size is named when the whole group shares it."""
    items = []
    for g in _groups(scene.objects, lambda o: (o.colour, o.shape)):
        sizes = {o.size for o in g}
        words = ([g[0].size] if len(sizes) == 1 and rng.random() < 0.6 else []) + [g[0].colour]
        items.append(_counted(len(g), words, g[0].shape))
    return items


def _t_inventory(scene: Scene, rng: np.random.Generator) -> str | None:
    inv = _join(_inventory(scene, rng))
    first_plural = not inv.startswith(("a ", "an "))
    variant = int(rng.integers(5))
    if variant == 0:
        return inv
    if variant == 1:
        return f"{inv} on a {scene.background} background"
    if variant == 2:
        return f"there {'are' if first_plural else 'is'} {inv}"
    if variant == 3:
        return f"a picture of {inv}"
    return f"an image showing {inv} on a {scene.background} background"


def _t_shape_counts(scene: Scene, rng: np.random.Generator) -> str | None:
    n = len(scene.objects)
    noun = _pick(rng, ("shape", "object"))
    items = _join([_counted(len(g), [], g[0].shape) for g in _groups(scene.objects, lambda o: o.shape)])
    total = _counted(n, [], noun)
    variant = int(rng.integers(3))
    if n == 1:
        return (f"a single {scene.objects[0].shape} on a {scene.background} background" if variant < 2
                else f"only one {noun}, {items}")
    if variant == 0:
        return f"{total}: {items}"
    if variant == 1:
        return f"{items}, {total} in total"
    return f"{total} on a {scene.background} background"


def _t_colour_counts(scene: Scene, rng: np.random.Generator) -> str | None:
    noun = _pick(rng, ("shape", "object"))
    items = [_counted(len(g), [g[0].colour], noun) for g in _groups(scene.objects, lambda o: o.colour)]
    if int(rng.integers(2)) == 0:
        return _join(items)
    return f"there {'is' if items[0].startswith(('a ', 'an ')) else 'are'} {_join(items)}"


def _t_size_counts(scene: Scene, rng: np.random.Generator) -> str | None:
    if len(scene.objects) < 2:
        return None
    noun = _pick(rng, ("shape", "object"))
    items = [_counted(len(g), [g[0].size], noun) for g in _groups(scene.objects, lambda o: o.size)]
    if len(items) == 1:
        return f"{NUMBERS[len(scene.objects)]} {scene.objects[0].size} {noun}s"
    return _join(items)


def _t_position(scene: Scene, rng: np.random.Generator) -> str | None:
    objs = list(scene.objects)
    picked = [objs[i] for i in sorted(rng.choice(len(objs), size=min(len(objs), 2), replace=False))]
    if len(picked) == 2 and rng.random() < 0.5:
        a, b = picked
        return (f"{_thing(a, rng.random() < 0.5)} {CELL_PHRASES[(a.row, a.col)]} and "
                f"{_thing(b, rng.random() < 0.5)} {CELL_PHRASES[(b.row, b.col)]}")
    o = picked[0]
    where = CELL_PHRASES[(o.row, o.col)]
    if rng.random() < 0.5:
        return f"{_thing(o, True)} {where}"
    return f"{where} there is {_thing(o, rng.random() < 0.5)}"


def _t_relation(scene: Scene, rng: np.random.Generator, axis: str) -> str | None:
    objs = scene.objects
    if axis == "h":
        pairs = [(a, b) for a in objs for b in objs if a.col < b.col]
        before, after = "to the left of", "to the right of"
    else:
        pairs = [(a, b) for a in objs for b in objs if a.row < b.row]
        before, after = "above", "below"
    if not pairs:
        return None
    a, b = _pick(rng, pairs)  # a is left of / above b
    if rng.random() < 0.5:
        first, rel, second = a, before, b
    else:
        first, rel, second = b, after, a
    verb = "is " if rng.random() < 0.4 else ""
    return f"{_thing(first, rng.random() < 0.4)} {verb}{rel} {_thing(second, rng.random() < 0.4)}"


TEMPLATES = {
    "inventory": _t_inventory,
    "shape_counts": _t_shape_counts,
    "colour_counts": _t_colour_counts,
    "size_counts": _t_size_counts,
    "position": _t_position,
    "left_right": lambda s, r: _t_relation(s, r, "h"),
    "above_below": lambda s, r: _t_relation(s, r, "v"),
}


def _sentence(text: str) -> str:
    return text[0].upper() + text[1:] + "."


def describe_scene(scene: Scene, rng: np.random.Generator, n: int = 5) -> list[str]:
    """`n` different captions of `scene`, each from a different template where the scene allows it
    (a single object has no relations), so the five captions of an image are genuinely varied."""
    objs = scene.objects
    names = ["inventory", "shape_counts", "colour_counts", "position"]
    if len(objs) > 1:
        names.append("size_counts")
    if len({o.col for o in objs}) > 1:
        names.append("left_right")
    if len({o.row for o in objs}) > 1:
        names.append("above_below")
    order = [names[i] for i in rng.permutation(len(names))]
    captions: list[str] = []
    attempts = 0
    while len(captions) < n:
        name = order[len(captions)] if len(captions) < len(order) else _pick(rng, ("inventory", "position"))
        text = TEMPLATES[name](scene, rng)
        attempts += 1
        if text is not None and (_sentence(text) not in captions or attempts > 50):
            captions.append(_sentence(text))
    return captions


def make_scenes(split: str, n: int, seed: int = 0) -> list[tuple[Scene, list[str]]]:
    """Scenes and captions of one split without drawing anything (cheap: used by tests and analyses).
    `split` is a Karpathy split name: train, val or test."""
    if split not in SPLIT_CODES:
        raise ConfigError(f"unknown synthetic split {split!r}", hint=f"use one of {', '.join(SPLIT_CODES)}")
    out = []
    for i in range(n):
        scene = sample_scene(_rng(seed, split, i, 0))
        out.append((scene, describe_scene(scene, _rng(seed, split, i, 1))))
    return out


# ------------------------------------------------------------------------------------------------ pixels

def _background(scene: Scene, size: int, rng: np.random.Generator) -> Image.Image:
    base = np.array(scene.bg_rgb, dtype=np.float32)
    if scene.texture == "plain":
        return Image.new("RGB", (size, size), scene.bg_rgb)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    if scene.texture == "stripes":
        period = float(rng.uniform(10, 22))
        angle = float(rng.uniform(0, np.pi))
        wave = np.sin(2 * np.pi * (xx * np.cos(angle) + yy * np.sin(angle)) / period)
        delta = 5.0 * np.sign(wave)
    else:  # mottled: smooth low-frequency blotches
        coarse = Image.fromarray(rng.integers(0, 256, size=(6, 6), dtype=np.uint8), mode="L")
        smooth = np.asarray(coarse.resize((size, size), Image.BICUBIC), dtype=np.float32)
        delta = (smooth - 128.0) / 128.0 * 12.0
    pixels = np.clip(base[None, None, :] + delta[..., None], 0, 255).astype(np.uint8)
    return Image.fromarray(pixels, mode="RGB")


def _polygon(shape: str, cx: float, cy: float, r: float) -> list[tuple[float, float]]:
    if shape == "square":
        h = r * 0.88  # similar area to the circle
        return [(cx - h, cy - h), (cx + h, cy - h), (cx + h, cy + h), (cx - h, cy + h)]
    if shape == "triangle":
        return [(cx, cy - r), (cx + r * 0.98, cy + r * 0.72), (cx - r * 0.98, cy + r * 0.72)]
    if shape == "diamond":
        return [(cx, cy - r), (cx + r * 0.78, cy), (cx, cy + r), (cx - r * 0.78, cy)]
    if shape == "star":
        angles = -np.pi / 2 + np.arange(10) * np.pi / 5
        radii = np.where(np.arange(10) % 2 == 0, r, r * 0.47)
        return [(cx + float(q * np.cos(t)), cy + float(q * np.sin(t)))
                for q, t in zip(radii, angles, strict=True)]
    raise ValueError(f"unknown shape {shape!r}")


def draw_scene(scene: Scene, image_size: int, rng: np.random.Generator) -> Image.Image:
    """Render `scene` as an RGB image of side `image_size` (shapes anti-aliased, interiors flat)."""
    big = image_size * SUPERSAMPLE
    layer = Image.new("RGBA", (big, big), (0, 0, 0, 0))
    draw = ImageDraw.Draw(layer)
    for o in scene.objects:
        cx, cy, r = o.cx * big, o.cy * big, o.radius * big
        fill = (*o.rgb, 255)
        if o.shape == "circle":
            draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
        else:
            draw.polygon(_polygon(o.shape, cx, cy, r), fill=fill)
    # premultiplied alpha for the down-sampling, so edges do not pick up the transparent black
    layer = layer.convert("RGBa").resize((image_size, image_size), Image.BOX).convert("RGBA")
    image = _background(scene, image_size, rng).convert("RGBA")
    return Image.alpha_composite(image, layer).convert("RGB")


# ------------------------------------------------------------------------------------------------ driver

def _image_name(split: str, index: int) -> str:
    return f"{split}_{index:05d}.png"


_OUR_IMAGE = re.compile(r"^(train|val|test)_\d{5}\.png$")


def render_synthetic(out_dir: Path, *, n_train: int = 1500, n_dev: int = 200, n_test: int = 200,
                     image_size: int = 224, seed: int = 0, force: bool = False,
                     progress: bool = True) -> Path:
    """Render the synthetic dataset into `out_dir` and return the path of its Karpathy JSON.

    Writes `out_dir/images/{train,val,test}_{i:05d}.png` and, last and atomically,
    `out_dir/dataset_synth.json` (Karpathy format, splits train/val/test; `read_captions` reads val as
    dev). Image ids are the bare file names (no Karpathy `filepath`), the Flickr8K/Flickr30K convention:
    the image folder is `out_dir/images`, e.g. `itmatch extract OUT/images OUT/dataset_synth.json`.
    A non-empty `out_dir` is refused unless `force`; with `force` only files this function writes
    (the JSON and `images/<split>_NNNNN.png`) are removed first, nothing else in the directory.
    """
    out_dir = Path(out_dir)
    counts = {"train": n_train, "val": n_dev, "test": n_test}
    for split, n in counts.items():
        if not isinstance(n, int) or n < 0:
            raise ConfigError(f"number of {split} images must be a non-negative integer, got {n!r}")
    if sum(counts.values()) == 0:
        raise ConfigError("nothing to render: all split sizes are 0")
    if n_train > 99999 or n_dev > 99999 or n_test > 99999:
        raise ConfigError("at most 99999 images per split (file names have five digits)")
    if not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"seed must be a non-negative integer, got {seed!r}")
    if not isinstance(image_size, int) or image_size < 32:
        raise ConfigError(f"image_size must be an integer >= 32, got {image_size!r}")
    if out_dir.exists() and not out_dir.is_dir():
        raise DataError("output path exists and is not a directory", path=out_dir,
                        hint="choose a directory path for the synthetic dataset")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        refuse_overwrite(out_dir, force)
        (out_dir / SYNTH_JSON).unlink(missing_ok=True)  # first: the old dataset stops looking complete
        images_old = out_dir / IMAGES_SUBDIR
        if images_old.is_dir():
            for p in images_old.iterdir():
                if _OUR_IMAGE.match(p.name):
                    p.unlink()
    images_dir = out_dir / IMAGES_SUBDIR
    images_dir.mkdir(parents=True, exist_ok=True)

    entries = []
    sentid = 0
    with tqdm(total=sum(counts.values()), desc="synth: rendering", unit="img", disable=not progress) as bar:
        for split, n in counts.items():
            for i, (scene, captions) in enumerate(make_scenes(split, n, seed)):
                name = _image_name(split, i)
                draw_scene(scene, image_size, _rng(seed, split, i, 2)).save(
                    images_dir / name, format="PNG", compress_level=6)
                imgid = len(entries)
                sentences = [{"raw": c, "tokens": re.findall(r"[a-z]+", c.lower()), "imgid": imgid,
                              "sentid": sentid + k} for k, c in enumerate(captions)]
                entries.append({
                    "filename": name, "split": split, "imgid": imgid,
                    "sentids": [s["sentid"] for s in sentences], "sentences": sentences,
                    "background": scene.background, "texture": scene.texture,
                    "objects": [_object_record(o, image_size) for o in scene.objects],
                })
                sentid += len(sentences)
                bar.update(1)
    meta = {"generator": "itmatch.data.synth", "seed": seed, "image_size": image_size,
            "n_train": n_train, "n_dev": n_dev, "n_test": n_test}
    json_path = out_dir / SYNTH_JSON
    # compact like Karpathy's own files (indenting triples the size); atomic and last
    write_text_atomic(json_path, json.dumps({"dataset": "synth", "info": meta, "images": entries},
                                            separators=(",", ":")) + "\n")
    return json_path


def _object_record(o: SceneObject, image_size: int) -> dict:
    """JSON form of an object, with its pixel bounding box (for attention-map checks)."""
    record = asdict(o)
    record["rgb"] = list(o.rgb)
    r = o.radius * image_size
    record["bbox"] = [round(o.cx * image_size - r, 1), round(o.cy * image_size - r, 1),
                      round(o.cx * image_size + r, 1), round(o.cy * image_size + r, 1)]
    for key in ("cx", "cy", "radius"):
        record[key] = round(record[key], 5)
    return record
