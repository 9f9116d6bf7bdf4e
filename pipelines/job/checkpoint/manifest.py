"""A step's ``COMPLETE`` marker: written last, it says the step is whole and records what whole means.

    {"freescale_checkpoint": 2, "world_size": 2, "format": "dcp",
     "files": {"rank0.pt": {"size": 2221, "sha256": "..."}, ".metadata": {...},
               "__0_0.distcp": {"size": 1804, "sha256": "...",
                                "items": [{"fqn": "model.0.weight", "offset": [0, 0], "start": 0, "length": 1192,
                                           "crc32": 3141592653}, ...]}}}

Every file of the step is listed with its size and sha256 (computed from the bytes in memory for a rank file, read
back right after DCP wrote them for its data files and ``.metadata``), and each DCP item of a data file with its byte
range and crc32, so that a damaged data file is named with the item it damages. A marker that does not parse (cut
short, damaged) is a step that does not verify, never a KeyError later.

The sums find damage and a mix of two jobs' files; they are no signature: whoever can write the step folder can
rewrite COMPLETE too (loading stays safe for other reasons: pipelines.job.checkpoint.dcp).

Markers written before the sums (``W`` for one file per rank, ``W dcp``) still load, unverified, and say so:
:attr:`Manifest.files` is None for them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from pipelines.job.checkpoint.reading import FileSum, ItemSum, plain_name, read_checked

MARKER = "COMPLETE"
VERSION = 2
METADATA = ".metadata"  # DCP's index of the step (pipelines.job.checkpoint.dcp.METADATA_FILE)


@dataclass(frozen=True)
class Manifest:
    world_size: int
    format: str  # "dcp", or "files" for the earliest format (one torch.save per rank)
    files: Optional[dict[str, FileSum]]  # None: a marker written before the sums

    @property
    def verified(self) -> bool:
        return self.files is not None


def encode(world_size: int, format: str, files: dict[str, FileSum]) -> bytes:
    def one(s: FileSum) -> dict[str, Any]:
        out: dict[str, Any] = {"size": s.size, "sha256": s.sha256}
        if s.items:
            out["items"] = [
                {
                    "fqn": i.fqn,
                    "offset": None if i.offset is None else list(i.offset),
                    "start": i.start,
                    "length": i.length,
                    "crc32": i.crc32,
                }
                for i in s.items
            ]
        return out

    body = {"freescale_checkpoint": VERSION, "world_size": world_size, "format": format}
    body["files"] = {name: one(s) for name, s in sorted(files.items())}
    return (json.dumps(body, separators=(",", ":")) + "\n").encode()


def read(directory: str | Path) -> Manifest:
    """The marker of step folder ``directory``; ValueError (one line) when it is missing or does not parse."""
    directory = Path(directory)
    try:
        text = read_checked(directory, MARKER).decode("utf-8")
    except FileNotFoundError:
        raise ValueError(
            f"{directory} is not a complete checkpoint (no {MARKER} marker: the save was interrupted, or this is "
            "not a step directory)"
        ) from None
    except UnicodeDecodeError:
        raise ValueError(f"{directory / MARKER}: unreadable marker (not text: damaged?)") from None
    if not text.lstrip().startswith("{"):
        return _earlier(directory, text)
    try:
        return _parse(json.loads(text))
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        detail = " ".join(str(e).split()) or type(e).__name__
        raise ValueError(f"{directory / MARKER}: unreadable marker (cut short or damaged?): {detail}") from None


def _earlier(directory: Path, text: str) -> Manifest:
    """``W`` or ``W dcp``: a marker written before the sums."""
    words = text.split()
    if len(words) in (1, 2) and words[0].isdigit() and int(words[0]) > 0 and words[1:] in ([], ["dcp"]):
        return Manifest(int(words[0]), words[1] if len(words) > 1 else "files", None)
    raise ValueError(
        f"{directory / MARKER}: unreadable marker (cut short or damaged?): {text[:40]!r} is neither a checkpoint's "
        "record of its files nor an earlier 'W' or 'W dcp' marker"
    )


def _int(value: Any, what: str) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"{what} is {value!r}, not a count")
    return value


def _parse(body: Any) -> Manifest:
    if body.get("freescale_checkpoint") != VERSION:
        raise ValueError(f"version {body.get('freescale_checkpoint')!r}, this FreeScale reads {VERSION}")
    world = _int(body["world_size"], "world_size")
    if world < 1 or body["format"] != "dcp":
        raise ValueError(f"world size {world}, format {body['format']!r} (expected >= 1 and 'dcp')")
    files = {}
    for name, entry in body["files"].items():
        plain_name(name, MARKER)
        sha = entry["sha256"]
        if type(sha) is not str or len(sha) != 64:
            raise ValueError(f"{name}: sha256 {sha!r}")
        items = tuple(
            ItemSum(
                str(i["fqn"]),
                None if i["offset"] is None else tuple(_int(o, "offset") for o in i["offset"]),
                _int(i["start"], "start"),
                _int(i["length"], "length"),
                _int(i["crc32"], "crc32"),
            )
            for i in entry.get("items", [])
        )
        files[name] = FileSum(_int(entry["size"], f"{name} size"), sha, items)
    missing = [n for n in [*(f"rank{r}.pt" for r in range(world)), METADATA] if n not in files]
    if missing:
        raise ValueError(f"it lists no {', '.join(missing)}")
    return Manifest(world, "dcp", files)
