"""Write the small example catalog of docs/your-own-model.md (deterministic).

240 items in 8 categories of 30; each item's embedding is its category's centre plus noise.
Each of 600 users mostly follows one category, in order of the items' numbers (a user who
bought item 12 tends to buy 13 to 15 next), with some picks from a second category.

    python examples/own-items/make_example.py examples/own-items
"""

import json
import sys
from pathlib import Path

import numpy as np

CATEGORIES = ("tents", "boots", "lamps", "stoves", "packs", "maps", "ropes", "knives")
PER_CATEGORY, USERS, DIM = 30, 600, 16


def main(folder: Path) -> None:
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(len(CATEGORIES), DIM))
    items, vectors, titles = [], [], {}
    for c, name in enumerate(CATEGORIES):
        for i in range(PER_CATEGORY):
            item = f"{name}-{i:02d}"
            items.append(item)
            vectors.append(centres[c] + 0.3 * rng.normal(size=DIM))
            titles[item] = f"{name[:-1].capitalize()} model {i}"
    lines = []
    for user in range(USERS):
        main_c, other = rng.choice(len(CATEGORIES), size=2, replace=False)
        position = int(rng.integers(PER_CATEGORY))
        seq = []
        for _ in range(int(rng.integers(5, 13))):
            if rng.random() < 0.8:
                position = (position + int(rng.integers(1, 4))) % PER_CATEGORY
                seq.append(items[main_c * PER_CATEGORY + position])
            else:
                seq.append(items[other * PER_CATEGORY + int(rng.integers(PER_CATEGORY))])
        lines.append(json.dumps({"user_id": f"u{user}", "items": seq}))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "interactions.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "item_ids.txt").write_text("\n".join(items) + "\n")
    np.save(folder / "embeddings.npy", np.asarray(vectors, dtype=np.float32))
    (folder / "titles.json").write_text(json.dumps(titles, indent=0) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent))
