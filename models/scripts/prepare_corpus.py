"""Split the shared corpus by document into train / held-out, and cut the shipped calibration sets.

Why a document split: evaluation text must never have been seen in training, and a line-level split would
leak neighbouring lines of the same file. Membership is decided by a hash of the document's ``source`` so the
split is stable across machines and reruns, and the exact lists are written to ``split.json``.

Usage (from the repository root)::

    python models/scripts/prepare_corpus.py --corpus ../shared/corpus --work .train
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import random
import shutil
from pathlib import Path

CORPUS_FILES = {"prose": "python-docs.jsonl.gz", "code": "python-stdlib.jsonl.gz"}
HELDOUT_PERCENT = 5
CALIB_DOCS = 96
CALIB_MAX_CHARS_PER_DOC = 6000
SEED = 0


def is_heldout(source: str) -> bool:
    """Deterministic 5% document split from the sha256 of the document's source path."""
    return int(hashlib.sha256(source.encode()).hexdigest(), 16) % 100 < HELDOUT_PERCENT


def read_jsonl_gz(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def write_jsonl_gz(path: Path, docs: list[dict]) -> None:
    # mtime=0 keeps the gzip bytes identical across reruns.
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz:
        for d in docs:
            gz.write((json.dumps({"source": d["source"], "text": d["text"]}, ensure_ascii=False) + "\n").encode())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, default=Path("../shared/corpus"))
    ap.add_argument("--work", type=Path, default=Path(".train"), help="where the full train split goes (not shipped)")
    ap.add_argument("--calibration", type=Path, default=Path("calibration"))
    ap.add_argument("--split-file", type=Path, default=Path("models/quantkit-tiny/split.json"))
    args = ap.parse_args()

    rng = random.Random(SEED)
    train_all: list[dict] = []
    heldout_all: list[dict] = []
    split: dict[str, dict[str, list[str]]] = {}
    args.calibration.mkdir(parents=True, exist_ok=True)
    for kind, name in CORPUS_FILES.items():
        docs = read_jsonl_gz(args.corpus / name)
        train = [d for d in docs if not is_heldout(d["source"])]
        held = [d for d in docs if is_heldout(d["source"])]
        split[kind] = {"train": [d["source"] for d in train], "heldout": [d["source"] for d in held]}
        train_all += train
        heldout_all += held
        # Calibration: a fixed random sample of *training* documents, each cut to a bounded prefix.
        picked = rng.sample(train, CALIB_DOCS)
        calib = [{"source": d["source"], "text": d["text"][:CALIB_MAX_CHARS_PER_DOC]} for d in picked]
        write_jsonl_gz(args.calibration / f"{kind}.jsonl.gz", calib)

    write_jsonl_gz(args.calibration / "heldout.jsonl.gz", heldout_all)
    shutil.copyfile(args.corpus / "LICENSE-PSF.txt", args.calibration / "LICENSE-PSF.txt")
    args.work.mkdir(parents=True, exist_ok=True)
    write_jsonl_gz(args.work / "train.jsonl.gz", train_all)
    args.split_file.parent.mkdir(parents=True, exist_ok=True)
    args.split_file.write_text(json.dumps({"rule": f"sha256(source) % 100 < {HELDOUT_PERCENT} -> heldout",
                                           **split}, indent=1) + "\n")
    print(f"train {len(train_all)} docs, heldout {len(heldout_all)} docs "
          f"({sum(len(d['text']) for d in heldout_all)} chars)")


if __name__ == "__main__":
    main()
